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


def sampled_marginals_pvalues(
    target, decoder_factory, loop: str = "hf-spec", n: int = 1000, seed: int = 2024, sampling=None
):
    """Sample `n` continuations of a fixed prompt through `decoder_factory()` in hf-spec's loop, in batches of 50
    copies verified together (`loop="batched"`; `"batched-auto"`: with `batches="auto"`, whose `DraftSwitch` may
    take plain steps) or in transformers' assisted loop; return (per-position chi-square p-values against the exact marginals, accepted draft tokens).
    `sampling`: (generate's sampling options, the warpers plain sampling applies for them); default temperature
    `TEMP` + top-p `TOP_P`."""
    from tests.test_sampling import NEW, TEMP, TOP_P, exact_marginals

    options, procs = sampling or ({"temperature": TEMP, "top_p": TOP_P}, None)
    prompt = torch.tensor([[1, 5, 7, 3, 9]], device=target.device)
    expected = exact_marginals(target, prompt, procs)
    decoder = decoder_factory()
    kw = dict(max_new_tokens=NEW, do_sample=True, top_k=0, pad_token_id=0) | options
    counts = [Counter() for _ in range(NEW)]
    accepted = 0
    torch.manual_seed(seed)
    handle = None
    if loop == "transformers":
        from hf_spec.integrations import enable_assistant

        handle = enable_assistant(target, loop="transformers")
    copies = 50 if loop.startswith("batched") else 1
    if loop.startswith("batched"):
        decoder.batches = "auto" if loop == "batched-auto" else "batched"
    try:
        for _ in range(n // copies):
            if loop == "transformers":
                out = target.generate(prompt, assistant_model=decoder, eos_token_id=None, **kw)
            else:
                out = target.generate(
                    prompt, custom_generate=decoder, eos_token_id=None, num_return_sequences=copies, **kw
                )
                accepted += decoder.last_stats.accepted_tokens
            for row in out[:, prompt.shape[1] :].tolist():
                for pos, tok in enumerate(row):
                    counts[pos][tok] += 1
    finally:
        if handle is not None:
            handle.disable()
    return [chi2_pvalue(counts[pos], expected[pos], n) for pos in range(NEW)], accepted
