"""The `engramkv` command over a tiny model: every command documented, ingest/ask/recall/stats/sessions work."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from engramkv import EngineConfig, Session, cli
from engramkv.config import RecallConfig, SegmentationConfig, StoreConfig, WindowConfig
from engramkv.retrieval.allocation import FEATURES

from conftest import VOCAB, tiny_pair

CFG = EngineConfig(
    window=WindowConfig(chunk_size=32, n_sink=8, n_local=64),
    recall=RecallConfig(budget_tokens=64),
    segmentation=SegmentationConfig(min_event=4, max_event=24),
    store=StoreConfig(codec="int8", commit_tokens=96),
)
README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.fixture(autouse=True)
def tiny_model(monkeypatch):
    monkeypatch.setattr(cli, "load_model", lambda name, quiet=False: tiny_pair("llama", CFG)[1])


def _doc(path: Path, n: int = 800, seed: int = 0) -> Path:
    ids = torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    path.write_text(" ".join(map(str, ids)) + "\n")
    return path


def _subcommands() -> dict[str, object]:
    parser = cli.build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return dict(action.choices)  # type: ignore[arg-type]


def test_every_command_has_help_and_is_in_the_readme():
    readme = README.read_text()
    commands = _subcommands()
    assert set(commands) == {"ingest", "ask", "recall", "stats", "sessions", "chat", "calibrate", "fit-bases", "serve"}
    for name, sub in commands.items():
        assert sub.description, f"{name} has no --help description"  # type: ignore[attr-defined]
        assert f"engramkv {name}" in readme, f"`engramkv {name}` is not documented in the README"
        with pytest.raises(SystemExit) as exit_info:
            cli.main([name, "--help"])
        assert exit_info.value.code == 0


def test_ingest_then_ask_recall_stats_and_sessions(tmp_path, capsys):
    doc = _doc(tmp_path / "doc.txt")
    store = str(tmp_path / "store")
    assert cli.main(["ingest", str(doc), "--store", store, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)[0]
    assert report["tokens"] == 800 and report["events_sealed"] > 10

    assert cli.main(["ingest", str(doc), "--store", store]) == 0
    again = capsys.readouterr()
    assert "already in the store" in again.out and "doc.txt" not in again.err  # no (empty) progress bar

    assert cli.main(["ask", "1 2 3", "--store", store, "--json", "--max-new-tokens", "4"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert len(answer["answer"].split()) == 4 and len(answer["recalled"]) == 3
    assert answer["recalled"][0]["document"] == str(doc.resolve())
    assert answer["plan"]["budget_tokens"] > 0
    assert answer["plan"]["theta"] == {"k": 4, "s": 16, "n": 1, "m": 0, "w": 64}  # the fixed default
    assert answer["plan"]["context_tokens"] > answer["plan"]["budget_tokens"]
    assert answer["plan"]["window_from"] is None and answer["plan"]["window_gap"] is None  # the whole window
    assert cli.main(["ask", "1 2 3", "--store", store, "--show-recall", "--max-new-tokens", "2"]) == 0
    printed = capsys.readouterr().out
    assert "theta: k=4 events, s=16 tokens each" in printed and "i_doc not measured" in printed

    assert cli.main(["ask", "1 2 3", "--store", store, "--json", "--max-new-tokens", "2", "--budget-tokens", "5"]) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["budget_tokens"] == 0  # the window alone is over 5 tokens

    assert cli.main(["recall", "5 6 7", "--store", store, "-k", "2", "--json"]) == 0
    recalled = json.loads(capsys.readouterr().out)
    assert len(recalled) == 2 and recalled[0]["score"] >= recalled[1]["score"]

    assert cli.main(["stats", "--store", store, "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["tokens"] == 800 and stats["committed_tokens"] == 800 and stats["disk_bytes"] > 0

    assert cli.main(["sessions", "list", "--store", store, "--json"]) == 0
    assert [s["session_id"] for s in json.loads(capsys.readouterr().out)] == ["default"]
    assert cli.main(["sessions", "delete", "--store", store, "--yes"]) == 0
    assert cli.main(["sessions", "list", "--store", store]) == 0
    assert "no sessions" in capsys.readouterr().out


def test_bad_input_gets_a_message_and_changes_nothing(tmp_path, capsys):
    binary = tmp_path / "image.png"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00")
    store = tmp_path / "store"
    assert cli.main(["ingest", str(binary), "--store", str(store)]) == 1
    assert "binary" in capsys.readouterr().err
    assert not list(store.rglob("*.seg"))
    assert cli.main(["ask", "hello", "--store", str(tmp_path / "missing")]) == 1
    assert "no engramkv store" in capsys.readouterr().err
    assert cli.main(["ingest", str(_doc(tmp_path / "d.txt")), "--store", str(store), "--user", "../etc"]) == 1
    assert "invalid user_id" in capsys.readouterr().err


def test_ingest_workers_reaches_the_session_and_a_short_file_is_read_in_one_piece(tmp_path, capsys, monkeypatch):
    doc = _doc(tmp_path / "doc.txt")  # ~3 KB: below shards.min_shard_bytes, so no Ray is started
    seen = []
    real = Session.ingest_file
    monkeypatch.setattr(Session, "ingest_file", lambda self, path, progress=None, workers=None: (
        seen.append(self.cfg.shards), real(self, path, progress, workers))[1])
    assert cli.main(["ingest", str(doc), "--store", str(tmp_path / "store"), "--workers", "3", "--ray-address",
                     "auto", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["tokens"] == 800
    assert seen[0].workers == 3 and seen[0].ray_address == "auto"


def test_ctrl_c_then_the_same_command_resumes(tmp_path, capsys, monkeypatch):
    import os
    import signal

    doc = _doc(tmp_path / "doc.txt", n=1500)
    store = str(tmp_path / "store")
    from engramkv.session import Session

    real = Session.ingest_file
    chunks = [0]

    def interrupted(self, path, progress=None):
        def press(record):
            chunks[0] += 1
            if progress is not None:
                progress(record)
            if chunks[0] == 15:
                os.kill(os.getpid(), signal.SIGINT)

        return real(self, path, progress=press)

    monkeypatch.setattr(Session, "ingest_file", interrupted)
    assert cli.main(["ingest", str(doc), "--store", store]) == 130
    assert "run the same command again to resume" in capsys.readouterr().err
    monkeypatch.setattr(Session, "ingest_file", real)
    assert cli.main(["ingest", str(doc), "--store", store]) == 0
    captured = capsys.readouterr()
    assert "resuming" in captured.err and "resumed at byte" in captured.out
    # The resumed bar counts from where it resumed: no negative rate from the tokens stored before.
    rates = [int(r.replace(",", "")) for r in re.findall(r"(-?[\d,]+) tok/s", captured.err)]
    assert rates and min(rates) >= 0


def test_calibrate_fit_only_writes_coefficients_an_ask_can_use(tmp_path, capsys):
    work = tmp_path / "work"
    work.mkdir()
    rows = []
    for i in range(8):
        for k, score in ((1, 0.2), (4, 0.6 + 0.02 * i)):
            rows.append({"sample": f"s{i}", "task": "t", "length": 0, "seed": i,
                         "theta": {"k": k, "s": 16, "n": 1, "m": 0, "w": 64}, "features": [i, 0.5, 1, 0.0, 0.1],
                         "reply": "", "score": score, "context_tokens": 100 + 16 * k})
    (work / "observations.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "allocation.json"
    assert cli.main(["calibrate", "--fit-only", "--work-dir", str(work), "--out", str(out),
                     "--model-id", "tiny-llama"]) == 0
    printed = capsys.readouterr().out
    assert "R^2" in printed and "no_interaction" in printed and out.exists()
    assert cli.main(["calibrate", "--fit-only", "--work-dir", str(tmp_path / "empty"), "--out", str(out)]) == 1
    assert "no observations" in capsys.readouterr().err

    store = str(tmp_path / "store")
    assert cli.main(["ingest", str(_doc(tmp_path / "doc.txt")), "--store", store]) == 0
    assert cli.main(["ask", "1 2 3", "--store", store, "--json", "--max-new-tokens", "2", "--allocation", "model",
                     "--coefficients", str(out)]) == 0
    plan = json.loads(capsys.readouterr().out.splitlines()[-1])["plan"]
    assert plan["theta"] is not None and list(plan["features"]) == list(FEATURES)


def test_fit_bases_writes_a_bases_file_and_refuses_to_overwrite_it(tmp_path, capsys):
    from engramkv.storage.lowrank import LowRankBases

    doc, out = _doc(tmp_path / "calibration.txt", n=1500), tmp_path / "bases.safetensors"
    args = ["fit-bases", "--out", str(out), "--text", str(doc), "--tokens", "1024"]
    assert cli.main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out.splitlines()[-1])
    bases = LowRankBases.load(out)
    assert report["code_bits"]["keys"] == [p.code_bits for p in bases.keys] and len(bases.values) == 3
    assert bases.fingerprint["model_id"] == "tiny-llama"
    assert cli.main(args) == 1 and "--force" in capsys.readouterr().err
    assert cli.main([*args, "--force"]) == 0 and "code bits per token per layer" in capsys.readouterr().out
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00")
    assert cli.main(["fit-bases", "--out", str(tmp_path / "x"), "--text", str(tmp_path / "binary.txt")]) == 1
    assert "UTF-8" in capsys.readouterr().err


def test_calibrate_config_file_errors_are_clear(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"recall": {"answer_reading": "sideways"}}')
    assert cli.main(["calibrate", "--config", str(bad), "--fit-only", "--work-dir", str(tmp_path)]) != 0
    assert "answer_reading" in capsys.readouterr().err
    assert cli.main(["calibrate", "--config", str(tmp_path / "none.json"), "--fit-only"]) != 0
    assert "cannot read a JSON config" in capsys.readouterr().err


def test_calibrate_config_file_changes_only_the_fields_it_names(tmp_path):
    path = tmp_path / "centred.json"
    path.write_text('{"recall": {"answer_reading": "centred"}}')
    cfg = cli.config_file(str(path))
    assert cfg.recall.answer_reading == "centred"
    assert cfg.recall.model_dump(exclude={"answer_reading"}) == EngineConfig().recall.model_dump(exclude={"answer_reading"})


def test_ingest_codec_and_config_choose_a_new_stores_codec_and_refuse_another(tmp_path, capsys):
    bases = tmp_path / "bases.safetensors"
    assert cli.main(["fit-bases", "--out", str(bases), "--text", str(_doc(tmp_path / "cal.txt", n=1500)),
                     "--tokens", "1024", "--json"]) == 0
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"store": {"lowrank": {"bases": str(bases)}, "index": {"rank": 8}}}))
    store, doc = str(tmp_path / "store"), str(_doc(tmp_path / "doc.txt"))
    capsys.readouterr()
    assert cli.main(["ingest", doc, "--store", store, "--codec", "lowrank", "--config", str(config), "--json"]) == 0
    assert cli.main(["stats", "--store", store, "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["codec"].startswith("lowrank:")
    assert cli.main(["ingest", doc, "--store", store, "--codec", "int8"]) == 1
    err = capsys.readouterr().err
    assert "created with codec 'lowrank'" in err and "new --store" in err
    assert cli.main(["ingest", doc, "--store", store, "--json"]) == 0  # no --codec: the store's own


@pytest.mark.parametrize("argv, option", [
    (["ingest", "doc.txt", "--workers", "0"], "--workers"),
    (["ask", "hi", "--max-new-tokens", "-1"], "--max-new-tokens"),
    (["ask", "hi", "-k", "-1"], "-k"),
    (["ask", "hi", "--budget-tokens", "-5"], "--budget-tokens"),
    (["recall", "hi", "-k", "0"], "-k"),
    (["calibrate", "--samples", "0"], "--samples"),
    (["calibrate", "--lengths", "4096", "0"], "--lengths"),
    (["fit-bases", "--out", "b.safetensors", "--tokens", "zero"], "--tokens"),
    (["serve", "--port", "70000"], "--port"),
])
def test_a_count_out_of_range_is_refused_before_the_model_loads(monkeypatch, capsys, argv, option):
    monkeypatch.setattr(cli, "load_model", lambda name, quiet=False: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert f"argument {option}" in capsys.readouterr().err


def test_wrong_option_values_and_outputs_get_one_line_and_no_work(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "load_model", lambda name, quiet=False: pytest.fail("the model was loaded"))
    doc = _doc(tmp_path / "calibration.txt", n=1500)
    assert cli.main(["fit-bases", "--out", str(tmp_path / "b.safetensors"), "--text", str(doc),
                     "--key-error", "-1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: --key-error: ") and len(err.strip().splitlines()) == 1
    assert cli.main(["fit-bases", "--out", str(tmp_path), "--text", str(doc)]) == 1
    assert "is a directory" in capsys.readouterr().err
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert cli.main(["fit-bases", "--out", str(blocker / "b.safetensors"), "--text", str(doc)]) == 1
    assert "cannot create" in capsys.readouterr().err
    assert cli.main(["calibrate", "--fit-only", "--out", str(tmp_path), "--work-dir", str(tmp_path)]) == 1
    assert "is a directory" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text('{"recall": {"budget_tokens": "many"}, "window": {"n_sink": -1}}')
    assert cli.main(["calibrate", "--config", str(bad), "--fit-only", "--work-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "recall.budget_tokens: " in err and "window.n_sink: " in err


def test_a_store_that_is_missing_or_cannot_be_made_is_a_clear_error(tmp_path, capsys):
    missing = tmp_path / "missing"
    assert cli.main(["sessions", "delete", "--store", str(missing), "--yes"]) == 1
    assert "no engramkv store" in capsys.readouterr().err and not missing.exists()
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert cli.main(["ingest", str(_doc(tmp_path / "d.txt")), "--store", str(blocker / "store")]) == 1
    err = capsys.readouterr().err
    assert "cannot create the store directory" in err and "Traceback" not in err


def test_ingest_json_keeps_the_reports_of_the_files_read_before_one_is_refused(tmp_path, capsys):
    binary = tmp_path / "image.png"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00")
    doc = _doc(tmp_path / "d.txt")
    assert cli.main(["ingest", str(doc), str(binary), "--store", str(tmp_path / "store"), "--json"]) == 1
    captured = capsys.readouterr()
    assert [r["path"] for r in json.loads(captured.out)] == [str(doc)] and "binary" in captured.err
