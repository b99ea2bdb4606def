"""HiSpec and exit heads: lossless greedy and sampling, per-layer-range cache bookkeeping checked against a
brute-force recompute at every step, exit-head training, save/load and mismatch errors."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from hf_spec import SpeculativeDecoder
from hf_spec.core.specs import parse_method
from hf_spec.methods.early_exit.config import EarlyExitConfig
from hf_spec.methods.early_exit.exit_heads import ExitHeads, load_exit_lm
from hf_spec.methods.hispec.config import HiSpecConfig
from hf_spec.methods.hispec.drafter import HiSpecDrafter
from hf_spec.training.exits import evaluate_heads, extract_cached, extract_features, train_heads
from tests.conftest import OUTPUT_CACHE, make_tiny_model, prompt_ids
from tests.stats import sampled_marginals_pvalues
from tests.test_sampling import V

LAYERS = 6


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model6(request):
    return make_tiny_model(request.param, layers=LAYERS)


@pytest.fixture(scope="module")
def trained_heads(tmp_path_factory):
    """Exit heads for layers 1..5 of a 6-layer tiny Llama, trained briefly on its own greedy continuations."""
    model = make_tiny_model("llama", layers=LAYERS)
    seqs = []
    for seed in range(6):
        ids = model.generate(prompt_ids(8, seed=seed), max_new_tokens=40, do_sample=False)[0]
        seqs.append((ids, 7))
    feats = extract_features(model, seqs, [1, 2, 3, 4, 5], top_k=8)
    heads = ExitHeads.for_target(model, [1, 2, 3, 4, 5], rank=8, target_name="tiny-llama")
    before = evaluate_heads(model, heads, feats)
    history = train_heads(model, heads, feats, steps=60, batch_size=64, lr=1e-2, negatives=32)
    after = evaluate_heads(model, heads, feats)
    folder = tmp_path_factory.mktemp("exits")
    heads.save_pretrained(folder)
    return model, heads, folder, before, after, history


@pytest.mark.parametrize(
    "cfg",
    [
        dict(draft_layer=1, verify_layer=3, num_draft_tokens=2, num_buffer_tokens=4),
        dict(draft_layer=2, verify_layer=4, num_draft_tokens=1, num_buffer_tokens=1),
        dict(draft_layer=1, verify_layer=2, num_draft_tokens=3, num_buffer_tokens=5),
        dict(draft_layer=3, verify_layer=5, num_draft_tokens=4, num_buffer_tokens=2),
    ],
)
def test_greedy_equals_generate(model6, cfg):
    ids = prompt_ids(14, seed=1)
    ref = model6.generate(ids, max_new_tokens=40, do_sample=False)
    dec = SpeculativeDecoder(HiSpecConfig(**cfg))
    out = model6.generate(ids, max_new_tokens=40, do_sample=False, custom_generate=dec)
    assert torch.equal(out, ref)
    counts = dec.drafter_for(model6).counts
    assert counts["rounds"] >= dec.last_stats.target_forwards - 1  # one full verification per round (the
    # last may be a plain forward with nothing left to draft)
    assert dec.last_stats.accepted_tokens > 0


@pytest.mark.parametrize("max_new", [1, 2, 3, 7])
def test_max_length_cuts_the_buffer(model6, max_new):
    ids = prompt_ids(10, seed=5)
    ref = model6.generate(ids, max_new_tokens=max_new, do_sample=False)
    dec = SpeculativeDecoder(
        HiSpecConfig(draft_layer=1, verify_layer=2, num_draft_tokens=3, num_buffer_tokens=6)
    )
    assert torch.equal(
        model6.generate(ids, max_new_tokens=max_new, do_sample=False, custom_generate=dec), ref
    )


def test_greedy_with_logits_processors(model6):
    ids = prompt_ids(10, seed=3)
    kw = dict(max_new_tokens=40, do_sample=False, repetition_penalty=1.3, no_repeat_ngram_size=3)
    dec = SpeculativeDecoder(HiSpecConfig(draft_layer=2, verify_layer=4))
    assert torch.equal(model6.generate(ids, custom_generate=dec, **kw), model6.generate(ids, **kw))


def _brute_force(model, seq: list[int]):
    out = model(input_ids=torch.tensor([seq]), use_cache=True, output_hidden_states=True)
    return getattr(out, OUTPUT_CACHE), out.hidden_states


class CheckedHiSpec(HiSpecDrafter):
    """After every intermediate check and every full verification, compare every layer's cache (and the buffered
    hidden states) with a full recompute of the sequence that layer must hold."""

    steps: Counter

    def _assert_layers(self, state, seq: list[int], lengths: list[int]) -> None:
        kv, _ = _brute_force(state.model, seq)
        for i, layer in enumerate(state.cache.layers):
            n = lengths[i]
            assert layer.keys.shape[-2] == n, (i, layer.keys.shape, n)
            torch.testing.assert_close(layer.keys, kv.layers[i].keys[..., :n, :], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(layer.values, kv.layers[i].values[..., :n, :], atol=1e-4, rtol=1e-4)

    def _check(self, state, rnd, drafts, hidden):
        super()._check(state, rnd, drafts, hidden)
        seq = state.input_ids[0].tolist() + rnd.tokens  # committed (root included) + buffer
        assert rnd.held == len(seq)
        lengths = [rnd.held if i < self.verify_layer else rnd.past for i in range(self.parts.num_layers)]
        self._assert_layers(state, seq, lengths)
        _, hs = _brute_force(state.model, seq)
        torch.testing.assert_close(
            torch.cat(rnd.hidden, dim=1), hs[self.verify_layer][:, rnd.past :], atol=1e-4, rtol=1e-4
        )
        self.steps["checks"] += 1

    def observe(self, state, result):
        super().observe(state, result)
        past = state.seq_len - 1
        self._assert_layers(state, state.input_ids[0].tolist(), [past] * self.parts.num_layers)
        self.steps["rounds"] += 1


@pytest.mark.parametrize("nd,ni", [(2, 4), (3, 2)])
def test_per_layer_cache_matches_brute_force_every_step(model6, nd, ni):
    cfg = HiSpecConfig(draft_layer=2, verify_layer=4, num_draft_tokens=nd, num_buffer_tokens=ni)
    drafter = CheckedHiSpec(cfg, model6)
    drafter.steps = Counter()
    ids = prompt_ids(12, seed=7)
    ref = model6.generate(ids, max_new_tokens=30, do_sample=False)
    out = model6.generate(
        ids, max_new_tokens=30, do_sample=False, custom_generate=SpeculativeDecoder(drafter)
    )
    assert torch.equal(out, ref)
    assert drafter.steps["checks"] > 5 and drafter.steps["rounds"] > 3
    assert drafter.counts["rejected_early"] > 0  # pruning after an early rejection was exercised


def test_sampling_matches_plain_sampling():
    """Chi-square of the per-position marginals against plain sampling's exact ones (as tests/test_sampling)."""
    target = make_tiny_model("llama", seed=11, vocab_size=V, layers=4, temperature=2.0)
    dec = SpeculativeDecoder(
        HiSpecConfig(draft_layer=1, verify_layer=2, num_draft_tokens=2, num_buffer_tokens=2)
    )
    pvalues, accepted = sampled_marginals_pvalues(target, lambda: dec, n=1000, seed=2025)
    assert accepted > 1000 * 0.2  # buffered tokens are really accepted, not only bonus tokens
    assert min(pvalues) > 1e-3, pvalues


def test_sampling_with_packed_draft_weights_matches_plain_sampling():
    """Early exit drafting from int8 copies of its layers: the proposals change, the sampled distribution must not."""
    target = make_tiny_model("llama", seed=11, vocab_size=V, layers=4, temperature=2.0)
    dec = SpeculativeDecoder(EarlyExitConfig(exit_layer=2, num_draft_tokens=2, quantize="int8"))
    pvalues, accepted = sampled_marginals_pvalues(target, lambda: dec, n=1000, seed=2026)
    assert dec.drafter_for(target).quantized  # the packed copies were really used
    assert accepted > 1000 * 0.2
    assert min(pvalues) > 1e-3, pvalues


def test_bad_layers_are_clear_errors(model6):
    with pytest.raises(ValueError, match="0 < draft_layer < verify_layer"):
        HiSpecDrafter(HiSpecConfig(draft_layer=3, verify_layer=3), model6)
    with pytest.raises(ValueError, match="0 < draft_layer < verify_layer"):
        HiSpecDrafter(HiSpecConfig(draft_layer=2, verify_layer=LAYERS), model6)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        HiSpecConfig(num_draft_tokens=0)


def test_transformers_assisted_loop_is_refused(model6):
    """HiSpec needs the loop to call its verify_forward; transformers' loop does not: a clear error."""
    from hf_spec.integrations import enable_assistant

    dec = SpeculativeDecoder(HiSpecConfig(draft_layer=1, verify_layer=3))
    with (
        enable_assistant(model6, loop="transformers"),
        pytest.raises(ValueError, match="hf-spec's loop only"),
    ):
        model6.generate(prompt_ids(10), max_new_tokens=8, do_sample=False, assistant_model=dec)


def test_default_placement_is_depth_over_8_and_4():
    model = make_tiny_model("llama", layers=16)
    drafter = HiSpecDrafter(HiSpecConfig(), model)
    assert (drafter.draft_layer, drafter.verify_layer) == (2, 4)


def test_config_round_trip(tmp_path):
    cfg = HiSpecConfig(draft_layer=3, verify_layer=9, num_draft_tokens=3, num_buffer_tokens=6, exit_heads="x")
    cfg.save_pretrained(tmp_path)
    assert parse_method(str(tmp_path / "hf_spec_config.json")) == cfg


# ---- exit heads ---------------------------------------------------------------------------------------------


def test_training_lowers_the_distillation_loss(trained_heads):
    _, _, _, before, after, history = trained_heads
    # soft cross-entropy includes the teacher's entropy (irreducible): ask for a clear drop, not a large ratio
    assert sum(history[-5:]) / 5 < sum(history[:5]) / 5 - 0.1
    for k in before:
        assert after[k]["loss"] < before[k]["stock_loss"], k
        assert before[k]["loss"] == pytest.approx(before[k]["stock_loss"])  # untrained heads = the stock exit


def test_untrained_heads_are_the_stock_exit(model6):
    heads = ExitHeads.for_target(model6, [2, 3], rank=4)
    h = torch.randn(1, 5, model6.config.hidden_size)
    stock = load_exit_lm(model6, None)
    torch.testing.assert_close(stock.logits(2, h), type(stock)(stock.parts, heads).logits(2, h))


def test_save_load_round_trip(trained_heads):
    model, heads, folder, *_ = trained_heads
    loaded = ExitHeads.from_pretrained(folder, model)
    assert loaded.config.layers == [1, 2, 3, 4, 5] and loaded.config.target_name == "tiny-llama"
    h = torch.randn(3, model.config.hidden_size)
    ref = ExitHeads(heads.config)
    ref.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in heads.state_dict().items()})
    torch.testing.assert_close(loaded(3, h), ref(3, h))
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()


def test_heads_refuse_another_target(trained_heads):
    _, _, folder, *_ = trained_heads
    other = make_tiny_model("llama", seed=9, layers=LAYERS)
    with pytest.raises(ValueError, match="different llama model"):
        ExitHeads.from_pretrained(folder, other)
    with pytest.raises(ValueError, match="different llama model"):
        HiSpecDrafter(HiSpecConfig(draft_layer=1, verify_layer=3, exit_heads=str(folder)), other)
    qwen = make_tiny_model("qwen2", layers=LAYERS)
    with pytest.raises(ValueError, match="model_type='llama'"):
        SpeculativeDecoder(EarlyExitConfig(exit_layer=2, exit_heads=str(folder))).drafter_for(qwen)


def test_missing_layer_and_missing_folder_are_clear_errors(trained_heads, tmp_path):
    model, _, folder, *_ = trained_heads
    small = ExitHeads.for_target(model, [2], rank=2)
    small.save_pretrained(tmp_path / "one")
    with pytest.raises(ValueError, match=r"no head for layer\(s\) \[4\]"):
        HiSpecDrafter(HiSpecConfig(draft_layer=2, verify_layer=4, exit_heads=str(tmp_path / "one")), model)
    with pytest.raises(FileNotFoundError, match="no exit heads"):
        ExitHeads.from_pretrained(tmp_path / "nowhere", model)
    with pytest.raises(ValueError, match="exit layers must be in"):
        ExitHeads.for_target(model, [LAYERS])
    weights = tmp_path / "one" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:64])  # truncated
    with pytest.raises(ValueError, match="model.safetensors does not match its checksum"):
        ExitHeads.from_pretrained(tmp_path / "one", model)
    for text in ("{oops", "[1]"):
        (tmp_path / "one" / "config.json").write_text(text)
        with pytest.raises(ValueError, match="not readable JSON|not an exit-heads config"):
            ExitHeads.from_pretrained(tmp_path / "one", model)


@pytest.mark.parametrize("spec", ["hispec", "early-exit"])
def test_lossless_with_trained_heads(trained_heads, spec):
    model, _, folder, *_ = trained_heads
    ids = prompt_ids(12, seed=11)
    ref = model.generate(ids, max_new_tokens=40, do_sample=False)
    if spec == "hispec":
        cfg = HiSpecConfig(draft_layer=2, verify_layer=4, exit_heads=str(folder))
    else:
        cfg = EarlyExitConfig(exit_layer=3, exit_heads=str(folder))
    dec = SpeculativeDecoder(cfg)
    assert torch.equal(model.generate(ids, max_new_tokens=40, do_sample=False, custom_generate=dec), ref)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_early_exit_drafting_is_lossless(trained_heads, monkeypatch, scheme):
    """Packed draft weights (the drafting layers and the exit's LM-head rows) change only what is drafted: the output
    equals plain greedy decoding, also with Post-use's step-wise drafting around it, and the target's own linears
    are left unpatched."""
    from hf_spec.kernels.weight_only import QuantizedWeight
    from hf_spec.methods.postuse.config import PostUseConfig

    model, _, folder, *_ = trained_heads
    rows = []
    real = QuantizedWeight.linear
    monkeypatch.setattr(
        QuantizedWeight, "linear", lambda self, x, b=None: rows.append(x.shape[-2]) or real(self, x, b)
    )
    cfg = EarlyExitConfig(exit_layer=3, num_draft_tokens=3, exit_heads=str(folder), quantize=scheme)
    for method in (cfg, PostUseConfig(drafter=cfg.to_dict(), draft_length=3)):
        for seed in (11, 12):
            ids = prompt_ids(12, seed=seed)
            ref = model.generate(ids, max_new_tokens=40, do_sample=False)
            dec = SpeculativeDecoder(method)
            assert torch.equal(
                model.generate(ids, max_new_tokens=40, do_sample=False, custom_generate=dec), ref
            )
            assert dec.last_stats.accepted_tokens > 0
    drafter = SpeculativeDecoder(cfg).drafter_for(model)
    assert len(drafter.quantized) == 3 * 7 and drafter.exits.head_int8 is not None  # 3 layers x 7 linears
    assert rows and all("forward" not in m.__dict__ for m in model.modules())
    with pytest.raises(ValueError, match="quantize must be"):
        EarlyExitConfig(quantize="int3")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_talon_exit_drafter_takes_the_configs_heads_and_draft_weights(
    trained_heads, tmp_path, monkeypatch, mode
):
    """Talon's own-cache exit chain reads the early-exit config's exit heads and packed draft weights (before
    session 22 it silently used the stock final norm + LM head); in async mode the target's verification on the
    main thread must still read its own weights while the worker drafts with the packed ones."""
    from hf_spec.methods.early_exit.exit_heads import ExitLM
    from hf_spec.methods.talon.config import TalonConfig

    model, _, folder, *_ = trained_heads
    path = tmp_path / "ee.json"
    cfg = EarlyExitConfig(exit_layer=3, num_draft_tokens=3, exit_heads=str(folder), quantize="int8")
    path.write_text(json.dumps(cfg.to_dict()))
    layers = []
    real = ExitLM.logits
    monkeypatch.setattr(ExitLM, "logits", lambda self, layer, h: layers.append(layer) or real(self, layer, h))
    dec = SpeculativeDecoder(TalonConfig(retrieval=None, drafter=str(path), schedule={"mode": mode}))
    for seed in (11, 12):
        ids = prompt_ids(12, seed=seed)
        ref = model.generate(ids, max_new_tokens=40, do_sample=False)
        assert torch.equal(model.generate(ids, max_new_tokens=40, do_sample=False, custom_generate=dec), ref)
    chain = dec.drafter_for(model).chain
    assert layers and set(layers) == {3} and len(chain.quantized) == 3 * 7
    assert dec.last_stats.accepted_tokens > 0


def test_name_colon_config_json_parses(tmp_path):
    cfg = HiSpecConfig(draft_layer=2, verify_layer=5)
    path = tmp_path / "h.json"
    path.write_text(json.dumps(cfg.to_dict()))
    assert parse_method(f"hispec:{path}") == cfg
    with pytest.raises(ValueError, match="not 'early-exit'"):
        parse_method(f"early-exit:{path}")


def test_training_resumes_from_its_checkpoint(tmp_path):
    """An interrupted run resumed from its checkpoint ends with the same weights as an uninterrupted one."""
    model = make_tiny_model("qwen2", layers=4)
    seqs = [
        (model.generate(prompt_ids(6, seed=s), max_new_tokens=20, do_sample=False)[0], 5) for s in range(3)
    ]
    feats = extract_features(model, seqs, [1, 2], top_k=4)
    kw = dict(steps=10, batch_size=16, lr=1e-2, negatives=8, save_every=5)

    def fresh() -> ExitHeads:
        torch.manual_seed(0)
        return ExitHeads.for_target(model, [1, 2], rank=4)

    full = fresh()
    train_heads(model, full, feats, **kw)

    class Interrupt:
        def __init__(self, **_):
            self.n = 0

        def update(self, _):
            self.n += 1
            if self.n == 7:
                raise KeyboardInterrupt

        def set_postfix(self, **_):
            pass

    ckpt = tmp_path / "ckpt.pt"
    with pytest.raises(KeyboardInterrupt):
        train_heads(model, fresh(), feats, checkpoint=ckpt, progress=Interrupt, **kw)
    assert torch.load(ckpt, weights_only=False)["step"] == 5
    resumed = fresh()
    history = train_heads(model, resumed, feats, checkpoint=ckpt, **kw)
    assert len(history) == 10
    for (name, a), b in zip(full.state_dict().items(), resumed.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, msg=name)
    # the checkpoint records its settings: another rank (shapes) or step count is refused by name
    with pytest.raises(ValueError, match=r"other settings \(rank 4 -> 8"):
        train_heads(model, ExitHeads.for_target(model, [1, 2], rank=8), feats, checkpoint=ckpt, **kw)
    with pytest.raises(ValueError, match=r"steps 10 -> 12"):
        train_heads(model, fresh(), feats, checkpoint=ckpt, **(kw | {"steps": 12}))


def test_cached_features_follow_the_data_not_the_chunk_number(tmp_path):
    """Rerunning extraction in the same work dir on other sequences extracts them afresh (was: reused the first
    run's chunk files, so a head trained on another --data file learned from stale features)."""
    model = make_tiny_model("llama", layers=4)
    first = [(prompt_ids(12, seed=s)[0], 3) for s in range(2)]
    second = [(prompt_ids(12, seed=s + 10)[0], 3) for s in range(2)]
    a = extract_cached(model, first, [1, 2], 4, tmp_path, name="train")
    b = extract_cached(model, second, [1, 2], 4, tmp_path, name="train")
    fresh = extract_features(model, second, [1, 2], top_k=4)
    assert not torch.equal(a.top_ids, b.top_ids)
    torch.testing.assert_close(b.top_ids, fresh.top_ids)
    again = extract_cached(model, first, [1, 2], 4, tmp_path, name="train")  # cached chunks are still reused
    torch.testing.assert_close(again.top_ids, a.top_ids)


def test_exit_heads_are_not_saved_over_another_folder(trained_heads, tmp_path):
    _, heads, folder, *_ = trained_heads
    heads.save_pretrained(folder)  # over earlier exit heads: fine
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"already holds other files \(notes.txt\)"):
        heads.save_pretrained(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_draft_vocabulary(trained_heads, tmp_path):
    """Exits restricted to the heads' draft vocabulary: saved and loaded with the heads, -inf elsewhere, argmax
    equal to the full exit's wherever that argmax is in the vocabulary, and still lossless."""
    model, heads, folder, *_ = trained_heads
    with pytest.raises(ValueError, match="--draft-vocab"):
        load_exit_lm(model, folder, draft_vocab=True)
    vocab = torch.arange(3, 60)
    with_vocab = ExitHeads.from_pretrained(folder, model)
    with_vocab.set_draft_vocab(vocab)
    with_vocab.save_pretrained(tmp_path / "v")
    assert torch.equal(ExitHeads.from_pretrained(tmp_path / "v", model).draft_vocab, vocab)
    full, sub = load_exit_lm(model, tmp_path / "v"), load_exit_lm(model, tmp_path / "v", draft_vocab=True)
    h = torch.randn(1, 40, model.config.hidden_size)
    lf, ls = full.logits(3, h), sub.logits(3, h)
    assert bool(torch.isinf(ls[..., 60:]).all()) and torch.allclose(ls[..., 3:60], lf[..., 3:60], atol=1e-5)
    inside = (lf.argmax(-1) >= 3) & (lf.argmax(-1) < 60)
    assert torch.equal(ls.argmax(-1)[inside], lf.argmax(-1)[inside])
    ids = prompt_ids(12, seed=12)
    ref = model.generate(ids, max_new_tokens=30, do_sample=False)
    for cfg in (
        HiSpecConfig(draft_layer=2, verify_layer=4, exit_heads=str(tmp_path / "v"), draft_vocab=True),
        EarlyExitConfig(exit_layer=3, exit_heads=str(tmp_path / "v"), draft_vocab=True),
    ):
        out = model.generate(ids, max_new_tokens=30, do_sample=False, custom_generate=SpeculativeDecoder(cfg))
        assert torch.equal(out, ref)


def test_frequent_tokens():
    from hf_spec.training.exits import frequent_tokens

    assert frequent_tokens([[5, 5, 7], [7, 7, 9], [1]], 2, always=[0]).tolist() == [0, 5, 7]
