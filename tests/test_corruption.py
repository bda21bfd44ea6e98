"""Damaged store files (issue 20): 200 seeded damages across every file kind of a store; each one refused with a
StoreError or read exactly as the pristine store reads (`tests/corruption_fuzz.py` runs them)."""

from collections import Counter

from corruption_fuzz import KINDS, run


def test_every_damaged_store_is_refused_or_read_exactly(tmp_path):
    results = run(200, tmp_path, seed=0)
    assert len(results) == 200
    failures = [r for r in results if r["outcome"] in ("crash", "damaged answer")]
    assert not failures, failures[:5]
    outcomes = {kind: Counter(r["outcome"] for r in results if r["kind"] == kind) for kind in KINDS}
    assert all(sum(counts.values()) >= 30 for counts in outcomes.values()), outcomes
    # KV, checkpoint and catalog damage is refused and says which file; derived files are rebuilt
    for kind, names in (("segment", ("event", "segment")), ("checkpoint", ("checkpoint",)), ("catalog", ("catalog",)),
                        ("store_id", ("STORE_ID",))):
        refused = [r for r in results if r["kind"] == kind and r["outcome"] == "refused"]
        assert refused and all(any(n in r["detail"] for n in names) for r in refused), (kind, refused[:3])
    assert outcomes["index"]["intact"] == sum(outcomes["index"].values())
    assert outcomes["manifest"]["intact"] == sum(outcomes["manifest"].values())
