"""Exit-head training features: one target forward per sequence gives the hidden states after each exit layer at
the response positions and the teacher's (last layer's) top-K next-token distribution; saved in chunks under a
work folder, so a rerun extracts only what is missing."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import PreTrainedModel

from hf_spec.io.integrity import save_tensors

Progress = Callable[..., object] | None  # tqdm-like factory: progress(total=..., desc=...)


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
        save_tensors(tensors, str(path))

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
