"""The target's own answers to training prompts: generated in batches, cached line by line (resumable),
optionally seeded from an earlier run's JSONL of answers by the same target (`--seed-cache`).

Every prompt gets its greedy answer (id = the prompt's id) and, on request, sampled ones (id `<prompt id>#sample<k>`):
more data from the same prompts, drawn from the target's own distribution."""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from hf_spec.models.fetch import cache_root
from hf_spec.training.prompts import TrainPrompt


@dataclass
class Conversation:
    """One prompt and the target's answer, as token ids. `response_ids` ends with EOS when the answer finished
    within the token budget."""

    id: str
    prompt_ids: list[int]
    response_ids: list[int]
    source: str = "generated"  # or "seed"

    @property
    def input_ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids


SAMPLE_MARK = "#sample"


def sampled_id(prompt_id: str, k: int) -> str:
    """Conversation id of the k-th (1-based) sampled answer to a prompt."""
    return f"{prompt_id}{SAMPLE_MARK}{k}"


def prompt_id_of(conversation_id: str) -> str:
    """The prompt a conversation answers (its greedy and sampled answers share it)."""
    return conversation_id.split(SAMPLE_MARK)[0]


def default_data_dir(target: str) -> Path:
    return cache_root() / "data" / Path(target).name


class ResponseCache:
    """`responses.jsonl` in `folder`: one `Conversation` per line, appended batch by batch. A torn last line
    (interrupted write) is ignored on load and overwritten by the next append."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        self.path = self.folder / "responses.jsonl"

    def bind_target(self, model) -> None:
        """Record the fingerprint of the target writing this cache, or check it is the one recorded: the answers
        must be that target's own (a cache named after another model folder of the same name is refused)."""
        from hf_spec.models.fingerprint import check_fingerprint, target_fingerprint

        record = self.folder / "target.json"
        if record.exists():
            try:
                check_fingerprint(json.loads(record.read_text()), model, "answers")
            except ValueError:
                raise ValueError(
                    f"the answer cache at {self.folder} holds another target's answers (see {record.name}): "
                    "give another --data-dir"
                ) from None
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps(target_fingerprint(model)) + "\n")

    def load(self) -> dict[str, Conversation]:
        rows: dict[str, Conversation] = {}
        if not self.path.exists():
            return rows
        lines = self.path.read_text().splitlines()
        for i, line in enumerate(lines):
            try:
                conv = Conversation(**json.loads(line))
            except (json.JSONDecodeError, TypeError) as err:
                if i == len(lines) - 1:  # torn final line from an interrupted run
                    self._truncate_to(len(lines) - 1)
                    break
                raise ValueError(f"{self.path}:{i + 1}: corrupt response cache line ({err})") from None
            rows[conv.id] = conv
        return rows

    def append(self, conversations: Iterable[Conversation]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            for conv in conversations:
                f.write(json.dumps(asdict(conv)) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def _truncate_to(self, num_lines: int) -> None:
        kept = self.path.read_text().splitlines()[:num_lines]
        self.path.write_text("".join(line + "\n" for line in kept))


def chat_prompt_text(tokenizer, prompt: TrainPrompt) -> str:
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(prompt.as_chat(), tokenize=False, add_generation_prompt=True)
    return "\n".join(content for _, content in prompt.messages)


def import_seed(
    seed_file: str | os.PathLike,
    tokenizer,
    prompts: list[TrainPrompt],
    eos_token_id: int,
    max_new_tokens: int,
) -> list[Conversation]:
    """Conversations from a seed JSONL (`id`, `prompt` text, `response` text, `response_tokens`) whose prompt
    text is exactly what this tokenizer's chat template makes of the same prompt id; others are left to generate."""
    by_id = {p.id: p for p in prompts}
    rows = [json.loads(line) for line in Path(seed_file).read_text().splitlines()]
    # the seed's own budget is not recorded: an answer as long as the longest one was cut there, not finished
    seed_budget = max((int(r.get("response_tokens", 0)) for r in rows), default=0)
    imported = []
    for row in rows:
        prompt = by_id.get(str(row.get("id")))
        if prompt is None or chat_prompt_text(tokenizer, prompt) != row.get("prompt"):
            continue
        response = tokenizer(row["response"], add_special_tokens=False).input_ids
        if int(row.get("response_tokens", len(response))) < min(seed_budget, max_new_tokens):
            response = response + [eos_token_id]  # it finished: the answer ends in EOS
        prompt_ids = tokenizer(row["prompt"], add_special_tokens=False).input_ids
        imported.append(Conversation(prompt.id, prompt_ids, response, source="seed"))
    return imported


@torch.no_grad()
def generate_responses(
    model,
    tokenizer,
    prompts: list[TrainPrompt],
    cache: ResponseCache,
    *,
    batch_size: int = 8,
    max_new_tokens: int = 256,
    max_prompt_tokens: int = 768,
    seed_file: str | os.PathLike | None = None,
    progress: bool = True,
    generate: bool = True,
    source: str = "generated",
    continue_cut: bool = False,
    samples: int = 0,
    temperature: float = 0.7,
) -> list[Conversation]:
    """Answer every prompt not in `cache` yet (greedy, batched, left-padded; shortest prompts first), appending each
    finished batch to the cache (the newest line of a conversation wins). `samples`: also `samples` answers per
    prompt sampled at `temperature` (tagged `<source>-t<temperature>`). `continue_cut`: also continue every
    cached answer shorter than `max_new_tokens` that has no EOS (cut by an earlier, smaller budget). Returns the
    greedy conversations of `prompts` in order, then the sampled ones (overlong prompts skipped).
    `generate=False`: only what the cache (and seed) already hold; `source` tags the new answers (a continued
    one: `<old source>+<source>`)."""
    if samples < 0 or (samples and temperature <= 0):
        raise ValueError(f"samples must be >= 0 and temperature > 0 (got {samples}, {temperature})")
    eos = model.generation_config.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    if not eos_ids:
        raise ValueError("the target's generation_config has no eos_token_id; cannot tell finished answers")
    done = cache.load()
    if seed_file is not None:
        seeds = [
            c
            for c in import_seed(seed_file, tokenizer, prompts, eos_ids[0], max_new_tokens)
            if c.id not in done
        ]
        cache.append(seeds)
        done.update({c.id: c for c in seeds})

    encoded = {
        p.id: tokenizer(chat_prompt_text(tokenizer, p), add_special_tokens=False).input_ids for p in prompts
    }
    wanted = [(p.id, p.id, source) for p in prompts] + [
        (sampled_id(p.id, k), p.id, f"{source}-t{temperature:g}")
        for p in prompts
        for k in range(1, samples + 1)
    ]
    todo: list[Conversation] = []  # answers to write: empty (new prompts) or cut ones to continue
    if generate:
        for cid, pid, tag in wanted:
            conv = done.get(cid)
            if conv is None and len(encoded[pid]) <= max_prompt_tokens:
                todo.append(Conversation(cid, encoded[pid], [], tag))
            elif conv is not None and continue_cut and _was_cut(conv, eos_ids, max_new_tokens):
                todo.append(Conversation(conv.id, conv.prompt_ids, conv.response_ids, f"{conv.source}+{tag}"))
    # batches share the length of the answer so far (and so their remaining budget) and greedy or sampled
    # decoding; shortest contexts first
    todo.sort(key=lambda c: (len(c.response_ids), SAMPLE_MARK in c.id, len(c.input_ids)))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    bar = tqdm(total=len(todo), desc="target responses", unit="prompt", disable=not progress)
    start = 0
    while start < len(todo):
        answered, sampled = len(todo[start].response_ids), SAMPLE_MARK in todo[start].id
        batch = [
            c
            for c in todo[start : start + batch_size]
            if len(c.response_ids) == answered and (SAMPLE_MARK in c.id) == sampled
        ]
        start += len(batch)
        convs = _continue_batch(
            model, batch, max_new_tokens - answered, pad_id, eos_ids, temperature if sampled else 0.0
        )
        cache.append(convs)
        done.update({c.id: c for c in convs})
        bar.update(len(batch))
        bar.set_postfix(tokens=sum(len(c.response_ids) - answered for c in convs))
    bar.close()
    return [done[cid] for cid, _, _ in wanted if cid in done]


def _was_cut(conv: Conversation, eos_ids: list[int], max_new_tokens: int) -> bool:
    """The answer stopped at an earlier, smaller token budget rather than at EOS. (Opt-in only: an imported seed
    answer re-tokenized from text can be a few tokens short of the budget that cut it.)"""
    ended = bool(conv.response_ids) and conv.response_ids[-1] in eos_ids
    return not ended and len(conv.response_ids) < max_new_tokens


def _continue_batch(
    model, batch: list[Conversation], budget: int, pad_id: int, eos_ids: list[int], temperature: float = 0.0
) -> list[Conversation]:
    """Continuation of each conversation by up to `budget` tokens, left-padded in one `generate` call: greedy, or
    sampled from the target's distribution at `temperature` (no top-k/top-p), seeded by the batch's ids."""
    ids = [c.input_ids for c in batch]
    width = max(map(len, ids))
    input_ids = torch.tensor([[pad_id] * (width - len(x)) + x for x in ids])
    attention_mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
    sampling = {"temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 else {}
    with torch.random.fork_rng(devices=[]):  # the caller's random state is left as it was
        torch.manual_seed(zlib.crc32(" ".join(c.id for c in batch).encode()))
        out = model.generate(
            input_ids=input_ids.to(model.device),
            attention_mask=attention_mask.to(model.device),
            do_sample=temperature > 0,
            max_new_tokens=budget,
            pad_token_id=pad_id,
            **sampling,
        )
    return [
        Conversation(
            c.id, c.prompt_ids, c.response_ids + _cut_at_eos(row[width:].tolist(), eos_ids), c.source
        )
        for c, row in zip(batch, out, strict=True)
    ]


def _cut_at_eos(tokens: list[int], eos_ids: list[int]) -> list[int]:
    for i, tok in enumerate(tokens):
        if tok in eos_ids:
            return tokens[: i + 1]
    return tokens
