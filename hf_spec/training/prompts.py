"""Training prompts from ShareGPT-style (`conversations`) or Alpaca/self-instruct-style (`instruction`) files.

Evaluation sets are refused: nothing that is benchmarked may be trained on.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from hf_spec.io.jsonl import jsonl_values, read_json

# names of the benchmark prompt sets (and any file under an `eval` folder); training on them is refused
EVAL_SET_NAMES = ("spec_bench", "humaneval", "gsm8k", "alpaca_80", "mt_bench")


@dataclass(frozen=True)
class TrainPrompt:
    id: str
    messages: tuple[tuple[str, str], ...]  # (role, content) pairs, ending with a user turn

    def as_chat(self) -> list[dict[str, str]]:
        return [{"role": role, "content": content} for role, content in self.messages]


def check_not_eval(path: str | os.PathLike) -> None:
    path = Path(path)
    if "eval" in path.parts or any(name in path.name for name in EVAL_SET_NAMES):
        raise ValueError(
            f"{path} looks like an evaluation prompt set; heads and statistics must not train on it"
        )


def load_train_prompts(path: str | os.PathLike, limit: int | None = None) -> list[TrainPrompt]:
    """The first user turn of every conversation in `path` (`.json` list or `.jsonl`)."""
    check_not_eval(path)
    path = Path(path)
    rows = read_json(path) if path.suffix == ".json" else jsonl_values(path)  # errors name the file and line
    prompts = []
    for i, row in enumerate(rows):
        prompt = _prompt_from_row(row, f"{path.stem}_{i}")
        if prompt is None:
            raise ValueError(
                f"{path}: row {i} is neither ShareGPT (`conversations`) nor Alpaca (`instruction`)"
            )
        if prompt.messages[-1][1].strip():
            prompts.append(prompt)
    return prompts[:limit] if limit else prompts


def _prompt_from_row(row: dict, fallback_id: str) -> TrainPrompt | None:
    if "conversations" in row:  # ShareGPT: first human turn
        turns = [t for t in row["conversations"] if t.get("from") in ("human", "user")]
        if not turns:
            return TrainPrompt(str(row.get("id", fallback_id)), (("user", ""),))
        return TrainPrompt(str(row.get("id", fallback_id)), (("user", turns[0]["value"]),))
    if "instruction" in row:  # Alpaca / self-instruct seed tasks
        extra = row.get("input") or next((inst.get("input", "") for inst in row.get("instances", [])), "")
        content = row["instruction"] + (f"\n\n{extra}" if extra else "")
        return TrainPrompt(str(row.get("id", fallback_id)), (("user", content),))
    return None
