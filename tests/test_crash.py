"""Crash safety: SIGKILL an ingesting process at random points, check the store, resume, compare.

A few kill points here (each costs a process start); `python tests/crash_harness.py --kills 100`
is the full run whose figures are in benchmarks/results/crash/crash.md.
"""

import os

import pytest

from crash_harness import harness


@pytest.mark.slow
def test_sigkill_at_random_points_loses_nothing_committed_and_resumes_exactly(tmp_path):
    kills = int(os.environ.get("ENGRAMKV_CRASH_KILLS", "4"))
    lines: list[str] = []
    result = harness(tmp_path, kills=kills, n_tokens=2500, seed=1, log=lines.append)
    assert result["kills"] == kills
    assert result["runs_completed_and_compared"] >= 1, lines
