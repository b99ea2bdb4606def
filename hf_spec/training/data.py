"""One call for trainers: the target, its tokenizer and its answers to the training prompts (cached)."""

from __future__ import annotations

import os

import torch

from hf_spec.training.prompts import load_train_prompts
from hf_spec.training.responses import Conversation, ResponseCache, default_data_dir, generate_responses

# the prompt files of runs made before `--prompts` was required: model cards of heads trained then name them
EARLIER_DEFAULT_PROMPT_FILES = ("sharegpt_1000.json", "alpaca_seed_tasks.jsonl")


def load_conversations(
    target: str,
    prompt_files: list[str] | None = None,
    seed_cache: str | os.PathLike | None = None,
    data_dir: str | os.PathLike | None = None,
    limit: int | None = None,
    max_new_tokens: int = 256,
    batch_size: int = 8,
    model=None,
    tokenizer=None,
    generate: bool = True,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    load: dict | None = None,
    continue_cut: bool = False,
    samples: int = 0,
    temperature: float = 0.7,
) -> tuple[object, object, list[Conversation]]:
    """`(model, tokenizer, conversations)`: answers missing from the cache are generated first, by the target in
    `dtype` (tagged `generated-bfloat16` etc. when not float32); `continue_cut`: cached answers cut by a smaller
    budget than `max_new_tokens` are continued to it; `samples`: sampled answers per prompt besides the greedy
    one (at `temperature`); `load`: `load_model`'s quantization and placement keywords. `prompt_files`
    (ShareGPT `.json` or Alpaca-style `.jsonl`) are required; `data_dir` defaults to
    `$HF_SPEC_CACHE/data/<target name>`."""
    from hf_spec.models.fetch import dtype_name, load_model

    if not prompt_files:
        raise ValueError(
            "no training prompt files: pass --prompts (ShareGPT .json or Alpaca-style .jsonl; never evaluation prompts)"
        )

    if model is None:
        model, tokenizer = load_model(target, dtype=dtype, device=device, **(load or {}))
    prompts = [p for path in prompt_files for p in load_train_prompts(path, limit)]
    cache = ResponseCache(data_dir or default_data_dir(target))
    cache.bind_target(model)
    convs = generate_responses(
        model,
        tokenizer,
        prompts,
        cache,
        batch_size=batch_size,
        max_new_tokens=max_new_tokens,
        seed_file=seed_cache,
        generate=generate,
        source="generated" if dtype == torch.float32 else f"generated-{dtype_name(dtype)}",
        continue_cut=continue_cut,
        samples=samples,
        temperature=temperature,
    )
    return model, tokenizer, convs
