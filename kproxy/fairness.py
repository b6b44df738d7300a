"""How evenly one service's new connections spread over its endpoints: a chi-square goodness-of-fit test against
the even split, and the largest and smallest shares.

Pure and dependency-free (no scipy): the chi-square survival function is the regularized upper incomplete gamma
function Q(k/2, x/2), by its series below a + 1 and its continued fraction above (the classic Numerical Recipes
split, both converging fast there). ``kproxy top`` shows it per service from the counters (``kproxy.counters``), and
``kproxy compare`` per mode. A p-value near 0 says the split is not even; with few connections the test says little,
so ``Fairness`` carries the count it rests on.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

_EPS = 1e-15
_MAX_ITER = 1000


def _lower_series(a: float, x: float) -> float:
    """P(a, x) by its power series (x < a + 1)."""
    term = total = 1.0 / a
    ap = a
    for _ in range(_MAX_ITER):
        ap += 1.0
        term *= x / ap
        total += term
        if abs(term) < abs(total) * _EPS:
            break
    return total * math.exp(-x + a * math.log(x) - math.lgamma(a))


def _upper_fraction(a: float, x: float) -> float:
    """Q(a, x) by its continued fraction, modified Lentz (x >= a + 1)."""
    tiny = 1e-300
    b = x + 1.0 - a
    c = 1.0 / tiny
    d = 1.0 / b
    h = d
    for i in range(1, _MAX_ITER):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < _EPS:
            break
    return math.exp(-x + a * math.log(x) - math.lgamma(a)) * h


def gamma_q(a: float, x: float) -> float:
    """The regularized upper incomplete gamma function Q(a, x) = Γ(a, x) / Γ(a), for a > 0 and x >= 0."""
    if a <= 0 or x < 0 or math.isnan(a) or math.isnan(x):
        raise ValueError(f"gamma_q: need a > 0 and x >= 0, got a={a!r}, x={x!r}")
    if x == 0:
        return 1.0
    if math.isinf(x):
        return 0.0
    if x < a + 1.0:
        return max(0.0, 1.0 - _lower_series(a, x))
    return min(1.0, _upper_fraction(a, x))


def chi2_sf(x: float, dof: int) -> float:
    """P(X >= x) for X chi-square distributed with ``dof`` degrees of freedom (the test's p-value)."""
    if dof < 1:
        raise ValueError(f"chi2_sf: degrees of freedom must be at least 1, got {dof}")
    return gamma_q(dof / 2.0, max(0.0, x) / 2.0)


@dataclass(frozen=True, slots=True)
class Fairness:
    """``chi2`` with ``dof`` degrees of freedom and its ``p_value`` against the even split of ``total`` over
    ``endpoints``; ``max_share`` / ``min_share``: the busiest and idlest endpoint's part of the total (the even
    split is ``1 / endpoints``); ``ratio``: max over min share (inf when an endpoint got nothing)."""

    endpoints: int
    total: int
    chi2: float
    dof: int
    p_value: float
    max_share: float
    min_share: float

    @property
    def even_share(self) -> float:
        return 1.0 / self.endpoints

    @property
    def ratio(self) -> float:
        return self.max_share / self.min_share if self.min_share else math.inf

    def as_dict(self) -> dict[str, float | int | None]:
        ratio = self.ratio
        return {
            "endpoints": self.endpoints,
            "total": self.total,
            "chi2": self.chi2,
            "dof": self.dof,
            "pValue": self.p_value,
            "maxShare": self.max_share,
            "minShare": self.min_share,
            "evenShare": self.even_share,
            "maxMinRatio": None if math.isinf(ratio) else ratio,
        }


def fairness(counts: Sequence[float] | Mapping[str, float]) -> Fairness | None:
    """The spread of one service's counts (new connections per endpoint) against the even split; None with fewer
    than two endpoints or nothing counted. Negative counts are a ValueError."""
    values = [float(v) for v in (counts.values() if isinstance(counts, Mapping) else counts)]
    if any(v < 0 or math.isnan(v) for v in values):
        raise ValueError("fairness: counts must be non-negative numbers")
    total = sum(values)
    n = len(values)
    if n < 2 or total <= 0:
        return None
    expected = total / n
    chi2 = sum((v - expected) ** 2 for v in values) / expected
    return Fairness(
        endpoints=n,
        total=round(total),
        chi2=chi2,
        dof=n - 1,
        p_value=chi2_sf(chi2, n - 1),
        max_share=max(values) / total,
        min_share=min(values) / total,
    )
