"""Write the target's cached answers to a prompt file as a text JSONL a datastore recipe reads (`responses`) and
`hf-spec data responses --seed-cache` imports: one `{"id", "prompt", "response", "response_tokens"}` a line, in
the prompt file's order. `prompt` is the chat-templated prompt, `response` the answer without its EOS,
`response_tokens` its length in tokens (the `--max-new-tokens` budget when the answer was cut there).

    hf-spec data responses --target qwen2.5-coder-0.5b-instruct --prompts benchmarks/datastore/prompts.jsonl \\
        --max-new-tokens 256 --batch-size 8 --threads 2 --dtype float32 --data-dir ANSWERS
    python benchmarks/datastore/export_answers.py --target qwen2.5-coder-0.5b-instruct \\
        --prompts benchmarks/datastore/prompts.jsonl --data-dir ANSWERS \\
        --out benchmarks/datastore/answers-qwen2.5-coder-0.5b-instruct.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the checkout's hf_spec

from hf_spec.training.prompts import load_train_prompts  # noqa: E402
from hf_spec.training.responses import ResponseCache, chat_prompt_text  # noqa: E402


def answer_rows(prompts, conversations: dict, tokenizer, eos_ids: set[int]) -> list[dict]:
    """One text row per prompt that has a greedy answer; the prompt text must tokenize to the ids it was answered
    from (so the answer belongs to this prompt and chat template)."""
    rows = []
    for prompt in prompts:
        conv = conversations.get(prompt.id)
        if conv is None:
            continue
        text = chat_prompt_text(tokenizer, prompt)
        if tokenizer(text, add_special_tokens=False).input_ids != conv.prompt_ids:
            raise ValueError(f"{prompt.id}: the cached answer was given to another prompt text")
        ended = bool(conv.response_ids) and conv.response_ids[-1] in eos_ids
        answer = conv.response_ids[:-1] if ended else conv.response_ids
        rows.append(
            {
                "id": prompt.id,
                "prompt": text,
                "response": tokenizer.decode(answer),
                "response_tokens": len(answer),
            }
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="the model that answered (its tokenizer)")
    parser.add_argument("--prompts", required=True, help="the prompt file the answers were generated for")
    parser.add_argument("--data-dir", required=True, help="the answer cache `hf-spec data responses` wrote")
    parser.add_argument("--out", required=True, help="the JSONL to write")
    args = parser.parse_args()

    from transformers import AutoTokenizer, GenerationConfig

    from hf_spec.models.fetch import resolve_model

    folder = resolve_model(args.target)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    eos = GenerationConfig.from_pretrained(folder).eos_token_id  # what ended the answers
    eos_ids = set(eos) if isinstance(eos, list) else {eos}
    prompts = load_train_prompts(args.prompts)
    rows = answer_rows(prompts, ResponseCache(args.data_dir).load(), tokenizer, eos_ids)
    Path(args.out).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    tokens = sum(r["response_tokens"] for r in rows)
    print(f"wrote {args.out}: {len(rows)} of {len(prompts)} prompts answered, {tokens} response tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
