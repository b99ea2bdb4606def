"""Training data of exit heads: response-cache rows (training prompts with the target's own answers), their
tokenization, and the token frequencies that pick a draft vocabulary."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import torch

from hf_spec.io.jsonl import jsonl_values, read_json, read_jsonl


def load_training_rows(path: str | os.PathLike) -> list[dict]:
    """Rows `{"prompt": chat-templated text, "response": the target's own greedy response}` of a response cache
    (`responses/<target>.jsonl` under the training data folder)."""
    rows = []
    for line_no, row in read_jsonl(path):
        text = row if isinstance(row, dict) else {}
        if not isinstance(text.get("prompt"), str) or not isinstance(text.get("response"), str):
            raise ValueError(f"{path}:{line_no}: a response-cache row needs string 'prompt' and 'response'")
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
        return [t["value"] for row in read_json(path) for t in row.get("conversations", [])]
    texts = []
    for row in jsonl_values(path):
        texts.append(row.get("instruction", ""))
        texts += [
            v for inst in row.get("instances", []) for v in (inst.get("input", ""), inst.get("output", ""))
        ]
    return [t for t in texts if t]


def frequent_tokens(token_lists: list[list[int]], size: int, always: list[int] = ()) -> torch.Tensor:
    """Sorted ids of the `size` most frequent tokens of `token_lists`, plus `always` (e.g. special tokens)."""
    counts: Counter = Counter()
    for ids in token_lists:
        counts.update(ids)
    keep = {t for t, _ in counts.most_common(size)} | set(always)
    return torch.tensor(sorted(keep), dtype=torch.long)
