"""Benchmark prompts: Spec-Bench-style question files, their category groups, and chat encoding."""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass

import torch

from hf_spec.io.jsonl import read_jsonl

# Spec-Bench's six groups: the eight MT-bench categories count as one
MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


def spec_bench_group(category: str) -> str:
    return "mt_bench" if category in MT_BENCH else category


@dataclass
class Prompt:
    question_id: str
    category: str
    turns: list[str]


def load_prompts(
    path: str | os.PathLike, limit: int | None = None, per_category: int | None = None
) -> list[Prompt]:
    """Spec-Bench questions; `per_category` keeps the first K of each category (file order), then `limit`."""
    prompts = []
    for line_no, row in read_jsonl(path):  # names the file of a non-UTF-8 or non-JSON line
        try:
            if not isinstance(row, dict):
                raise TypeError(f"a question is a JSON object, got {type(row).__name__}")
            turns = row["turns"]
            if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
                raise TypeError(f"turns must be a non-empty list of strings, got {turns!r:.60}")
            category = row.get("category", "all")
            if not isinstance(category, str):
                raise TypeError(f"category must be a string, got {category!r:.60}")
            prompts.append(Prompt(str(row["question_id"]), category, turns))
        except (KeyError, TypeError) as err:
            raise ValueError(f"{path}:{line_no}: not a Spec-Bench question ({err})") from None
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    if per_category:
        seen: dict[str, int] = defaultdict(int)
        kept = []
        for p in prompts:
            seen[p.category] += 1
            if seen[p.category] <= per_category:
                kept.append(p)
        prompts = kept
    return prompts[:limit] if limit else prompts


def encode_chat(tokenizer, messages: list[dict]) -> torch.Tensor:
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    return tokenizer("\n".join(m["content"] for m in messages), return_tensors="pt").input_ids
