"""do_sample=True through the whole loop: per-position token distributions equal the target's (chi-square),
for chains and trees, with temperature and top-p applied as plain sampling applies them."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    EpsilonLogitsWarper,
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from hf_spec import SpeculativeDecoder
from hf_spec.core.config import MethodConfig
from hf_spec.core.drafter import Drafter, SpecState
from hf_spec.tree.draft_tree import DraftTree
from tests.conftest import make_tiny_model
from tests.stats import sampled_marginals_pvalues

V, NEW, TEMP, TOP_P = 12, 3, 0.8, 0.9


class SampledTreeDrafter(Drafter):
    """Test drafter with exact q: a different tiny model's distribution; `width` root children drawn
    without replacement (each reporting its conditional q), each continued by one child drawn from q,
    plus one deterministic leaf (the draft argmax) -- a mix of every proposal kind."""

    batchable = True  # stateless: rows of a batch can share it

    def __init__(self, target, draft, width: int) -> None:
        super().__init__(MethodConfig(), target)
        self.draft, self.width = draft, width

    def for_another_row(self) -> SampledTreeDrafter:
        return self

    def _q(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return torch.softmax(self.draft(input_ids=ids).logits[0, -1].float() / 1.3, -1)

    def propose(self, state: SpecState, max_depth: int) -> DraftTree:
        if max_depth <= 0:
            return DraftTree.empty()
        q = self._q(state.input_ids)
        tokens, parents, rows = [], [], []
        rest = q.clone()
        for _ in range(self.width):
            cond = rest / rest.sum()
            tok = int(torch.multinomial(cond, 1))
            tokens.append(tok), parents.append(-1), rows.append(cond)
            rest[tok] = 0
        if rest.sum() > 0:  # deterministic leaf: argmax of what is left
            tok = int(rest.argmax())
            tokens.append(tok), parents.append(-1), rows.append(q.new_zeros(V))
        if max_depth >= 2:
            for parent in range(self.width):
                qc = self._q(
                    torch.cat([state.input_ids, state.input_ids.new_tensor([[tokens[parent]]])], dim=1)
                )
                tokens.append(int(torch.multinomial(qc, 1))), parents.append(parent), rows.append(qc)
        return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.stack(rows))


def exact_marginals(
    model, prompt: torch.Tensor, procs: LogitsProcessorList | None = None
) -> list[dict[int, float]]:
    """Per-position marginals of plain sampling (temperature + top-p unless `procs` says otherwise), by
    enumeration."""
    procs = procs or LogitsProcessorList([TemperatureLogitsWarper(TEMP), TopPLogitsWarper(TOP_P)])
    probs_of: dict[tuple, torch.Tensor] = {}

    def dist(prefix: tuple) -> torch.Tensor:
        if prefix not in probs_of:
            ids = torch.cat([prompt[0], prompt.new_tensor(prefix, dtype=torch.long)])[None]
            with torch.no_grad():
                logits = model(input_ids=ids).logits[:, -1].float()
            probs_of[prefix] = torch.softmax(procs(ids, logits), -1)[0]
        return probs_of[prefix]

    marginals = []
    paths = {(): 1.0}
    for _ in range(NEW):
        nxt: dict[tuple, float] = {}
        for prefix, w in paths.items():
            p = dist(prefix)
            for t in torch.nonzero(p > 0).flatten().tolist():
                nxt[prefix + (t,)] = nxt.get(prefix + (t,), 0.0) + w * float(p[t])
        marginals.append({t: sum(w for k, w in nxt.items() if k[-1] == t) for t in range(V)})
        paths = {k: w for k, w in nxt.items() if w > 1e-4}  # drop negligible paths: bounds the enumeration
    return marginals


@pytest.mark.parametrize("loop", ["hf-spec", "batched"])  # batched: 50 copies verified in one forward a round
@pytest.mark.parametrize("width", [1, 2])  # 1: a chain (+ a deterministic sibling), 2: a wider tree
def test_loop_sampling_matches_plain_sampling(width, loop):
    target = make_tiny_model("llama", seed=11, vocab_size=V, layers=2, temperature=2.0)
    draft = make_tiny_model("llama", seed=12, vocab_size=V, layers=1, temperature=2.0)
    decoder = SpeculativeDecoder(SampledTreeDrafter(target, draft, width))
    pvalues, accepted = sampled_marginals_pvalues(target, lambda: decoder, loop, n=1500, seed=2024)
    assert accepted > 1500 * 0.3  # the drafts are really being accepted, not just bonus tokens
    assert min(pvalues) > 1e-3, pvalues


@pytest.mark.parametrize("loop", ["hf-spec", "batched"])
def test_bfloat16_sampling_matches_plain_sampling(loop):
    """A bfloat16 target and drafter (hf-spec's bf16 kernels and attention where they apply): the per-position
    marginals are the bf16 target's plain-sampling ones (rounding between forward shapes is far below what 1,500
    draws can see; a wrong dtype or probability in acceptance is not)."""
    target = make_tiny_model("llama", seed=11, vocab_size=V, layers=2, temperature=2.0).to(torch.bfloat16)
    draft = make_tiny_model("llama", seed=12, vocab_size=V, layers=1, temperature=2.0).to(torch.bfloat16)
    decoder = SpeculativeDecoder(SampledTreeDrafter(target, draft, 2))
    pvalues, accepted = sampled_marginals_pvalues(target, lambda: decoder, loop, n=1500, seed=99)
    assert accepted > 1500 * 0.3
    assert min(pvalues) > 1e-3, pvalues


def test_batch_sampling_with_plain_steps_between_drafted_rounds(monkeypatch):
    """`batches="auto"` may take a plain step in any round (`DraftSwitch`): alternating drafted rounds and plain
    steps, 50 copies a call, the per-position marginals stay those of plain sampling."""
    import hf_spec.decoder
    from tests.test_draft_switch import Alternating

    monkeypatch.setattr(hf_spec.decoder, "DraftSwitch", Alternating)
    target = make_tiny_model("llama", seed=11, vocab_size=V, layers=2, temperature=2.0)
    draft = make_tiny_model("llama", seed=12, vocab_size=V, layers=1, temperature=2.0)
    decoder = SpeculativeDecoder(SampledTreeDrafter(target, draft, 2))
    pvalues, accepted = sampled_marginals_pvalues(target, lambda: decoder, "batched-auto", n=1500, seed=7)
    assert accepted > 1500 * 0.15  # drafted rounds happen (and get accepted) between the plain steps
    assert decoder.last_stats.plain_rounds > 0
    assert min(pvalues) > 1e-3, pvalues


# generate's options -> the warpers plain sampling applies for them (transformers' order). The thresholds keep clear
# of near-ties in this tiny target (with top_k 5 its 5th and 6th logits tie after one prefix, and a full forward
# and a cached one keep different tokens: plain `generate` fails the same check there).
WARPERS = {
    "min_p": ({"temperature": TEMP, "min_p": 0.2}, [TemperatureLogitsWarper(TEMP), MinPLogitsWarper(0.2)]),
    "typical_p": (
        {"temperature": TEMP, "typical_p": 0.8},
        [TemperatureLogitsWarper(TEMP), TypicalLogitsWarper(0.8)],
    ),
    "top_k + epsilon": (
        {"temperature": TEMP, "top_k": 6, "epsilon_cutoff": 0.05},
        [TemperatureLogitsWarper(TEMP), TopKLogitsWarper(6), EpsilonLogitsWarper(0.05)],
    ),
}


@pytest.mark.parametrize("warpers", list(WARPERS))
def test_sampling_with_other_warpers_matches_plain_sampling(warpers):
    """min-p, typical-p, top-k and epsilon truncation reach the loop through `generate`'s own processor list:
    the per-position marginals are plain sampling's with the same warpers (50 copies a call, batched)."""
    options, procs = WARPERS[warpers]
    target = make_tiny_model("llama", seed=11, vocab_size=V, layers=2, temperature=2.0)
    draft = make_tiny_model("llama", seed=12, vocab_size=V, layers=1, temperature=2.0)
    decoder = SpeculativeDecoder(SampledTreeDrafter(target, draft, 2))
    pvalues, accepted = sampled_marginals_pvalues(
        target, lambda: decoder, "batched", n=1500, seed=31, sampling=(options, LogitsProcessorList(procs))
    )
    assert accepted > 1500 * 0.3
    assert min(pvalues) > 1e-3, pvalues


def test_enumeration_helper_sums_to_one():
    target = make_tiny_model("llama", seed=11, vocab_size=V, layers=2, temperature=2.0)
    for marg in exact_marginals(target, torch.tensor([[1, 5, 7]])):
        assert sum(marg.values()) == pytest.approx(1.0, abs=2e-3)
