"""Published EAGLE-1/2 heads (the EAGLE authors' layout) on tiny random Llama and Qwen2 targets: checkpoints
written by `write_eagle_checkpoint` from the layout's description, drafts checked against `reference_states`, an
independent plain-torch forward of the EAGLE-1 head; lossless greedy and sampling; clear errors for wrong
targets, damaged checkpoints and pickles with code in them."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, DynamicCache, GenerationConfig, LlamaConfig

from hf_spec import SpeculativeDecoder
from hf_spec.core.drafter import SpecState
from hf_spec.engine.target.profile import target_profile
from hf_spec.methods.eagle import EagleConfig, EagleDrafter
from hf_spec.methods.eagle.drafter import load_head
from hf_spec.methods.eagle.published import PublishedEagleHead
from tests.conftest import CACHE, make_tiny_model, prompt_ids, tiny_fields


# ---- the published layout, written from its description ---------------------------------------------------------
def eagle_config(target, **overrides) -> dict:
    """config.json of an EAGLE-1/2 head for `target`: a one-layer Llama config with the target's sizes."""
    c = target.config
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": 48,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "vocab_size": c.vocab_size,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
    }
    return {**config, **overrides}


def eagle_tensors(config: dict, seed: int = 0, embed: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Random weights under the EAGLE authors' key names and shapes."""
    g = torch.Generator().manual_seed(seed)
    h, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    d = h // heads

    def rand(*shape, std=0.2):
        return torch.randn(*shape, generator=g) * std

    t = {"fc.weight": rand(h, 2 * h)}
    if config.get("bias", True):
        t["fc.bias"] = rand(h, std=0.05)
    p = "layers.0."
    t |= {
        p + "self_attn.q_proj.weight": rand(heads * d, h),
        p + "self_attn.k_proj.weight": rand(kv * d, h),
        p + "self_attn.v_proj.weight": rand(kv * d, h),
        p + "self_attn.o_proj.weight": rand(h, heads * d),
        p + "mlp.gate_proj.weight": rand(inter, h),
        p + "mlp.up_proj.weight": rand(inter, h),
        p + "mlp.down_proj.weight": rand(h, inter),
        p + "post_attention_layernorm.weight": 1 + rand(h, std=0.1),
    }
    if config.get("qkv_bias"):
        for name, rows in (("q", heads * d), ("k", kv * d), ("v", kv * d)):
            t[p + f"self_attn.{name}_proj.bias"] = rand(rows, std=0.05)
    if embed is not None:
        t["embed_tokens.weight"] = embed.detach().clone()
    return t


def write_eagle_checkpoint(
    folder: Path, target, fmt: str = "safetensors", seed: int = 0, with_embed: bool = False, **overrides
) -> dict[str, torch.Tensor]:
    """Write `config.json` + `model.safetensors` or `pytorch_model.bin` (fp16, as published); returns the
    tensors in float32."""
    folder.mkdir(parents=True, exist_ok=True)
    config = eagle_config(target, **overrides)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tensors = eagle_tensors(config, seed, target.get_input_embeddings().weight if with_embed else None)
    half = {k: v.half().contiguous() for k, v in tensors.items()}
    if fmt == "safetensors":
        save_file(half, str(folder / "model.safetensors"))
    else:
        torch.save(half, folder / "pytorch_model.bin")
    return {k: v.float() for k, v in half.items()}


# ---- an independent forward of the EAGLE-1 head ------------------------------------------------------------------
def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """x: [heads, T, d] rotated by positions pos [T] (rotate-half convention)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.double()[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos().float(), torch.cat([ang, ang], -1).sin().float()
    rot = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + rot * sin


def reference_states(t: dict, config: dict, embed: torch.Tensor, feats: torch.Tensor, ids: torch.Tensor, pos):
    """EAGLE-1 head states `(T, H)` for pairs (feature `feats[i]`, token `ids[i]`) at rotary positions `pos[i]`,
    each seeing the pairs before it: fc([E(x); f]) -> attention without an input norm -> MLP."""
    h, heads, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    d, n = h // heads, len(ids)
    x = torch.cat([embed[ids], feats], -1) @ t["fc.weight"].T + t.get("fc.bias", 0)
    p = "layers.0.self_attn."

    def proj(name, rows):
        return (
            (x @ t[p + f"{name}_proj.weight"].T + t.get(p + f"{name}_proj.bias", 0))
            .view(n, rows, d)
            .transpose(0, 1)
        )

    q = _rope(proj("q", heads), pos, config["rope_theta"])
    k = _rope(proj("k", kv), pos, config["rope_theta"]).repeat_interleave(heads // kv, 0)
    v = proj("v", kv).repeat_interleave(heads // kv, 0)
    scores = q @ k.transpose(1, 2) / d**0.5 + torch.full((n, n), float("-inf")).triu(1)
    att = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, h)
    y = x + att @ t[p + "o_proj.weight"].T
    m = _rms(y, t["layers.0.post_attention_layernorm.weight"], config["rms_norm_eps"])
    mlp = "layers.0.mlp."
    act = torch.nn.functional.silu(m @ t[mlp + "gate_proj.weight"].T) * (m @ t[mlp + "up_proj.weight"].T)
    return y + act @ t[mlp + "down_proj.weight"].T


# ---- fixtures ----------------------------------------------------------------------------------------------------
ARCHS = {  # target architecture -> (weights file format, config fields of its published head)
    "llama": ("safetensors", {}),
    "qwen2": ("bin", {"bias": False, "qkv_bias": True}),
}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def published(request, tmp_path_factory):
    """`(target, folder, tensors, config)`: a tiny target and an EAGLE head for it in the published layout."""
    arch = request.param
    fmt, overrides = ARCHS[arch]
    target = make_tiny_model(arch, temperature=16.0)
    with torch.no_grad():  # a final norm that is not all ones: unit features and post-norm states then differ
        target.model.norm.weight.copy_(1 + 0.5 * torch.randn(32, generator=torch.Generator().manual_seed(7)))
    folder = tmp_path_factory.mktemp(f"published-{arch}") / "head"
    tensors = write_eagle_checkpoint(folder, target, fmt, seed=3, **overrides)
    return target, folder, tensors, eagle_config(target, **overrides)


def _state(model, ids: torch.Tensor) -> SpecState:
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(input_ids=ids[:, :-1], **{CACHE: cache}, use_cache=True, output_hidden_states=True)
    return SpecState(
        model,
        cache,
        ids,
        GenerationConfig(),
        hidden_states=out.hidden_states[-1],
        backend=target_profile(model).backend,
    )


# ---- tests -------------------------------------------------------------------------------------------------------
def test_loader_detects_the_layout_and_reads_post_norm_states(published):
    target, folder, tensors, _ = published
    head = load_head(str(folder), target)
    assert isinstance(head, PublishedEagleHead) and head.reads_post_norm_states
    assert (head.fc.bias is not None) == ("fc.bias" in tensors)
    assert isinstance(head.layer.input_layernorm, torch.nn.Identity)
    assert head.parts.lm_weight.data_ptr() == target.lm_head.weight.data_ptr()  # the target's, not a copy


def test_drafts_match_an_independent_forward(published):
    """The EAGLE-2 tree's first two levels equal top-k of the reference head fed the target's post-norm states."""
    target, folder, t, config = published
    ids = prompt_ids(10, seed=5)
    n, topk = ids.shape[1], 3
    drafter = EagleDrafter(EagleConfig(head=str(folder), depth=2, topk=topk, total_tokens=64), target)
    drafter.begin(_state(target, ids))
    tree = drafter.propose(_state(target, ids), max_depth=2)
    with torch.no_grad():
        y = target.model(input_ids=ids).last_hidden_state[0]  # [n, H], after the final norm
    embed, lm = target.get_input_embeddings().weight.detach(), target.lm_head.weight.detach()
    # committed pairs (y_i, x_{i+1}) at EAGLE positions i = 0..n-2; the last one predicts the token after x_{n-1}
    states = reference_states(t, config, embed, y[:-1], ids[0, 1:], torch.arange(n - 1))
    first = (states[-1] @ lm.T).topk(topk).indices.tolist()
    roots = [i for i, p in enumerate(tree.parents.tolist()) if p == -1]
    assert [int(tree.tokens[i]) for i in roots] == first
    for node in roots:  # level 2: the node's token paired with the state that predicted it, at position n - 1
        tok = int(tree.tokens[node])
        s = reference_states(
            t,
            config,
            embed,
            torch.cat([y[:-1], states[-1:]]),
            torch.cat([ids[0, 1:], torch.tensor([tok])]),
            torch.arange(n),
        )
        want = (s[-1] @ lm.T).topk(topk).indices.tolist()
        children = [int(tree.tokens[i]) for i, p in enumerate(tree.parents.tolist()) if p == node]
        assert children == want, (tok, children, want)


@pytest.mark.parametrize("seed", [1, 2])
def test_greedy_equals_generate(published, seed):
    target, folder, _, _ = published
    dec = SpeculativeDecoder(f"eagle:{folder}")
    ids = prompt_ids(12, seed=seed)
    ref = target.generate(ids, max_new_tokens=40, do_sample=False)
    out = target.generate(ids, max_new_tokens=40, do_sample=False, custom_generate=dec)
    assert torch.equal(out, ref)
    assert dec.last_stats.draft_tokens > 0


def test_bin_and_safetensors_load_the_same_head(tmp_path):
    target = make_tiny_model("llama")
    write_eagle_checkpoint(tmp_path / "st", target, "safetensors", seed=4)
    write_eagle_checkpoint(tmp_path / "bin", target, "bin", seed=4, with_embed=True)  # + an embedding copy
    a, b = load_head(str(tmp_path / "st"), target), load_head(str(tmp_path / "bin"), target)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("loop", ["batched", pytest.param("hf-spec", marks=pytest.mark.slow)])
def test_sampling_keeps_target_distribution(tmp_path, loop):
    from tests.stats import sampled_marginals_pvalues
    from tests.test_sampling import V

    target = make_tiny_model("llama", seed=11, vocab_size=V, layers=2, temperature=2.0)
    write_eagle_checkpoint(tmp_path / "head", target, seed=1)
    cfg = EagleConfig(head=str(tmp_path / "head"), depth=3, topk=2, total_tokens=5)
    pvalues, accepted = sampled_marginals_pvalues(target, lambda: SpeculativeDecoder(cfg), loop)
    assert accepted > 0
    assert min(pvalues) > 1e-3, pvalues


def test_wrong_target_is_refused_naming_the_mismatch(tmp_path):
    target = make_tiny_model("llama")
    write_eagle_checkpoint(tmp_path / "h", target)
    wide = AutoModelForCausalLM.from_config(LlamaConfig(**(tiny_fields() | {"hidden_size": 48})))
    with pytest.raises(ValueError, match=r"hidden states of size 32, but the target's hidden size is 48"):
        load_head(str(tmp_path / "h"), wide)
    with pytest.raises(ValueError, match=r"vocabulary of 96 tokens, but the target's vocab size is 128"):
        load_head(str(tmp_path / "h"), make_tiny_model("llama", vocab_size=128))
    write_eagle_checkpoint(tmp_path / "q", target, model_type="qwen2")
    with pytest.raises(
        ValueError, match=r"names a 'qwen2' target in its config, but the target is a 'llama'"
    ):
        load_head(str(tmp_path / "q"), target)
    load_head(str(tmp_path / "q"), make_tiny_model("qwen2"))  # the family it names: accepted


def test_damaged_checkpoints_are_clear_errors(tmp_path):
    target = make_tiny_model("llama")
    good = write_eagle_checkpoint(tmp_path / "h", target)
    (tmp_path / "h" / "model.safetensors").write_bytes(b"truncated")
    with pytest.raises(ValueError, match="model.safetensors is not a readable safetensors file"):
        load_head(str(tmp_path / "h"), target)
    save_file(
        {k: v for k, v in good.items() if k != "layers.0.mlp.up_proj.weight"},
        str(tmp_path / "h" / "model.safetensors"),
    )
    with pytest.raises(ValueError, match=r"lacks weights \['layer.mlp.up_proj.weight'\]"):
        load_head(str(tmp_path / "h"), target)
    bad = dict(good) | {"layers.0.mlp.up_proj.weight": torch.zeros(7, 32)}
    save_file(bad, str(tmp_path / "h" / "model.safetensors"))
    with pytest.raises(
        ValueError, match=r"up_proj.weight has shape \(7, 32\), its config implies \(48, 32\)"
    ):
        load_head(str(tmp_path / "h"), target)
    save_file(
        dict(good) | {"layers.0.extra.weight": torch.zeros(2)}, str(tmp_path / "h" / "model.safetensors")
    )
    with pytest.raises(ValueError, match=r"unexpected weights \['layer.extra.weight'\]"):
        load_head(str(tmp_path / "h"), target)
    os.remove(tmp_path / "h" / "model.safetensors")
    with pytest.raises(ValueError, match="no model.safetensors or pytorch_model.bin"):
        load_head(str(tmp_path / "h"), target)
    config = eagle_config(target)
    del config["intermediate_size"]
    (tmp_path / "h" / "config.json").write_text(json.dumps(config))
    save_file(good, str(tmp_path / "h" / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks or garbles a field.*intermediate_size"):
        load_head(str(tmp_path / "h"), target)


def test_an_eagle3_checkpoint_under_eagle_names_the_method(tmp_path):
    target = make_tiny_model("llama")
    folder = tmp_path / "e3"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(eagle_config(target, draft_vocab_size=64)))
    save_file(
        {"fc.weight": torch.zeros(32, 96), "midlayer.hidden_norm.weight": torch.ones(32)},
        str(folder / "model.safetensors"),
    )
    with pytest.raises(ValueError, match=r"is a published EAGLE-3 head: use eagle3:"):
        load_head(str(folder), target)


class _Touch:
    """A pickled object whose unpickling would create a file: the code a `.bin` must not run."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def test_a_bin_with_code_in_it_is_refused(tmp_path):
    target = make_tiny_model("llama")
    tensors = write_eagle_checkpoint(tmp_path / "h", target, "bin")
    marker = tmp_path / "code-ran"
    torch.save({**tensors, "fc.weight": _Touch(marker)}, tmp_path / "h" / "pytorch_model.bin")
    with pytest.raises(
        ValueError, match="refused .*pytorch_model.bin holds pickled objects other than tensors"
    ):
        load_head(str(tmp_path / "h"), target)
    with open(tmp_path / "h" / "pytorch_model.bin", "wb") as f:  # a plain pickle, not torch's zip format
        pickle.dump({"fc.weight": _Touch(marker)}, f)
    with pytest.raises(ValueError, match="refused|not a readable checkpoint"):
        load_head(str(tmp_path / "h"), target)
    assert not marker.exists()
