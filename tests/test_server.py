"""`engramkv serve` (issue 20): the HTTP API on a tiny model through FastAPI's test client, a property test of
every operation against the API's own OpenAPI schema, and a real server process with the embedded model."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
import httpx  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from engramkv import ConfigError, EngineConfig  # noqa: E402
from engramkv.config import RecallConfig, SegmentationConfig, StoreConfig, WindowConfig  # noqa: E402
from engramkv.server.app import create_app  # noqa: E402

from conftest import VOCAB, tiny_pair  # noqa: E402

CFG = EngineConfig(
    window=WindowConfig(chunk_size=32, n_sink=8, n_local=64),
    recall=RecallConfig(budget_tokens=64),
    segmentation=SegmentationConfig(min_event=4, max_event=24),
    store=StoreConfig(codec="int8", commit_tokens=100),
)
NS = "/v1/namespaces/alice/default/notes"


def _text(n: int, seed: int = 0) -> str:
    import random

    rng = random.Random(seed)
    return " ".join(str(rng.randrange(VOCAB)) for _ in range(n))


@pytest.fixture
def client(tmp_path):
    _, lm = tiny_pair("llama", CFG)
    with TestClient(create_app(lm, tmp_path / "store", files_root=tmp_path / "files")) as c:
        yield c


def test_ingest_chat_recall_stats_and_namespaces(client):
    assert client.get("/v1/health").json()["model"] == "tiny-llama"
    assert client.get("/v1/namespaces").json() == []
    report = client.post(f"{NS}/ingest", json={"text": _text(300)}).json()
    assert report["tokens"] == 300 and report["events_sealed"] > 0
    stats = client.get(f"{NS}/stats").json()
    assert stats["tokens"] >= 300 - CFG.window.chunk_size and stats["events"] == report["events_sealed"]
    answer = client.post(f"{NS}/chat", json={"message": "1 2 3", "max_new_tokens": 4}).json()
    assert isinstance(answer["reply"], str) and isinstance(answer["recalled"], list)
    streamed = client.post(f"{NS}/chat", json={"message": "4 5 6", "max_new_tokens": 4, "stream": True})
    assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/plain")
    hits = client.post(f"{NS}/recall", json={"query": "7 8 9", "k": 3}).json()
    assert 1 <= len(hits) <= 3 and {"event_id", "text", "score"} <= set(hits[0])
    [row] = client.get("/v1/namespaces").json()
    assert (row["user_id"], row["session_id"]) == ("alice", "notes") and row["events"] >= report["events_sealed"]
    assert client.delete("/v1/namespaces/alice/default/notes").status_code == 204
    assert client.get("/v1/namespaces").json() == []


def test_streamed_ingest_reports_progress_then_the_report(client, tmp_path):
    (tmp_path / "files").mkdir()
    path = tmp_path / "files" / "doc.txt"
    path.write_text(_text(400, seed=1))
    lines = [json.loads(line) for line in client.post(f"{NS}/ingest", json={"path": str(path), "stream": True})
             .iter_lines() if line]
    assert any("progress" in line for line in lines[:-1])
    assert lines[-1]["report"]["tokens"] == 400
    again = client.post(f"{NS}/ingest", json={"path": str(path)}).json()  # the same file: nothing to read
    assert again["already_ingested"] is True


def test_errors_map_onto_status_codes(client, tmp_path):
    empty = client.post(f"{NS}/chat", json={"message": "   "})
    assert empty.status_code == 400 and empty.json()["error"] == "EmptyInputError"
    assert client.post(f"{NS}/ingest", json={}).status_code == 400  # neither text nor path
    (tmp_path / "files").mkdir()
    binary = tmp_path / "files" / "blob.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    assert client.post(f"{NS}/ingest", json={"path": str(binary)}).json()["error"] == "InputError"
    # only files under the server's --files-root, whatever the path says
    for outside in ("/etc/hostname", str(tmp_path / "files" / ".." / "store" / "catalog.sqlite")):
        refused = client.post(f"{NS}/ingest", json={"path": outside})
        assert refused.status_code == 400 and "outside" in refused.json()["detail"], refused.text
    bad_name = client.get("/v1/namespaces/a%20b/default/x/stats")
    assert bad_name.status_code == 404 and bad_name.json()["error"] == "NamespaceError"
    assert client.delete("/v1/namespaces/nobody/default/x").status_code == 404
    assert client.post(f"{NS}/recall", json={"query": "1", "k": 0}).status_code == 422


def test_without_a_files_root_no_path_is_read_and_other_hosts_are_refused(tmp_path):
    _, lm = tiny_pair("llama", CFG)
    with TestClient(create_app(lm, tmp_path / "store", allowed_hosts=["testserver"])) as c:
        refused = c.post(f"{NS}/ingest", json={"path": str(tmp_path)})
        assert refused.status_code == 400 and "--files-root" in refused.json()["detail"]
        assert c.get("/v1/health", headers={"host": "attacker.example"}).status_code == 400  # DNS rebinding


def test_a_token_is_required_when_given(tmp_path):
    _, lm = tiny_pair("llama", CFG)
    with TestClient(create_app(lm, tmp_path / "store", token="s3cret")) as c:
        assert c.get("/v1/health").status_code == 401
        assert c.get("/v1/health", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.get("/v1/health", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert c.get("/openapi.json").status_code == 401 and c.get("/docs").status_code == 401


def test_serving_off_localhost_without_a_token_is_refused(tmp_path, capsys):
    from engramkv import cli

    assert cli.main(["serve", "--host", "0.0.0.0", "--store", str(tmp_path)]) != 0
    assert "token" in capsys.readouterr().err


# Any JSON an operation's body could hold, and names that may or may not be valid namespaces.
_json = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(max_size=20),
                     lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                     max_leaves=8)
_name = st.sampled_from(["default", "bob", "a b", "..", "x" * 200, "ok.1"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_no_operation_of_the_schema_answers_a_server_error(client, data):
    """Every operation the OpenAPI schema lists, called with bodies made of its own field names (and junk):
    4xx or 2xx, never 5xx; a 2xx JSON reply carries the fields its schema promises."""
    schema = client.get("/openapi.json").json()
    path, method = data.draw(st.sampled_from([(p, m) for p, ops in schema["paths"].items() for m in ops]))
    url = path
    for part in ("user", "agent", "session"):
        url = url.replace("{" + part + "}", data.draw(_name).replace(" ", "%20"))
    body = None
    operation = schema["paths"][path][method]
    if "requestBody" in operation:
        ref = operation["requestBody"]["content"]["application/json"]["schema"]["$ref"].split("/")[-1]
        fields = list(schema["components"]["schemas"][ref]["properties"])
        body = data.draw(st.dictionaries(st.sampled_from(fields), _json, max_size=len(fields)) | _json)
        if isinstance(body, dict) and body.get("stream") is True:
            body["stream"] = False  # a streamed reply is not JSON; the other tests cover it
        if isinstance(body, dict) and isinstance(body.get("max_new_tokens"), int):
            body["max_new_tokens"] = min(body["max_new_tokens"], 8)
    reply = client.request(method.upper(), url, json=body)
    assert reply.status_code < 500, (method, url, body, reply.text)
    ok = operation["responses"].get("200", {}).get("content", {}).get("application/json", {}).get("schema", {})
    if reply.status_code == 200 and "$ref" in ok:
        required = schema["components"]["schemas"][ok["$ref"].split("/")[-1]].get("required", [])
        assert set(required) <= set(reply.json()), (url, reply.json())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_a_real_server_answers_the_second_question_without_loading_the_model_again(tmp_path):
    port = _free_port()
    command = [sys.executable, "-c", "from engramkv.cli import main; raise SystemExit(main())", "serve",
               "--store", str(tmp_path / "store"), "--port", str(port)]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{base}/v1/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        else:
            pytest.fail("the server did not come up")
        filler = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. " * 90
        key = "71432"
        text = f"{filler}The pass key is {key}. Remember it. {key} is the pass key. {filler}"
        with httpx.Client(base_url=base, timeout=600) as http:
            assert http.post("/v1/namespaces/u/default/s/ingest", json={"text": text}).json()["tokens"] > 3500
            firsts = []
            for _ in range(2):
                started = time.monotonic()
                with http.stream("POST", "/v1/namespaces/u/default/s/chat",
                                 json={"message": "What is the pass key?", "stream": True, "max_new_tokens": 16}) as r:
                    pieces = r.iter_text()
                    first = next(pieces)
                    firsts.append(time.monotonic() - started)
                    reply = first + "".join(pieces)
            assert key in reply
            assert http.post("/v1/namespaces/u/default/s/recall", json={"query": "pass key", "k": 2}).status_code == 200
        print(f"time to first token: first question {firsts[0]:.2f} s, second {firsts[1]:.2f} s")
        assert firsts[1] < 10  # the model stays loaded: no 20-40 s load before the second answer
    finally:
        server.terminate()
        server.wait(timeout=60)


def test_at_most_max_open_sessions_stay_open_and_a_closed_one_reopens_where_it_stopped(tmp_path):
    _, lm = tiny_pair("llama", CFG)
    with TestClient(create_app(lm, tmp_path / "store", max_open=2)) as c:
        before = []
        for i in range(3):
            c.post(f"/v1/namespaces/u{i}/default/s/ingest", json={"text": _text(150, seed=i)})
            before.append(c.get(f"/v1/namespaces/u{i}/default/s/stats").json())
            assert c.get("/v1/health").json()["open_sessions"] == min(i + 1, 2)
        after = c.get("/v1/namespaces/u0/default/s/stats").json()  # u0 was closed for u2, and opens again
        assert (after["tokens"], after["events"]) == (before[0]["tokens"], before[0]["events"]) and after["events"]
        assert c.get("/v1/health").json()["open_sessions"] == 2


def test_a_session_in_use_is_not_closed_for_another(tmp_path):
    from engramkv.server.app import Sessions

    _, lm = tiny_pair("llama", CFG)
    sessions = Sessions(lm, tmp_path / "store", max_open=1)
    a, b, c = ("a", "default", "s"), ("b", "default", "s"), ("c", "default", "s")
    with sessions.lock(a):
        first = sessions.get(a)
        with sessions.lock(b):
            sessions.get(b)  # a is busy: both stay open
        assert sessions.count() == 2 and sessions.get(a) is first
    with sessions.lock(c):
        sessions.get(c)  # a and b are idle now: both close
    assert sessions.count() == 1
    sessions.close()
    with pytest.raises(ConfigError, match="at least 1"):
        Sessions(lm, tmp_path / "store", max_open=0)


def test_first_requests_to_many_namespaces_at_once_open_one_store(client):
    """Concurrent first requests each open a session; the store they share is opened once (no lock clash)."""
    from concurrent.futures import ThreadPoolExecutor

    def first_request(i: int) -> int:
        return client.post(f"/v1/namespaces/u{i}/default/s/ingest", json={"text": _text(40, seed=i)}).status_code

    with ThreadPoolExecutor(6) as pool:
        assert list(pool.map(first_request, range(6))) == [200] * 6
    assert len(client.get("/v1/namespaces").json()) == 6
