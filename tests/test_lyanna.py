"""Lyanna on tiny random targets: each part against a plain reference, save/load, errors, lossless decoding."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache

from hf_spec import SpeculativeDecoder
from hf_spec.core.specs import HEAD_IN_THIS_FOLDER
from hf_spec.heads.hub import save_head_folder
from hf_spec.methods.lyanna import LyannaConfig, LyannaDrafter
from hf_spec.methods.lyanna.drafter import load_lyanna_head
from hf_spec.methods.lyanna.modeling import LyannaHeadConfig, LyannaHeadModel
from hf_spec.methods.lyanna.token_tree import token_info_tree
from hf_spec.training.features import capture_features
from hf_spec.training.losses import alignment_mask
from hf_spec.training.lyanna import LyannaTrainConfig, train_lyanna
from hf_spec.tree.scored import ScoredTree, fuse_scored, prune_scored
from tests.conftest import make_tiny_model, prompt_ids, run_in_bfloat16
from tests.test_eagle import tiny_conversations


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def trained(request, tmp_path_factory):
    model = make_tiny_model(request.param, temperature=16.0)
    folder = tmp_path_factory.mktemp(f"lyanna-{request.param}")
    store = capture_features(model, tiny_conversations(model), folder / "data", topk=8, progress=False)
    cfg = LyannaTrainConfig(
        align_steps=3, draft_vocab=80, epochs=12, lr=2e-3, batch_tokens=512, heldout=2, token_info_rank=8
    )
    head, report = train_lyanna(model, store.load_sequences(), folder / "run", cfg, progress=False)
    save_head_folder(head, folder / "head", LyannaConfig(head=HEAD_IN_THIS_FOLDER, depth=5, topk=3), "card")
    return model, head, report, folder


def reference_algorithm1(level_logits, token_info, d2t, topk, root_token=None):
    """Algorithm 1 written plainly: per level, per kept node, per child."""
    nodes = []  # (token, parent, joint, depth)
    frontier = [(-1, root_token, 0.0)]
    for level, raw in enumerate(level_logits):
        candidates = []
        for node, token, joint in frontier:
            logits = raw.clone().float()
            if token is not None and token_info is not None:
                logits += token_info(torch.tensor([token]))[0].float()
            logp = torch.log_softmax(logits, -1)
            for idx in torch.argsort(logp, descending=True)[:topk].tolist():
                candidates.append((joint + float(logp[idx]), node, int(d2t[idx])))
        candidates.sort(key=lambda c: -c[0])
        frontier = []
        for joint, parent, token in candidates[:topk]:
            nodes.append((token, parent, joint, level + 1))
            frontier.append((len(nodes) - 1, token, joint))
    return nodes


@pytest.mark.parametrize("root_token", [None, 7])
def test_algorithm1_and_2_match_plain_reference(root_token):
    torch.manual_seed(0)
    V, L = 20, 4
    logits = torch.randn(L, V) * 2
    table = torch.randn(V + 10, V)
    d2t = torch.arange(V) + 10

    def info(ids):
        return table[ids]

    tree = token_info_tree(logits, info, d2t, topk=3, root_token=root_token)
    ref = reference_algorithm1(logits, info, d2t, 3, root_token)
    assert tree.tokens == [n[0] for n in ref]
    assert tree.parents == [n[1] for n in ref]
    assert tree.joint == pytest.approx([n[2] for n in ref], abs=1e-5)


def test_prune_keeps_best_joint_with_ancestors():
    tree = ScoredTree([1, 2, 3, 4], [-1, -1, 0, 2], [-0.1, -0.5, -0.2, -0.3], [1, 1, 2, 3])
    pruned = prune_scored(tree, 3)
    assert pruned.tokens == [1, 3, 4] and pruned.parents == [-1, 0, 1]


def test_fuse_matches_reference_merge():
    a = ScoredTree([1, 2, 3], [-1, 0, -1], [-0.1, -0.3, -1.0], [1, 2, 1])
    b = ScoredTree([1, 5, 2], [-1, 0, 0], [-0.2, -0.4, -0.25], [1, 2, 2])
    fused = fuse_scored(a, b)
    paths = dict(zip(fused.paths(), fused.joint, strict=True))
    assert paths == {(1,): -0.1, (3,): -1.0, (1, 2): -0.25, (1, 5): -0.4}
    assert all(p < i for i, p in enumerate(fused.parents))


def test_token_info_table_equals_low_rank():
    model = make_tiny_model("llama")
    head = LyannaHeadModel(LyannaHeadConfig.for_target(model, 64, token_info_rank=8)).attach_target(model)
    with torch.no_grad():
        head.token_info_scale.uniform_(0.5, 1.5)
        ids = torch.tensor([3, 17, 95])
        table = head.token_info_table(ids)
        low = head.token_info(ids)
    assert table.shape == (3, 64)
    assert torch.allclose(table, low, atol=1e-6)
    unit = low / head.token_info_scale.detach()  # RMSNorm: unit RMS before its weight (up to eps = 1e-12)
    with torch.no_grad():
        ms = head.token_info_up(head.token_info_down(head.parts.embed_tokens(ids))).pow(2).mean(-1)
    assert torch.allclose(unit.pow(2).mean(-1), ms / (ms + 1e-12), rtol=1e-5)


def test_chain_and_one_pass_logits_match_training_unroll(trained):
    """Depth j of the parallel training unroll equals the drafter's sequential chain; the one batched LM-head call
    equals k separate calls."""
    model, head, _, _ = trained
    n, steps = 8, 3
    torch.manual_seed(1)
    f_in = torch.randn(1, n, model.config.hidden_size)
    ids = torch.randint(3, 96, (1, n))
    pos = torch.arange(1, n + 1)[None]
    with torch.no_grad():
        cache, outs, h = DynamicCache(), [], None
        for j in range(1, steps + 1):
            mask = alignment_mask(n, j)[None, None]
            h = (
                head.first_step(f_in, ids, pos, mask, cache)
                if j == 1
                else head.next_step(torch.cat([h[:, :1], h[:, :-1]], 1), pos, mask, cache)
            )
            outs.append(h)
        i = n - 1
        last = i - steps + 1  # the root index of a chain reaching depth `steps` at index i
        sim = DynamicCache()
        causal = torch.zeros(last, last).masked_fill(~torch.ones(last, last, dtype=torch.bool).tril(), -1e30)
        head.first_step(f_in[:, :last], ids[:, :last], pos[:, :last], causal[None, None], sim)
        chain = [
            head.first_step(
                f_in[:, last : last + 1], ids[:, last : last + 1], pos[:, last : last + 1], None, sim
            )
        ]
        for k in range(last + 1, i + 1):
            chain.append(head.next_step(chain[-1], pos[:, k : k + 1], None, sim))
        for depth, state in enumerate(chain, start=1):
            assert torch.allclose(state[0, 0], outs[depth - 1][0, last + depth - 1], atol=1e-4)
        stacked = torch.cat(chain, dim=1)[0]
        one_pass = head.draft_logits(stacked)
        separate = torch.stack([head.draft_logits(s[0, 0]) for s in chain])
        assert torch.allclose(one_pass, separate, atol=1e-5)


def test_training_lowers_loss(trained):
    _, _, report, _ = trained
    assert report["final_loss"] < 0.8 * report["first_loss"]
    assert report["heldout"]["accuracy_by_depth"][0] > 0.1


@pytest.mark.parametrize("resample", ["off", "separate", "fused"])
@pytest.mark.parametrize("token_info", ["lowrank", "table", "off"])
def test_greedy_equals_generate(trained, resample, token_info):
    model, head, _, _ = trained
    cfg = LyannaConfig(depth=5, topk=3, budget=10, resample=resample, token_info=token_info, hot_tokens=40)
    dec = SpeculativeDecoder(LyannaDrafter(cfg, model, head=head))
    for seed in (1, 2):
        ids = prompt_ids(12, seed=seed)
        ref = model.generate(ids, max_new_tokens=40, do_sample=False)
        assert torch.equal(model.generate(ids, max_new_tokens=40, do_sample=False, custom_generate=dec), ref)
    assert dec.last_stats.accepted_tokens > 0
    if resample != "off":
        assert dec.drafter_for(model).resample_count > 0


def test_one_token_prompt(trained):
    model, head, _, _ = trained
    ids = prompt_ids(1, seed=3)
    dec = SpeculativeDecoder(LyannaDrafter(LyannaConfig(depth=4, topk=2, budget=6), model, head=head))
    ref = model.generate(ids, max_new_tokens=20, do_sample=False)
    assert torch.equal(model.generate(ids, max_new_tokens=20, do_sample=False, custom_generate=dec), ref)
    assert dec.last_stats.draft_tokens > 0


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_quantized_draft_weights_keep_greedy_exact(trained, quantize):
    model, head, _, _ = trained
    drafter = LyannaDrafter(LyannaConfig(depth=4, topk=3, budget=8, quantize=quantize), model, head=head)
    dec = SpeculativeDecoder(drafter)
    ids = prompt_ids(12, seed=4)
    ref = model.generate(ids, max_new_tokens=40, do_sample=False)
    assert torch.equal(model.generate(ids, max_new_tokens=40, do_sample=False, custom_generate=dec), ref)
    assert dec.last_stats.accepted_tokens > 0 and drafter.quantized and drafter.lm_quantized is not None
    with pytest.raises(ValueError, match="quantize must be"):
        LyannaConfig(quantize="fp8")


@pytest.mark.parametrize("token_info", ["lowrank", "table"])
def test_vocab_limit_keeps_greedy_exact(trained, token_info):
    model, head, _, _ = trained
    cfg = LyannaConfig(depth=4, topk=2, budget=8, token_info=token_info, vocab_limit=30)
    drafter = LyannaDrafter(cfg, model, head=head)
    ids = prompt_ids(12, seed=5)
    ref = model.generate(ids, max_new_tokens=32, do_sample=False)
    out = model.generate(ids, max_new_tokens=32, do_sample=False, custom_generate=SpeculativeDecoder(drafter))
    assert torch.equal(out, ref)
    assert drafter.chain_logits is None or drafter.chain_logits.shape[-1] == 30
    assert drafter.token_info(torch.tensor([int(head.d2t[0])])).shape[-1] == 30


@pytest.mark.parametrize("loop", ["hf-spec", "batched", "transformers"])
def test_sampling_keeps_target_distribution(loop):
    """Chi-square of per-position token counts vs the target's exact marginals (tiny vocabulary), both loops."""
    from tests.stats import sampled_marginals_pvalues
    from tests.test_sampling import V

    target = make_tiny_model("llama", seed=11, vocab_size=V, layers=2, temperature=2.0)
    torch.manual_seed(0)
    head = (
        LyannaHeadModel(LyannaHeadConfig.for_target(target, V, token_info_rank=4))
        .attach_target(target)
        .eval()
    )
    head.init_layer_from(target)
    cfg = LyannaConfig(depth=3, topk=2, budget=5, resample="fused")
    pvalues, accepted = sampled_marginals_pvalues(
        target, lambda: SpeculativeDecoder(LyannaDrafter(cfg, target, head=head)), loop
    )
    assert loop == "transformers" or accepted > 200
    assert min(pvalues) > 1e-3, pvalues


def test_save_load_and_errors(trained, tmp_path):
    model, head, _, folder = trained
    loaded = load_lyanna_head(str(folder / "head"), model)
    assert torch.equal(loaded.d2t, head.d2t)
    assert loaded.config.token_info_rank == head.config.token_info_rank
    assert torch.equal(loaded.rotary_emb.inv_freq, head.rotary_emb.inv_freq)  # not raw memory after loading
    ids = torch.tensor([3, 4])
    with torch.no_grad():
        assert torch.allclose(loaded.token_info(ids), head.token_info(ids), atol=0.05 * math.sqrt(80))
    with pytest.raises(ValueError, match="trained for"):
        load_lyanna_head(str(folder / "head"), make_tiny_model(model.config.model_type, seed=9))
    with pytest.raises(ValueError, match="cannot load the lyanna head"):
        load_lyanna_head(str(tmp_path / "missing"), model)
    with pytest.raises(ValueError, match="resample must be"):
        LyannaConfig(resample="sometimes")
    out = model.generate(
        prompt_ids(12, seed=3),
        max_new_tokens=16,
        do_sample=False,
        custom_generate=str(folder / "head"),
        trust_remote_code=True,
    )
    assert torch.equal(out, model.generate(prompt_ids(12, seed=3), max_new_tokens=16, do_sample=False))


def test_head_runs_in_a_bfloat16_target(trained):
    """A bfloat16 target loads its head in bfloat16 (features, masks and head agree on the dtype); greedy output
    equals the bfloat16 target's own `generate` up to bfloat16 ties (forwards of other shapes round otherwise)."""
    model, _, _, folder = trained
    target, dec = run_in_bfloat16(model, f"lyanna:{folder / 'head'}")
    assert next(dec.drafter_for(target).head.parameters()).dtype == torch.bfloat16
    assert dec.last_stats.accepted_tokens > 0


@pytest.mark.parametrize("resample", ["fused", "off"])
def test_padded_batch_verified_together_equals_generate(trained, resample):
    """Three left-padded rows, one head copy each, every round's trees verified in one forward."""
    from tests.test_rows import PAD, batch_of_three

    model, head, _, _ = trained
    ids, mask = batch_of_three()
    kwargs = dict(attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=PAD)
    cfg = LyannaConfig(depth=5, topk=3, budget=10, resample=resample)
    dec = SpeculativeDecoder(LyannaDrafter(cfg, model, head=head))
    assert torch.equal(model.generate(ids, **kwargs, custom_generate=dec), model.generate(ids, **kwargs))
    assert dec.last_stats.accepted_tokens > 0


def test_plain_steps_drop_the_resampled_subtree(trained, monkeypatch):
    """A batch that alternates drafted rounds and plain steps (`DraftSwitch`): a plain step verifies nothing of
    the last chain, so the re-sampled subtree built from it is dropped; the output is unchanged."""
    import hf_spec.decoder
    from tests.test_draft_switch import Alternating
    from tests.test_rows import PAD, batch_of_three

    monkeypatch.setattr(hf_spec.decoder, "DraftSwitch", Alternating)
    model, head, _, _ = trained
    ids, mask = batch_of_three()
    kwargs = dict(attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=PAD)
    drafter = LyannaDrafter(LyannaConfig(depth=5, topk=3, budget=10, resample="fused"), model, head=head)
    dropped = []
    skip = LyannaDrafter.skip_round

    def spy(self):
        dropped.append(self.resampled is not None)
        skip(self)
        assert self.resampled is None and self.chain_logits is None

    monkeypatch.setattr(LyannaDrafter, "skip_round", spy)
    dec = SpeculativeDecoder(drafter)
    assert torch.equal(model.generate(ids, **kwargs, custom_generate=dec), model.generate(ids, **kwargs))
    assert dec.last_stats.plain_rounds > 0 and dec.last_stats.accepted_tokens > 0
    assert any(dropped)


def test_training_loss_at_trained_positions_equals_the_loss_over_every_position(trained):
    """`lyanna_step` runs the LM head on the trained positions only; the loss and the agreement equal those of
    logits computed at every position and masked."""
    from hf_spec.training.batches import collate
    from hf_spec.training.losses import soft_cross_entropy
    from hf_spec.training.lyanna import lyanna_step, masked_mse
    from hf_spec.training.trainer import Unroll

    model, head, _, folder = trained
    sequences = capture_features(
        model, tiny_conversations(model, count=3), folder / "eq", topk=8, progress=False
    )
    sequences = sequences.load_sequences()
    sequences[1] = {k: v[:20] for k, v in sequences[1].items()}  # padding in the batch
    batch = collate(sequences, 512)
    cfg = LyannaTrainConfig(align_steps=3, draft_vocab=80, token_info_rank=8)
    t2d = torch.full((model.config.vocab_size,), -1, dtype=torch.long)
    t2d[head.d2t] = torch.arange(len(head.d2t))
    with torch.no_grad():
        loss, accs, _ = lyanna_step(head, batch, cfg, t2d)
        d = Unroll.of(head, batch, t2d)
        assert 0 < int(d.trained.sum()) < d.trained.numel()
        cache, want, want_accs, h = DynamicCache(), torch.zeros(()), [], None
        for j in range(1, 4):
            mask = alignment_mask(d.ids.shape[1], j)[None, None]
            if j == 1:
                h = head.first_step(d.f_in, d.ids, d.position_ids, mask, cache)
                logits = head.draft_logits(h) + (
                    0 if head.config.first_token_fusion else head.token_info(d.ids)
                )
            else:
                h = head.next_step(torch.cat([h[:, :1], h[:, :-1]], 1), d.position_ids, mask, cache)
                logits = head.draft_logits(h) + head.token_info(d.ids)
            logp, m = torch.log_softmax(logits.float(), -1), d.depth_mask(j)
            term = cfg.feature_weight * masked_mse(h, d.u_tgt, m) + cfg.ce_weight * soft_cross_entropy(
                logp, d.target_logits, m
            )
            want = want + term / 3
            want_accs.append(
                float(((logp.argmax(-1) == d.topk_ids[..., 0]) * m).sum() / m.sum().clamp(min=1))
            )
    assert torch.allclose(loss, want, rtol=1e-5) and accs == want_accs
