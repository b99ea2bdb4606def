"""Prefill-only features over a fixed-text corpus: no generation, one teacher-forced forward per document.

Each `Document` (`training/corpus.py`) is tokenized the way the target sees a chat (its chat template, piece by
piece, so the mask marks exactly the trained messages' tokens, up to their end-of-turn token), then captured by
the same loop as the target's own answers (`training/features.py`): at every position the target's unit-RMS
last-layer state, its top-K next tokens with log-probabilities and, with `aux_layers`, the hidden states EAGLE-3
fuses. The capture runs in corpus order, a shard at a time, and resumes after an interruption; progress goes to
a log file and to `progress.json` in the store.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from hf_spec.training.corpus import Document
from hf_spec.training.features import FeatureStore, capture_sequences


def eagle3_layers(num_hidden_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low, middle and high layers as `hidden_states` indices (the input of decoder layers 2, N/2 and
    N-3, as EAGLE-3's reference code captures them and `Eagle3HeadConfig` reads them; SpecForge numbers the same
    layers one lower)."""
    from hf_spec.methods.eagle3.modeling import default_hidden_state_indices

    layers = default_hidden_state_indices(num_hidden_layers)
    if len(layers) < 3:
        raise ValueError(
            f"a {num_hidden_layers}-layer target has no three distinct EAGLE-3 layers: give --aux-layers i,j,k"
        )
    return layers


def tokenize_document(
    doc: Document, tokenizer, max_len: int, eos_ids: list[int] | None = None
) -> tuple[list[int], list[int]]:
    """`(input_ids, mask)` of `doc`, cut to `max_len` tokens: the whole text tokenized at once, as the target sees
    it. With a chat template, each message owns the characters its render adds to the render of the messages before
    it (a user turn followed by an answer owns the generation prompt, as when the target answers), and a trained
    message's tokens are masked 1 up to its last end-of-turn token. Without a template, the messages' texts are
    joined by newlines (BOS first, if the tokenizer adds one). A token belongs to the message its first character
    is in (a slow tokenizer, without offsets, is tokenized message by message instead)."""
    eos = set(eos_ids if eos_ids is not None else [tokenizer.eos_token_id])
    chat = [{"role": role, "content": content} for role, content in doc.messages]
    template = bool(getattr(tokenizer, "chat_template", None))
    pieces: list[str] = []
    rendered = ""
    for j, (_, content) in enumerate(doc.messages):
        if not template:
            pieces.append(content + "\n")
            continue
        answer_next = j + 1 < len(chat) and chat[j + 1]["role"] == "assistant"
        text = tokenizer.apply_chat_template(chat[: j + 1], tokenize=False, add_generation_prompt=answer_next)
        if not text.startswith(rendered):
            raise ValueError(
                f"{doc.id}: the tokenizer's chat template renders a conversation differently from its first "
                "turns (not prefix-stable): its messages cannot be told apart in the rendered text"
            )
        pieces.append(text[len(rendered) :])
        rendered = text
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer("".join(pieces), add_special_tokens=not template, return_offsets_mapping=True)
        ends = [sum(map(len, pieces[: j + 1])) for j in range(len(pieces))]
        owner = [
            next((j for j, end in enumerate(ends) if start < end), -1) for start, stop in enc.offset_mapping
        ]
        owner = [
            o if stop > start else -1 for o, (start, stop) in zip(owner, enc.offset_mapping, strict=True)
        ]
        ids = list(enc.input_ids)
    else:
        ids, owner = [], []
        for j, piece in enumerate(pieces):
            piece_ids = tokenizer(piece, add_special_tokens=j == 0 and not template).input_ids
            ids += piece_ids
            owner += [j] * len(piece_ids)
    mask = [int(o >= 0 and doc.messages[o][0] in doc.train_roles) for o in owner]
    if template:  # the template's text after a trained message's end-of-turn token is not the answer
        for j in {o for o, m in zip(owner, mask, strict=True) if m}:
            positions = [i for i, o in enumerate(owner) if o == j]
            last_eos = max((i for i in positions if ids[i] in eos), default=None)
            for i in positions:
                if last_eos is not None and i > last_eos:
                    mask[i] = 0
    return ids[:max_len], mask[:max_len]


def corpus_sequences(
    documents: list[Document], tokenizer, max_len: int, eos_ids: list[int] | None = None
) -> list[tuple[str, list[int], list[int]]]:
    """`(id, input_ids, mask)` of every document that has at least 2 tokens and a trained one, in order."""
    out = []
    for doc in documents:
        ids, mask = tokenize_document(doc, tokenizer, max_len, eos_ids)
        if len(ids) >= 2 and any(mask[1:]):
            out.append((doc.id, ids, mask))
    return out


def limited(
    sequences: list[tuple[str, list[int], list[int]]], limit_tokens: int | None
) -> list[tuple[str, list[int], list[int]]]:
    """The first sequences up to about `limit_tokens` tokens (the one that crosses it included); all if None."""
    if limit_tokens is None:
        return sequences
    kept, total = [], 0
    for seq in sequences:
        if total >= limit_tokens:
            break
        kept.append(seq)
        total += len(seq[1])
    return kept


class ProgressLog:
    """After each shard: one line in `log_file` (and stdout) and `progress.json` in the store: tokens captured of
    the corpus, this run's tokens/s and the time left at that rate. Stops the run (after the shard is saved) when
    the disk's free space falls below `min_free_gb`."""

    def __init__(
        self,
        sequences: list[tuple[str, list[int], list[int]]],
        store: FeatureStore,
        log_file: str | os.PathLike | None,
        min_free_gb: float = 10.0,
    ):
        self.total = sum(len(s[1]) for s in sequences)
        self.ids = {s[0] for s in sequences}  # a store may hold other corpora's sequences too
        self.start_tokens = self.tokens_done(store)  # already in the store when this run began
        self.log_file = log_file
        self.min_free_gb = min_free_gb
        self.started = time.time()

    def tokens_done(self, store: FeatureStore) -> int:
        """Tokens of this corpus's sequences the store holds."""
        return sum(n for cid, n in store.captured().items() if cid in self.ids)

    def __call__(self, store: FeatureStore) -> None:
        done = self.tokens_done(store)
        elapsed = time.time() - self.started
        rate = (done - self.start_tokens) / max(elapsed, 1e-9)
        left = max(self.total - done, 0) / rate if rate > 0 else float("inf")
        free_gb = shutil.disk_usage(store.folder).free / 2**30
        size_gb = sum((store.folder / s).stat().st_size for s in store.shards) / 2**30
        info = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "shards": len(store.shards),
            "tokens_done": done,
            "tokens_total": self.total,
            "tokens_per_second": round(rate, 1),
            "eta_hours": round(left / 3600, 2),
            "store_gb": round(size_gb, 2),
            "disk_free_gb": round(free_gb, 1),
        }
        (store.folder / "progress.json").write_text(json.dumps(info, indent=1) + "\n")
        line = (
            f"{info['time']} shard {len(store.shards)}: {done:,}/{self.total:,} tokens "
            f"({100 * done / max(self.total, 1):.1f}%), {rate:.1f} tokens/s this run, ETA {left / 3600:.1f} h, "
            f"store {size_gb:.2f} GB, disk free {free_gb:.1f} GB"
        )
        print(line, flush=True)
        if self.log_file:
            with open(self.log_file, "a") as f:
                f.write(line + "\n")
        if free_gb < self.min_free_gb:
            raise RuntimeError(
                f"stopped: {free_gb:.1f} GB free on the disk of {store.folder}, under {self.min_free_gb} GB; free "
                "space (or capture without aux layers) and re-run the same command to resume"
            )


def capture_corpus(
    model,
    tokenizer,
    documents: list[Document],
    folder: str | os.PathLike,
    *,
    topk: int | None = None,
    aux_layers: tuple[int, ...] = (),
    max_len: int = 1024,
    limit_tokens: int | None = None,
    shard_tokens: int = 65536,
    log_file: str | os.PathLike | None = None,
    min_free_gb: float = 10.0,
    progress: bool = False,
    on_shard: Callable[[FeatureStore], None] | None = None,
    batch_size: int = 1,
) -> FeatureStore:
    """Capture the prefill features of `documents` (the first `limit_tokens` tokens' worth, if given) into the
    store at `folder`, skipping what it already holds; `batch_size` documents a forward, right-padded."""
    eos = model.generation_config.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [tokenizer.eos_token_id])
    sequences = limited(corpus_sequences(documents, tokenizer, max_len, eos_ids), limit_tokens)
    logger = ProgressLog(sequences, FeatureStore.open(folder), log_file, min_free_gb)

    def after_shard(store: FeatureStore) -> None:
        logger(store)
        if on_shard is not None:
            on_shard(store)

    Path(folder).mkdir(parents=True, exist_ok=True)
    with capture_lock(Path(folder)):
        return capture_sequences(
            model,
            sequences,
            folder,
            topk=topk,
            aux_layers=aux_layers,
            shard_tokens=shard_tokens,
            progress=progress,
            total=len(sequences),
            on_shard=after_shard,
            batch_size=batch_size,
        )


@contextlib.contextmanager
def capture_lock(folder: Path) -> Iterator[None]:
    """`<folder>/capture.lock` holding this process's id while it captures: a second capture into the same store
    (which would write the same shard names) is refused while the first one's process lives."""
    lock = folder / "capture.lock"
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        pid = int(lock.read_text().strip() or 0)
        if pid and _alive(pid):
            raise RuntimeError(
                f"{folder} is being captured by process {pid}; wait for it or stop it"
            ) from None
        lock.unlink()  # left by a process that died
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True
