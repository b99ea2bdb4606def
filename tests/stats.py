"""Chi-square goodness of fit without scipy."""

from __future__ import annotations

from collections import Counter

import torch


def chi2_pvalue(observed: Counter, expected: dict, n: int, min_expected: float = 5.0) -> float:
    """p-value that `observed` counts (n draws) come from the probabilities `expected`. Cells with few expected
    draws are pooled; an observation outside the support gives p = 0."""
    if any(k not in expected or expected[k] <= 0 for k in observed):
        return 0.0
    stat, df, pool_o, pool_e = 0.0, -1, 0.0, 0.0
    for key, prob in expected.items():
        e, o = prob * n, observed.get(key, 0)
        if e < min_expected:
            pool_o, pool_e = pool_o + o, pool_e + e
            continue
        stat += (o - e) ** 2 / e
        df += 1
    if pool_e > 0:
        stat += (pool_o - pool_e) ** 2 / pool_e
        df += 1
    if df <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))
