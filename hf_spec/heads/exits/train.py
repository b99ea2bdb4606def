"""Training exit heads by distillation from the target's last layer.

data     : training prompts with the target's own responses (never eval prompts)
features : one target forward per sequence -> the hidden states after each exit layer at the response
           positions, and the teacher's top-K next-token distribution (full LM head, last layer)
loss     : soft cross-entropy of the exit's distribution against the teacher's top-K, both over a shared
           candidate set per batch (the batch's teacher top-K tokens + random negatives), so the 150k-row LM
           head of Qwen is never run in full while training
measure  : on held-out training sequences, how often each exit's argmax over the FULL vocabulary equals the
           last layer's argmax, before (stock logit lens) and after training
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from hf_spec.heads.exits.model import ExitHeads
from hf_spec.models.layers import decoder_parts
from hf_spec.training.trainer import check_resumable

Progress = Callable[..., object] | None  # tqdm-like factory: progress(total=..., desc=...)


def load_training_rows(path: str | os.PathLike) -> list[dict]:
    """Rows `{"prompt": chat-templated text, "response": the target's own greedy response}` of a response cache
    (`responses/<target>.jsonl` under the training data folder)."""
    rows = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row.get("prompt"), str) or not isinstance(row.get("response"), str):
                raise ValueError(
                    f"{path}:{line_no}: a response-cache row needs string 'prompt' and 'response'"
                )
            rows.append(row)
    if not rows:
        raise ValueError(f"{path} holds no training rows")
    return rows


def tokenize_rows(tokenizer, rows: list[dict], max_len: int) -> list[tuple[torch.Tensor, int]]:
    """`(ids, start)` per row: prompt + response token ids `(seq_len,)` cut at `max_len`; positions `start..`
    predict response tokens."""
    out = []
    for row in rows:
        prompt = tokenizer(row["prompt"], add_special_tokens=False).input_ids
        response = tokenizer(row["response"], add_special_tokens=False).input_ids
        ids = (prompt + response)[:max_len]
        if response and len(prompt) < len(ids):
            out.append((torch.tensor(ids, dtype=torch.long), len(prompt) - 1))
    return out


def vocabulary_texts(path: str | os.PathLike) -> list[str]:
    """Every text of a training file, for token frequencies: ShareGPT `.json` (all turns) or Alpaca-style
    `.jsonl` (instruction, inputs, outputs)."""
    path = Path(path)
    if path.suffix == ".json":
        return [t["value"] for row in json.loads(path.read_text()) for t in row.get("conversations", [])]
    texts = []
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            texts.append(row.get("instruction", ""))
            texts += [
                v
                for inst in row.get("instances", [])
                for v in (inst.get("input", ""), inst.get("output", ""))
            ]
    return [t for t in texts if t]


def frequent_tokens(token_lists: list[list[int]], size: int, always: list[int] = ()) -> torch.Tensor:
    """Sorted ids of the `size` most frequent tokens of `token_lists`, plus `always` (e.g. special tokens)."""
    counts: Counter = Counter()
    for ids in token_lists:
        counts.update(ids)
    keep = {t for t, _ in counts.most_common(size)} | set(always)
    return torch.tensor(sorted(keep), dtype=torch.long)


@dataclass
class Features:
    """Training positions. `hidden[k]`: `(num_positions, hidden_size)` bf16 after `k` layers; `top_ids` /
    `top_probs`: `(num_positions, top_k)` the teacher's top-K next tokens and their probabilities."""

    hidden: dict[int, torch.Tensor]
    top_ids: torch.Tensor  # [N, K] int64
    top_probs: torch.Tensor  # [N, K] float32

    def __len__(self) -> int:
        return int(self.top_ids.shape[0])

    def save(self, path: Path) -> None:
        tensors = {f"hidden.{k}": v.contiguous() for k, v in self.hidden.items()}
        tensors |= {
            "top_ids": self.top_ids.int().contiguous(),
            "top_probs": self.top_probs.half().contiguous(),
        }
        save_file(tensors, str(path))

    @classmethod
    def load(cls, path: Path) -> Features:
        t = load_file(str(path))
        hidden = {int(k.split(".")[1]): v for k, v in t.items() if k.startswith("hidden.")}
        return cls(hidden, t["top_ids"].long(), t["top_probs"].float())

    @classmethod
    def cat(cls, parts: list[Features]) -> Features:
        return cls(
            {k: torch.cat([p.hidden[k] for p in parts]) for k in parts[0].hidden},
            torch.cat([p.top_ids for p in parts]),
            torch.cat([p.top_probs for p in parts]),
        )


@torch.no_grad()
def extract_features(
    model: PreTrainedModel, sequences: list[tuple[torch.Tensor, int]], layers: list[int], top_k: int = 32
) -> Features:
    """One target forward per sequence: exit-layer hidden states and the teacher's top-K at response positions."""
    hidden: dict[int, list[torch.Tensor]] = {k: [] for k in layers}
    top_ids, top_probs = [], []
    lm_head = model.get_output_embeddings()
    for ids, start in sequences:
        out = model.model(input_ids=ids[None].to(model.device), output_hidden_states=True)
        pos = torch.arange(start, ids.shape[0] - 1, device=model.device)  # predict ids[start + 1:]
        for k in layers:
            hidden[k].append(out.hidden_states[k][0, pos].to("cpu", torch.bfloat16))
        probs = torch.softmax(lm_head(out.last_hidden_state[0, pos]).float(), dim=-1)  # [n, vocab]
        top = torch.topk(probs, top_k, dim=-1)
        top_ids.append(top.indices.cpu())
        top_probs.append(top.values.cpu())
    return Features({k: torch.cat(v) for k, v in hidden.items()}, torch.cat(top_ids), torch.cat(top_probs))


def candidate_set(
    top_ids: torch.Tensor, vocab_size: int, negatives: int, generator: torch.Generator
) -> torch.Tensor:
    """Sorted unique token ids: the batch's teacher top-K plus `negatives` uniform random tokens."""
    extra = torch.randint(0, vocab_size, (negatives,), generator=generator)
    return torch.unique(torch.cat([top_ids.flatten(), extra]))


def distill_loss(
    model: PreTrainedModel,
    heads: ExitHeads | None,
    layer: int,
    hidden: torch.Tensor,
    top_ids: torch.Tensor,
    top_probs: torch.Tensor,
    candidates: torch.Tensor,
) -> torch.Tensor:
    """Soft cross-entropy `-sum_t p(t) log q(t)` over `candidates`, averaged over positions.

    Args:
        hidden: `(batch, hidden_size)` after `layer` layers.
        top_ids / top_probs: `(batch, K)` teacher top-K; p is their probabilities renormalised to sum to 1.
        candidates: `(C,)` sorted unique ids containing every `top_ids`; q is the exit's softmax over them.
        heads: `None` scores the stock exit (final norm + LM head on the raw hidden state).
    """
    parts = decoder_parts(model)
    device = parts.lm_head.weight.device  # features live on the CPU, the target (and heads) maybe not
    hidden, top_ids, top_probs, candidates = (t.to(device) for t in (hidden, top_ids, top_probs, candidates))
    h = heads(layer, hidden) if heads is not None else hidden
    weight = parts.lm_head.weight[candidates]  # [C, hidden_size]
    logits = parts.norm(h) @ weight.T  # [batch, C]
    if getattr(parts.lm_head, "bias", None) is not None:
        logits = logits + parts.lm_head.bias[candidates]
    logq = torch.log_softmax(logits.float(), dim=-1)
    p = top_probs / top_probs.sum(-1, keepdim=True)
    cols = torch.searchsorted(candidates, top_ids)  # [batch, K]
    return -(p * logq.gather(1, cols)).sum(-1).mean()


def _lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    return 0.5 * lr * (1 + math.cos(math.pi * (step - warmup) / max(steps - warmup, 1)))


def train_heads(
    model: PreTrainedModel,
    heads: ExitHeads,
    features: Features,
    steps: int = 600,
    batch_size: int = 256,
    lr: float = 2e-3,
    seed: int = 0,
    negatives: int = 1024,
    checkpoint: str | os.PathLike | None = None,
    save_every: int = 100,
    progress: Progress = None,
) -> list[float]:
    """Adam on every head at once (one shared batch and candidate set per step); returns the mean loss over heads
    per step. Resumes from `checkpoint` when it exists and saves it every `save_every` steps; batches depend only
    on `(seed, step)`, so a resumed run draws the same batches as an uninterrupted one."""
    model.requires_grad_(False)
    heads.to(decoder_parts(model).lm_head.weight.device).train()
    params = [p for p in heads.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    history: list[float] = []
    start = 0
    ckpt = Path(checkpoint) if checkpoint else None
    c = heads.config
    settings = {
        "training": dict(
            layers=c.layers,
            rank=c.rank,
            steps=steps,
            batch_size=batch_size,
            lr=lr,
            seed=seed,
            negatives=negatives,
            positions=len(features),
        )
    }
    if ckpt is not None and ckpt.is_file():
        state = torch.load(ckpt, weights_only=False, map_location="cpu")
        check_resumable(state.get("settings"), settings, ckpt.parent)
        heads.load_state_dict(state["heads"])
        opt.load_state_dict(state["optim"])
        start, history = state["step"], state["history"]
    vocab = decoder_parts(model).lm_head.weight.shape[0]
    n = len(features)
    bar = progress(total=steps, initial=start, desc="exit heads", unit="step") if progress else None
    for step in range(start, steps):
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        idx = torch.randint(0, n, (min(batch_size, n),), generator=g)
        cand = candidate_set(features.top_ids[idx], vocab, negatives, g)
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, steps, lr, warmup=min(20, steps // 10 + 1))
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for k in heads.config.layers:
            loss = distill_loss(
                model,
                heads,
                k,
                features.hidden[k][idx].float(),
                features.top_ids[idx],
                features.top_probs[idx],
                cand,
            )
            loss.backward()
            total += loss.item()
        opt.step()
        history.append(total / len(heads.config.layers))
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{history[-1]:.3f}")
        if ckpt is not None and ((step + 1) % save_every == 0 or step + 1 == steps):
            tmp = ckpt.with_suffix(".tmp")
            torch.save(
                {
                    "step": step + 1,
                    "heads": heads.state_dict(),
                    "optim": opt.state_dict(),
                    "history": history,
                    "settings": settings,
                },
                tmp,
            )
            os.replace(tmp, ckpt)
    if bar is not None:
        bar.close()
    heads.eval()
    return history


@torch.no_grad()
def evaluate_heads(
    model: PreTrainedModel,
    heads: ExitHeads,
    features: Features,
    chunk: int = 256,
    seed: int = 0,
    max_positions: int = 2048,
) -> dict[int, dict[str, float]]:
    """Per exit layer on `features`: `agreement` (exit argmax over the full vocabulary == teacher argmax) and
    `loss` (the training loss with 1024 negatives), for the trained heads and the stock logit lens, over the first
    `max_positions` positions (each costs a full LM-head row per layer and variant)."""
    parts = decoder_parts(model)
    n_pos = min(len(features), max_positions)
    vocab = parts.lm_head.weight.shape[0]
    result: dict[int, dict[str, float]] = {}
    for k in heads.config.layers:
        hits = {"trained": 0, "stock": 0}
        losses = {"trained": 0.0, "stock": 0.0}
        for s in range(0, n_pos, chunk):
            e = min(s + chunk, n_pos)
            h = features.hidden[k][s:e].to(parts.lm_head.weight.device, torch.float32)
            teacher = features.top_ids[s:e, 0].to(h.device)
            g = torch.Generator().manual_seed(seed + s)
            cand = candidate_set(features.top_ids[s:e], vocab, 1024, g)
            for name, hd in (("trained", heads), ("stock", None)):
                hh = hd(k, h) if hd is not None else h
                hits[name] += int((parts.lm_head(parts.norm(hh)).argmax(-1) == teacher).sum())
                loss = distill_loss(model, hd, k, h, features.top_ids[s:e], features.top_probs[s:e], cand)
                losses[name] += float(loss) * h.shape[0]
        n = max(n_pos, 1)
        result[k] = {
            "agreement": hits["trained"] / n,
            "stock_agreement": hits["stock"] / n,
            "loss": losses["trained"] / n,
            "stock_loss": losses["stock"] / n,
        }
    return result


def _digest(sequences: list[tuple[torch.Tensor, int]]) -> str:
    """A short hash of a chunk's token ids and prompt lengths: another data file never reuses its features."""
    h = hashlib.sha1()
    for ids, prompt_len in sequences:
        h.update(ids.to(torch.int64).numpy().tobytes() + prompt_len.to_bytes(8, "little", signed=True))
    return h.hexdigest()[:12]


def extract_cached(
    model: PreTrainedModel,
    sequences: list[tuple[torch.Tensor, int]],
    layers: list[int],
    top_k: int,
    work_dir: Path,
    name: str,
    chunk: int = 32,
    progress: Progress = None,
) -> Features:
    """`extract_features` in chunks of `chunk` sequences, each saved under `work_dir` and reused on a rerun."""
    work_dir.mkdir(parents=True, exist_ok=True)
    parts = []
    bar = progress(total=len(sequences), desc=f"features ({name})", unit="seq") if progress else None
    for i in range(0, len(sequences), chunk):
        part_sequences = sequences[i : i + chunk]
        file = work_dir / f"{name}-{i // chunk:04d}-{_digest(part_sequences)}.safetensors"
        if file.is_file():
            part = Features.load(file)
        else:
            part = extract_features(model, part_sequences, layers, top_k)
            tmp = file.with_suffix(".tmp")
            part.save(tmp)
            os.replace(tmp, file)
        if set(part.hidden) != set(layers) or part.top_ids.shape[1] != top_k:
            raise ValueError(
                f"{file} was extracted for other layers/top-k: delete {work_dir} or pick a new work dir"
            )
        parts.append(part)
        if bar is not None:
            bar.update(min(chunk, len(sequences) - i))
    if bar is not None:
        bar.close()
    return Features.cat(parts)


def model_card(heads: ExitHeads, command: str) -> str:
    """README.md of a saved exit-heads folder."""
    c = heads.config
    t = c.training
    lines = [
        "---",
        f"base_model: {c.target_name}",
        "library_name: hf-spec",
        "tags: [speculative-decoding, early-exit, hispec, exit-heads]",
        "---",
        f"# Exit heads for {c.target_name}",
        "",
        "Light exit heads (tuned-lens style: `h * (1 + s) + rms(h) * (U V rmsnorm(h) + b)`, rank "
        f"{c.rank}) for layers {c.layers} of `{c.target_name}` ({c.target.get('num_hidden_layers')} layers). "
        "Each feeds the target's own frozen final norm and LM head, so the heads are tiny and only make sense "
        "with this target (the fingerprint in `config.json` is checked on load). Used by the `early-exit` and "
        "`hispec` methods of hf-spec (`exit_heads` in their configs).",
        "",
        "## Training",
        "",
        f"- Data: {t.get('data')} ({t.get('train_sequences')} training sequences, {t.get('train_positions')} "
        f"response positions; {t.get('heldout_sequences')} held-out sequences, {t.get('heldout_positions')} "
        "positions): training prompts with the target's own greedy responses; no evaluation prompts.",
        f"- Objective: soft cross-entropy against the last layer's top-{t.get('top_k')} distribution over the "
        f"batch's candidate tokens + {t.get('negatives')} random negatives.",
        f"- {t.get('steps')} steps, batch {t.get('batch_size')} positions, AdamW lr {t.get('lr')} (cosine), seed "
        f"{t.get('seed')}; train loss {t.get('first_loss', float('nan')):.3f} -> {t.get('last_loss', float('nan')):.3f}; "
        f"{t.get('train_seconds', 0):.0f} s training + {t.get('extract_seconds', 0):.0f} s feature extraction "
        f"({t.get('threads')} thread(s), {t.get('machine', '')}).",
        "",
        "## Measured on held-out training sequences",
        "",
        f"Draft vocabulary: the {c.draft_vocab_size} most frequent tokens of the training rows (`draft_vocab` in the "
        f"methods' configs); it holds the last layer's argmax at {t['draft_vocab_coverage']:.1%} of the held-out "
        "positions."
        if c.draft_vocab_size and t.get("draft_vocab_coverage") is not None
        else "No draft vocabulary.",
        "",
        "Agreement = the exit's argmax over the full vocabulary equals the last layer's argmax (what a greedy "
        "draft needs).",
        "",
        "| exit layer | agreement (stock) | agreement (trained) | loss (stock) | loss (trained) |",
        "|---|---|---|---|---|",
    ]
    for k, m in sorted(t.get("heldout", {}).items(), key=lambda kv: int(kv[0])):
        lines.append(
            f"| {k} | {m['stock_agreement']:.3f} | {m['agreement']:.3f} | {m['stock_loss']:.3f} | {m['loss']:.3f} |"
        )
    lines += ["", "## Command", "", "```", command, "```", ""]
    return "\n".join(lines)


def timed(fn, *args, **kwargs):
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0
