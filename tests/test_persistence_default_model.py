"""Persistence on the embedded model: ingest into a store, end the process, reopen in a new one, ask.

The answer after the restart must equal the one the writing process gave before it ended (and, with
the lossless fp16 codec, the one a store-less session gives). The lowrank store takes the bases shipped in
the package for the embedded model; its answer must survive the restart and hold the key.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from test_default_model import SMALL  # also puts benchmarks/ on sys.path

from _common import passkey_sample  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[1]

# argv: mode ("write" or "read"), store directory, codec. Prints {"answer": ..., "key": ...} as JSON.
SCRIPT = """
import json, sys
sys.path.insert(0, {benchmarks!r})
sys.path.insert(0, {tests!r})
from _common import passkey_sample
from engramkv import EpisodicLM
from engramkv.config import StoreConfig
from test_default_model import SMALL
mode, store, codec = sys.argv[1:4]
config = SMALL.model_copy(update={{"store": StoreConfig(codec=codec)}})
lm = EpisodicLM.from_pretrained(config=config)
context, question, key = passkey_sample(lm.tokenizer, 2500, depth=0.4, seed=11)
if mode == "write":
    with lm.session(store=store) as session:
        session.ingest(context)
with lm.session(store=store, read_only=True) as session:  # asking must not change the store
    answer = session.generate(question, max_new_tokens=8)
print(json.dumps({{"answer": answer, "key": key, "events": session.events}}))
"""


def _run(mode: str, store: Path, codec: str) -> dict:
    script = SCRIPT.format(benchmarks=str(ROOT / "benchmarks"), tests=str(ROOT / "tests"))
    done = subprocess.run([sys.executable, "-c", script, mode, str(store), codec], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("codec", ["fp16", "int8", "lowrank"])  # lowrank: with the bases shipped for the model
def test_an_answer_survives_the_end_of_the_process(tmp_path, codec, default_lm):
    before = _run("write", tmp_path / "store", codec)
    after = _run("read", tmp_path / "store", codec)
    assert after == before and before["events"] > 0
    assert before["key"] in before["answer"]  # lowrank too: benchmarks/lowrank_probe.py measures it on more keys
    if codec == "fp16":  # lossless: the same as never storing at all
        context, question, _ = passkey_sample(default_lm.tokenizer, 2500, depth=0.4, seed=11)
        session = default_lm.session(SMALL)
        session.ingest(context)
        assert session.generate(question, max_new_tokens=8) == before["answer"]
