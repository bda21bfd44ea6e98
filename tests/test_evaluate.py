"""The evaluation harness: every task makes a sample of its length; --quick runs every default system;
result files record their provenance; passkey.py is a preset of the harness over the one passkey generator."""

import html
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import _common  # noqa: E402
import passkey as passkey_preset  # noqa: E402
from conftest import VOCAB, tiny_pair  # noqa: E402
from evalkit.systems import DEFAULT_SYSTEMS as SYSTEMS  # noqa: E402
from evalkit.systems import (  # noqa: E402
    OPTIONAL_SYSTEMS,
    RssSampler,
    _engram_answer,
    _read_texts,
    _resident_text,
    reply_tokens,
    system_config,
)

from engramkv import EngineConfig, Theta  # noqa: E402
from engramkv.config import SegmentationConfig, WindowConfig  # noqa: E402
from engramkv.retrieval.question import RecallPlan  # noqa: E402
from engramkv.tasks import CALIBRATION_SEEDS  # noqa: E402
from engramkv.tasks import TASKS, Sample  # noqa: E402


class CharTokenizer:
    """One token per character: enough for the generators, which only count tokens."""

    def encode(self, text, add_special_tokens=False):
        return list(text.encode())


def test_write_results_records_commit_config_machine_and_command(tmp_path):
    json_path, md_path = _common.write_results(tmp_path / "bench", "run", {"figure": 1.5}, "# table\n",
                                               EngineConfig())
    payload = json.loads(json_path.read_text())
    assert payload["figure"] == 1.5 and payload["config"] == EngineConfig().model_dump(mode="json")
    assert payload["commit"] == _common._git("rev-parse", "HEAD") and payload["dirty"] in (True, False, None)
    assert payload["command"].startswith("python ") and {"python", "torch", "platform"} <= set(payload["machine"])
    assert md_path.read_text().startswith("# table\n") and str(payload["commit"]) in md_path.read_text()


def test_every_system_has_a_recorded_config():
    for name in [*SYSTEMS, *OPTIONAL_SYSTEMS]:
        json.dumps(_common._plain(system_config(name)))
    assert system_config("engram-store-int2").store.codec == "int2"
    assert "infllm" in SYSTEMS and "inflm" not in SYSTEMS


def test_passkey_script_is_a_preset_of_the_harness():
    parser = passkey_preset.evaluate.build_parser(passkey_preset.__doc__)
    parser.set_defaults(**passkey_preset.DEFAULTS)
    args = parser.parse_args(["--lengths", "8192"])
    assert args.tasks == ["passkey"] and args.systems == ["engram", "full"] and args.samples == 5
    assert args.lengths == [8192] and args.out == _common.RESULTS / "passkey"


def test_the_recorded_command_names_every_rerun_flag_and_a_piece_rerun_takes_only_the_models_piece_answers():
    evaluate = passkey_preset.evaluate
    argv = ["--name", "grid", "--tasks", "passkey", "--systems", "engram-alloc", "engram", "--lengths", "4096",
            "--resume", "--rerun-empty", "engram", "--rerun-piece", "engram-alloc"]
    assert evaluate._argv(evaluate.build_parser().parse_args(argv))[-4:] == ["--rerun-empty", "engram",
                                                                              "--rerun-piece", "engram-alloc"]
    whole, none = {"k": 2, "s": 32, "n": 2, "m": 0, "w": 1024}, {"k": 1, "s": 128, "n": 1, "m": 0, "w": 0}
    assert evaluate._read_piece({"system": "engram-alloc-chat", "theta": whole})
    assert not evaluate._read_piece({"system": "engram-alloc", "theta": none})
    assert not evaluate._read_piece({"system": "engram", "theta": whole})  # a fixed theta reads the whole window
    assert not evaluate._read_piece({"system": "rag", "theta": None})


def test_a_rerun_narrowed_to_some_tasks_keeps_the_runs_outside_them():
    evaluate = passkey_preset.evaluate
    args = evaluate.build_parser().parse_args(["--tasks", "kv", "--systems", "engram-chat", "rag", "--lengths",
                                               "4096", "--samples", "2", "--resume", "--rerun", "engram-chat"])
    old = {"system": "engram-chat", "length": 4096, "seed": 0, "reply": "x", "theta": None, "commit": "0" * 40}
    runs = [{**old, "task": "kv"}, {**old, "task": "passkey"}, {**old, "task": "kv", "seed": 2},
            {**old, "task": "kv", "length": 8192}, {**old, "task": "kv", "system": "rag"}]
    assert evaluate.kept_runs(args, runs) == runs[1:]  # only kv 4k seeds 0-1 of engram-chat run again
    with pytest.raises(SystemExit, match="not in --systems"):
        evaluate.main(["--systems", "rag", "--resume", "--rerun", "engram-chat"])


def test_first_seed_moves_the_grid_to_fresh_questions_and_keeps_below_the_calibrations_seeds():
    evaluate = passkey_preset.evaluate
    argv = ["--tasks", "kv", "--systems", "engram-chat", "--lengths", "4096", "--samples", "2", "--first-seed", "20"]
    args = evaluate.build_parser().parse_args([*argv, "--resume", "--rerun", "engram-chat"])
    assert list(evaluate.seeds(args)) == [20, 21]
    assert evaluate._argv(evaluate.build_parser().parse_args(argv))[-5:-2] == ["2", "--first-seed", "20"]
    old = {"task": "kv", "system": "engram-chat", "length": 4096, "reply": "x", "theta": None, "commit": "0" * 40}
    runs = [{**old, "seed": seed} for seed in (0, 20, 21, 22)]
    assert evaluate.kept_runs(args, runs) == [runs[0], runs[3]]  # only seeds 20-21 are this grid's
    with pytest.raises(SystemExit, match="below the calibration"):
        evaluate.main([*argv[:-1], str(CALIBRATION_SEEDS - 1)])


def test_passkey_sample_is_the_passkey_task_at_a_given_depth():
    tokenizer = CharTokenizer()
    context, prompt, key = _common.passkey_sample(tokenizer, 3000, depth=0.25, seed=7)
    sample = TASKS["passkey"](tokenizer, 3000, 7, depth=0.25)
    assert (context, prompt, key) == (sample.context[0], sample.prompt, sample.answers[0])
    assert abs(sample.meta["depth"] - 0.25) < 0.05 and key in context
    assert TASKS["passkey"](tokenizer, 3000, 7).answers == [key]  # the seed chooses the key either way


@pytest.mark.parametrize("task", ["passkey", "kv", "niah-single", "niah-multikey", "niah-multivalue",
                                  "niah-multiquery", "conversation"])
def test_a_reply_has_room_to_restate_its_question_and_give_every_answer(default_lm, task):
    tokenizer = default_lm.tokenizer
    for seed in range(3):
        sample = TASKS[task](tokenizer, 4096, seed)
        room = reply_tokens(tokenizer, sample)
        restated = f"{sample.chat_question} {' '.join(sample.answers)}"
        assert room >= len(tokenizer.encode(restated, add_special_tokens=False))
        # kv's question and answer are two UUIDs (35 tokens each): a flat 64 cut its chat replies; the other
        # tasks keep the 64 their grid runs were made with.
        assert (room > 80) if task == "kv" else (room == 64)


@pytest.fixture
def facts_corpus(tmp_path, monkeypatch):
    """A few pages in the handbook's HTML form (the facts task's corpus), made from stdlib docstrings."""
    paragraphs = [p for p in _common.natural_text(60_000).split("\n\n") if len(p) > 200][:40]
    for i in range(0, len(paragraphs), 10):
        body = "".join(f'<div class="para">{html.escape(p)}</div><pre class="screen">$ ls</pre>'
                       for p in paragraphs[i : i + 10])
        (tmp_path / f"page{i:02d}.html").write_text(f"<html><body>{body}</body></html>")
    monkeypatch.setenv("ENGRAMKV_FACTS_CORPUS", str(tmp_path))
    return [" ".join(p.split()) for p in paragraphs]  # as the task reads them: whitespace collapsed


def test_the_facts_task_plants_one_fact_in_the_corpus_and_asks_it_in_other_words(facts_corpus):
    sample = TASKS["facts"](CharTokenizer(), 6000, 5)
    text = sample.context[0]
    assert sample.meta["fact"] in text and sample.answers[0] in sample.meta["fact"]
    assert "$ ls" not in text  # code blocks are left out
    assert sum(p in text for p in facts_corpus) >= 2
    assert sample.question not in text and sample.prompt.endswith("\nAnswer:")
    questions = {TASKS["facts"](CharTokenizer(), 6000, seed).question.split()[0] for seed in range(20)}
    assert len(questions) >= 3  # several kinds of fact


def test_the_facts_task_says_where_its_corpus_is_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("ENGRAMKV_FACTS_CORPUS", str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="apt-get install debian-handbook"):
        TASKS["facts"](CharTokenizer(), 2000, 0)


@pytest.mark.slow
@pytest.mark.parametrize("length", [2048, 8192])
def test_every_task_makes_a_sample_of_about_its_length_with_its_answers_in_it(default_lm, length, facts_corpus):
    tokenizer = default_lm.tokenizer
    for name, make in TASKS.items():
        sample = make(tokenizer, length, 3)
        text = "".join(sample.context)
        n = len(tokenizer.encode(text + sample.prompt, add_special_tokens=False))
        assert sample.question in sample.prompt and text == text.rstrip(), name  # no lone trailing space token
        assert sample.chat_question.endswith("?"), name  # asked through chat as a user asks it
        assert 0.85 * length <= n <= 1.1 * length, (name, n)
        assert sample.answers and all(answer in text for answer in sample.answers), name
        assert sample.score(" and ".join(sample.answers)) == 1.0 and sample.score("no idea") == 0.0
        assert make(tokenizer, length, 3) == sample  # seeded
        other = make(tokenizer, length, 4)
        if name == "facts":  # few answers per kind of fact: two seeds may draw the same fact, ten hardly
            assert len({make(tokenizer, 512, seed).meta["fact"] for seed in range(10)}) >= 5
        else:
            assert other.answers != sample.answers, name


def _tiny_session(seed):
    """(a tiny-model session that has read 300 random tokens, those tokens, a Models stand-in)."""
    cfg = EngineConfig(window=WindowConfig(chunk_size=32, n_sink=8, n_local=64),
                       segmentation=SegmentationConfig(min_event=4, max_event=24))
    _, lm = tiny_pair("llama", cfg)
    session = lm.session()
    ids = torch.randint(0, VOCAB, (300,), generator=torch.Generator().manual_seed(seed)).tolist()
    session.ingest_ids(ids)
    return session, ids, type("Models", (), {"tokenizer": lm.tokenizer})


def test_what_an_answer_read_is_its_sinks_the_window_it_attended_and_the_memory_it_read():
    session, ids, models = _tiny_session(seed=0)
    before = _resident_text(models, session)
    stream = session.state.stream
    assert before[0].split() == list(map(str, ids[:8])) and before[2] == stream.local_start
    local = ids[stream.local_start :]
    event = len(session.memory) // 2
    whole = _read_texts(models, session, before, RecallPlan((event,), 64), [])
    assert whole[1].split() == list(map(str, local))
    assert whole[2].split() == list(map(str, session.memory.tokens(event)))
    start = stream.local_start
    piece = RecallPlan((), 64, window_from=start + 10, window_gap=(start + 20, start + 30))
    _, window, memory = _read_texts(models, session, before, piece, [event])
    assert window.split() == [str(t) for t in local[10:20] + local[30:]] and memory == ""
    parts = RecallPlan((event,), 64, event_tokens=((1, 3),))
    assert _read_texts(models, session, before, parts, [])[2].split() == list(
        map(str, session.memory.tokens(event)[1:3]))
    by_layers = _read_texts(models, session, before, RecallPlan(None, 64), [event])  # the layers' own recall
    assert by_layers[2] == whole[2]


def test_an_engramkv_run_records_its_theta_context_and_what_it_read_each_in_its_field():
    session, ids, models = _tiny_session(seed=1)
    sample = Sample("test", len(ids), 0, [], prompt="1 2 3", question="1 2 3", answers=[str(ids[-1])])
    with RssSampler() as rss:
        run = _engram_answer(models, sample, session, 0.0, rss, theta=Theta(1, 16, 1, 0, 64))
    assert run.theta == {"k": 1, "s": 16, "n": 1, "m": 0, "w": 64}
    assert isinstance(run.answer_context_tokens, int) and run.answer_context_tokens > 0
    assert run.answers_in_read == 1.0  # the last token read is in the whole window the theta attends to


def test_segmentation_fields_reach_every_engramkv_config_and_one_file_holds_one_setting():
    evaluate = passkey_preset.evaluate
    floor = {"min_surprise": 1.0, "predicted_event": 32}
    for system in ("engram", "engram-alloc-chat", "engram-surprise"):
        recorded = system_config(system, floor)
        engine = recorded if isinstance(recorded, EngineConfig) else EngineConfig.model_validate(recorded["engine"])
        assert (engine.segmentation.min_surprise, engine.segmentation.predicted_event) == (1.0, 32), system
        assert engine.segmentation.max_event == SegmentationConfig().max_event  # the rest as it was
    assert system_config("engram") == system_config("engram", {})
    evaluate.check_segmentation([{"seed": 0, "segmentation": floor}], dict(floor))
    evaluate.check_segmentation([{"seed": 0}], {})
    with pytest.raises(SystemExit, match="another --name"):
        evaluate.check_segmentation([{"seed": 0}], floor)
    argv = ["--segmentation", json.dumps(floor), "--tasks", "passkey", "--lengths", "4096"]
    recorded = evaluate._argv(evaluate.build_parser().parse_args(argv))
    assert json.loads(recorded[recorded.index("--segmentation") + 1]) == floor


@pytest.mark.slow
def test_quick_runs_every_system_and_writes_table_json_and_plot(tmp_path):
    subprocess.run([sys.executable, "evaluate.py", "--quick", "--out", str(tmp_path), "--name", "quick"],
                   cwd=BENCHMARKS, check=True, capture_output=True, text=True, timeout=1800)
    written = json.loads((tmp_path / "quick.json").read_text())
    runs = written["runs"]
    assert set(written["config"]) == set(SYSTEMS) and written["commit"] and "evaluate.py --quick" in written["command"]
    assert {(r["task"], r["system"]) for r in runs} == {
        (task, system) for task in ("passkey", "niah-multikey", "conversation") for system in SYSTEMS
    }
    for r in runs:
        assert 0 <= r["score"] <= 1 and r["first_token_s"] >= 0 and r["peak_rss_mb"] > 0, r
    for system in SYSTEMS:  # each system answered something
        assert any(r["reply"].strip() for r in runs if r["system"] == system), system
    passkey = {r["system"]: r["score"] for r in runs if r["task"] == "passkey"}
    assert passkey["engram"] == 1.0 and passkey["full"] == 1.0  # 2k tokens: both must find it
    read = {r["system"]: r["answers_in_read"] for r in runs if r["task"] == "passkey"}
    assert read["engram"] == 1.0 and read["full"] is None  # what engramkv's answer read held the key
    table = (tmp_path / "quick.md").read_text()
    assert all(f"| {system} |" in table for system in SYSTEMS)
    assert (tmp_path / "quick.png").stat().st_size > 10_000

    def resume(*flags: str) -> str:  # evaluate.py --quick --resume FLAGS on the same results; its stdout
        return subprocess.run([sys.executable, "evaluate.py", "--quick", "--resume", *flags, "--out", str(tmp_path),
                               "--name", "quick"], cwd=BENCHMARKS, check=True, capture_output=True, text=True,
                              timeout=600).stdout

    # --resume runs only what the results lack: drop one run, and only that one comes back
    path = tmp_path / "quick.json"
    payload = json.loads(path.read_text())
    dropped = next(r for r in payload["runs"] if r["task"] == "passkey" and r["system"] == "streaming")
    payload["runs"].remove(dropped)
    path.write_text(json.dumps(payload))
    out = resume()
    assert out.count("seed 0: score") == 1 and "passkey          streaming" in out
    resumed = json.loads(path.read_text())
    # the same command run again (quick mode records no --resume) is listed once in the header
    assert len(resumed["runs"]) == len(runs) and len(resumed["commands"]) == 1
    assert {(r["task"], r["system"]) for r in resumed["runs"]} == {(r["task"], r["system"]) for r in runs}

    # --merge folds in the runs of another process's results: split them, and merging runs nothing new
    moved = [r for r in resumed["runs"] if r["task"] == "conversation"]
    (tmp_path / "other.json").write_text(json.dumps({**resumed, "runs": moved, "commands": ["other command"]}))
    path.write_text(json.dumps({**resumed, "runs": [r for r in resumed["runs"] if r not in moved]}))
    out = resume("--merge", "other")
    merged = json.loads(path.read_text())
    assert "seed 0: score" not in out and len(merged["runs"]) == len(runs)
    assert "other command" in merged["commands"] and "`other command`" in (tmp_path / "quick.md").read_text()

    # --rerun measures again the runs of a system made at another commit, and keeps those of this one
    for r in merged["runs"]:
        if r["system"] == "rag" and r["task"] == "passkey":
            r["commit"] = "0" * 40
    path.write_text(json.dumps(merged))
    out = resume("--rerun", "rag")
    assert out.count("seed 0: score") == 1 and "passkey          rag" in out
    rerun = json.loads(path.read_text())
    assert len(rerun["runs"]) == len(runs) and all(r["commit"] != "0" * 40 for r in rerun["runs"])

    # --rerun-empty measures again the runs of a system whose reply was empty, and only those
    blanked = next(r for r in rerun["runs"] if r["system"] == "engram" and r["task"] == "passkey")
    blanked["reply"] = ""
    path.write_text(json.dumps(rerun))
    out = resume("--rerun-empty", "engram")
    assert out.count("seed 0: score") == 1 and "passkey          engram " in out
    again = json.loads(path.read_text())
    assert len(again["runs"]) == len(runs) and all(r["reply"].strip() for r in again["runs"] if r["system"] == "engram")


def test_accuracy_cells_carry_n_and_a_wilson_interval():
    import evaluate

    assert evaluate._cell([1.0] * 5) == "1.00 (5; 0.57-1.00)"
    lo, hi = evaluate.wilson(0.5, 20)
    assert (round(lo, 3), round(hi, 3)) == (0.299, 0.701)  # the textbook 10/20 interval
    assert evaluate.wilson(0.0, 1)[0] == 0.0 and evaluate.wilson(1.0, 1)[1] == 1.0


def test_the_report_names_the_segmentation_of_the_runs_that_set_it():
    evaluate = passkey_preset.evaluate
    floor = {"min_surprise": 1.0, "predicted_event": 32}
    assert evaluate.segmentation_lines([{"seed": 0}]) == []
    assert "Every engramkv system" in evaluate.segmentation_lines([{"seed": 0, "segmentation": floor}])[0]
    mixed = evaluate.segmentation_lines([{"seed": 0}, {"seed": 1, "segmentation": floor}] * 2)[0]
    assert mixed.startswith("The runs read their documents with the segmentation defaults of their commit, except "
                            '2 runs with {"min_surprise": 1.0, "predicted_event": 32}')
