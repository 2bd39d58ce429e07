"""Statistics of evaluations (the leaderboard's and held-out evaluation during training), as
small pure functions: pass@k, Wilson intervals for rates and percentile-bootstrap intervals
for means.

Wilson rather than the normal ("Wald") interval because suites are small and rates are
often 0 or 1, where Wald collapses to a zero-width interval; the bootstrap for means
because rewards are bounded and skewed (mostly 0 and 1), so a t interval would be wrong
in shape. Both are what the evaluation literature reports (e.g. HELM, SWE-bench papers).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

Z95 = 1.959963984540054
"""The standard normal quantile of a two-sided 95% interval."""


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a success rate; (0, 1) when there are no trials."""
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be in [0, n], got {successes} of {n}")
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denominator = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    # Rounding can push a bound a hair past [0, 1] at p = 0 or 1.
    return max(0.0, center - half), min(1.0, center + half)


def bootstrap_interval(
    values: Sequence[float], resamples: int = 2000, level: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """Percentile-bootstrap interval of the mean, reproducible for a given seed."""
    if not values:
        return math.nan, math.nan
    if resamples < 1 or not 0 < level < 1:
        raise ValueError("resamples must be >= 1 and level in (0, 1)")
    rng = random.Random(seed)
    n = len(values)
    means = sorted(sum(rng.choices(values, k=n)) / n for _ in range(resamples))
    tail = (1 - level) / 2
    return _quantile(means, tail), _quantile(means, 1 - tail)


def _quantile(ordered: Sequence[float], q: float) -> float:
    """The q-quantile of sorted values, by linear interpolation between order statistics."""
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one task from n samples of which c passed (Chen et al., 2021):
    the chance that k samples drawn without replacement include a pass."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def mean(values: Sequence[float]) -> float:
    """The mean, NaN for no values (shown as a dash, never as a misleading 0)."""
    return sum(values) / len(values) if values else math.nan
