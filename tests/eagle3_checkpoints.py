"""EAGLE-3 checkpoints written from the published layouts' descriptions (not by hf-spec's writer), and an
independent plain-torch forward of the EAGLE-3 head, for the loader, export and round-trip tests.

Layouts (see docs/published_heads.md):
- `authors`: the EAGLE authors' `yuhuili/EAGLE3-*` heads: a Llama config with `draft_vocab_size`, no layer ids
  (the target states entering layers 2, L//2, L-3), `pytorch_model.bin` with `midlayer.*`, no embedding;
- `sglang`: SpecForge/SGLang: `architectures: ["LlamaForCausalLMEagle3"]`, `eagle_config.
  eagle_aux_hidden_state_layer_ids` (ids of the layers whose output is read), `model.safetensors`, an embedding;
- `vllm`: vLLM's speculators: `speculators_model_type: "eagle3"`, `transformer_layer_config`,
  `norm_before_residual`, top-level `eagle_aux_hidden_state_layer_ids` (indices of `output_hidden_states`),
  `layers.0.*` keys.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

DRAFT_VOCAB = 40
LAYER = {"hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4, "num_key_value_heads": 2}


def draft_vocab(target) -> int:
    return min(DRAFT_VOCAB, target.config.vocab_size)


def eagle3_config(target, layout: str, layer_ids=None, **overrides) -> dict:
    """config.json of an EAGLE-3 head for `target` in `layout`; `layer_ids` in that layout's own convention."""
    layer = {
        "model_type": "llama",
        **LAYER,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "vocab_size": target.config.vocab_size,
        "tie_word_embeddings": False,
    }
    if layout == "vllm":
        config = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "speculators_version": "0.1.0",
            "draft_vocab_size": draft_vocab(target),
            "norm_before_residual": True,
            "transformer_layer_config": layer,
            "speculators_config": {
                "algorithm": "eagle3",
                "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                "verifier": {"name_or_path": "tiny", "architectures": ["LlamaForCausalLM"]},
            },
            "eagle_aux_hidden_state_layer_ids": list(layer_ids),
        }
    else:
        config = {
            "architectures": ["LlamaForCausalLMEagle3"],
            **layer,
            "draft_vocab_size": draft_vocab(target),
        }
        config |= {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "torch_dtype": "float16"}
        if layout == "sglang":
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}
    return {**config, **overrides}


def eagle3_tensors(target, layout: str, width: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under `layout`'s key names and shapes; `width` is fc's input (k target states)."""
    g = torch.Generator().manual_seed(seed)
    h, inter, heads, kv = (LAYER[k] for k in LAYER)
    d, vocab, dv = h // heads, target.config.vocab_size, draft_vocab(target)

    def rand(*shape, std=0.2):
        return torch.randn(*shape, generator=g) * std

    p = "layers.0." if layout == "vllm" else "midlayer."
    draft_ids = torch.randperm(vocab, generator=g)[:dv].sort().values  # the draft vocabulary, by id
    t = {
        "fc.weight": rand(h, width, std=0.1),
        p + "self_attn.q_proj.weight": rand(heads * d, 2 * h),
        p + "self_attn.k_proj.weight": rand(kv * d, 2 * h),
        p + "self_attn.v_proj.weight": rand(kv * d, 2 * h),
        p + "self_attn.o_proj.weight": rand(h, heads * d),
        p + "mlp.gate_proj.weight": rand(inter, h),
        p + "mlp.up_proj.weight": rand(inter, h),
        p + "mlp.down_proj.weight": rand(h, inter),
        p + "hidden_norm.weight": 1 + rand(h, std=0.1),
        p + "input_layernorm.weight": 1 + rand(h, std=0.1),
        p + "post_attention_layernorm.weight": 1 + rand(h, std=0.1),
        "norm.weight": 1 + rand(h, std=0.1),
        "lm_head.weight": rand(dv, h, std=1.0),
        "d2t": draft_ids - torch.arange(dv),
        "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill(0, draft_ids, True),
    }
    if layout == "sglang":  # SpecForge stores the (frozen) target embedding
        t["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().clone()
    return t


def write_eagle3_checkpoint(folder: Path, target, layout: str, layer_ids=None, seed: int = 0, **overrides):
    """Write `layout`'s config.json and weights (fp16 floats, as published; an embedding as the target's own, as
    SpecForge stores the frozen one); returns `(tensors in float32, config)`. `layer_ids`: the layout's own ids
    (ignored by `authors`, whose heads name none)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = eagle3_config(target, layout, layer_ids, **overrides)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    k = 3 if layout == "authors" or layer_ids is None else len(set(layer_ids))
    tensors = eagle3_tensors(target, layout, k * target.config.hidden_size, seed)
    half = {
        n: (v.half() if v.is_floating_point() and n != "embed_tokens.weight" else v).contiguous()
        for n, v in tensors.items()
    }
    if layout == "authors":
        torch.save(half, folder / "pytorch_model.bin")
    else:
        save_file(half, str(folder / "model.safetensors"))
    return {n: (v.float() if v.is_floating_point() else v) for n, v in half.items()}, config


# ---- an independent forward of the EAGLE-3 head --------------------------------------------------------------
def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """x: [heads, T, d] rotated by positions pos [T] (rotate-half convention)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.double()[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos().float(), torch.cat([ang, ang], -1).sin().float()
    rot = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + rot * sin


def reference_states(t: dict, embed: torch.Tensor, g: torch.Tensor, ids, pos, norm_before_residual=False):
    """EAGLE-3 head states `(T, H)` for pairs (state `g[i]`, token `ids[i]`) at rotary positions `pos[i]`, each
    seeing the pairs before it. `g`: the head's input per pair, `(T, H)` (already fused by fc where it comes from
    the target): residual g (or hidden_norm(g)), attention over cat(input_layernorm(E(x)), hidden_norm(g))."""
    p = "layers.0." if "layers.0.hidden_norm.weight" in t else "midlayer."
    h, heads, kv = LAYER["hidden_size"], LAYER["num_attention_heads"], LAYER["num_key_value_heads"]
    d, n = h // heads, len(ids)
    g_n = _rms(g, t[p + "hidden_norm.weight"])
    x = torch.cat([_rms(embed[ids], t[p + "input_layernorm.weight"]), g_n], -1)  # [T, 2H]

    def proj(name, rows):
        return (x @ t[p + f"self_attn.{name}_proj.weight"].T).view(n, rows, d).transpose(0, 1)

    q = _rope(proj("q", heads), pos)
    k = _rope(proj("k", kv), pos).repeat_interleave(heads // kv, 0)
    v = proj("v", kv).repeat_interleave(heads // kv, 0)
    scores = q @ k.transpose(1, 2) / d**0.5 + torch.full((n, n), float("-inf")).triu(1)
    att = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, h)
    y = (g_n if norm_before_residual else g) + att @ t[p + "self_attn.o_proj.weight"].T
    m = _rms(y, t[p + "post_attention_layernorm.weight"])
    act = torch.nn.functional.silu(m @ t[p + "mlp.gate_proj.weight"].T) * (m @ t[p + "mlp.up_proj.weight"].T)
    return y + act @ t[p + "mlp.down_proj.weight"].T


def reference_logits(t: dict, states: torch.Tensor) -> torch.Tensor:
    """Head states `(T, H)` -> draft-vocabulary logits `(T, draft vocabulary)`."""
    return _rms(states, t["norm.weight"]) @ t["lm_head.weight"].T


def target_ids(t: dict, draft: list[int]) -> list[int]:
    """Draft ids -> target ids (d2t offsets)."""
    return [i + int(t["d2t"][i]) for i in draft]
