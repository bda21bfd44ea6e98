"""The statistics the reports share: an interval for a mean score, and paired comparisons of two systems
answering the same samples."""

from __future__ import annotations

import math
import random


def wilson(p: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a proportion p observed over n samples."""
    centre, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    scale = 1 + z * z / n
    return max(0.0, (centre - half) / scale), min(1.0, (centre + half) / scale)


def paired_bootstrap(a: list[float], b: list[float], resamples: int = 10_000, seed: int = 0,
                     clusters: list[object] | None = None) -> tuple[float, float]:
    """95% interval of mean(a - b) over pairs, by resampling the pairs with replacement; with `clusters` (a
    label per pair), by resampling whole clusters, since pairs that share one (the same question asked at
    several lengths) are not independent."""
    diff = [x - y for x, y in zip(a, b, strict=True)]
    rng = random.Random(seed)
    if clusters is None:
        means = [sum(rng.choices(diff, k=len(diff))) / len(diff) for _ in range(resamples)]
    else:
        groups: dict[object, list[float]] = {}
        for label, d in zip(clusters, diff, strict=True):
            groups.setdefault(label, []).append(d)
        sums = [(sum(g), len(g)) for g in groups.values()]
        drawn = (rng.choices(sums, k=len(sums)) for _ in range(resamples))
        means = [sum(s for s, _ in draw) / sum(n for _, n in draw) for draw in drawn]
    means.sort()
    return means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]


def sign_test(better: int, worse: int) -> float:
    """Two-sided exact sign test of `better` against `worse` paired outcomes (ties left out)."""
    n = better + worse
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(better, worse) + 1)) / 2**n
    return min(1.0, 2 * tail)
