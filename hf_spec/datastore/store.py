"""`Datastore`: a built, cached token index (from a recipe) plus an online part that grows with generated text.

On disk (`hf-spec datastore build --out DIR`, or `$HF_SPEC_CACHE/datastores/<key>/` when built on first use)::

    recipe.json           the recipe (sources and their settings): the datastore is rebuilt from it
    meta.json             tokenizer identity, token counts per source, build time, bytes
    tokens.npy            flat int32 token array, -1 between documents
    suffix_array.npy      suffix array of the reversed token array
    hf_spec_checksums.json   sha256 of the two arrays, written last and checked at load (`hf_spec.io.integrity`)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from hf_spec.datastore.index import Matches, TokenIndex, flatten_documents, group_continuations
from hf_spec.datastore.sources import (
    ExitHead,
    corpus_documents,
    early_exit_continuation,
    read_texts,
    response_documents,
)
from hf_spec.io.integrity import verify_checksums, write_checksums
from hf_spec.io.output_folder import check_output_folder, staged_folder

FORMAT_VERSION = 1


@dataclass
class DatastoreRecipe:
    """How to build a datastore. Each source is on when its file list is non-empty.

    Args:
        corpus: training text files segmented by the target's tokenizer (source 1).
        responses: caches of the target's own answers (JSONL with `prompt`, `response`) (source 2).
        early_exit_prompts: training prompt files continued by the target's early-exit layers (source 3).
        early_exit_layer: layers used for source 3 (0: three quarters of the depth).
        early_exit_max_prompts: prompts continued for source 3.
        early_exit_new_tokens: tokens generated per prompt for source 3.
    """

    corpus: list[str] = field(default_factory=list, metadata={"help": "training text files (source 1)"})
    responses: list[str] = field(default_factory=list, metadata={"help": "target answer caches (source 2)"})
    early_exit_prompts: list[str] = field(
        default_factory=list, metadata={"help": "prompt files continued by early-exit layers (source 3)"}
    )
    early_exit_layer: int = field(default=0, metadata={"help": "exit layer for source 3 (0: 3/4 depth)"})
    early_exit_max_prompts: int = field(default=64, metadata={"help": "prompts continued for source 3"})
    early_exit_new_tokens: int = field(default=64, metadata={"help": "tokens per prompt for source 3"})

    @property
    def empty(self) -> bool:
        return not (self.corpus or self.responses or self.early_exit_prompts)

    @classmethod
    def from_dict(cls, data: dict) -> DatastoreRecipe:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown datastore recipe keys {unknown}; known: {sorted(known)}")
        return cls(**data)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def key(self, tokenizer) -> str:
        """Cache key: the recipe, the tokenizer and the size/mtime of every source file."""
        files = {p: _file_stamp(p) for p in self.corpus + self.responses + self.early_exit_prompts}
        blob = json.dumps([FORMAT_VERSION, self.to_dict(), tokenizer_id(tokenizer), files], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _file_stamp(path: str) -> list:
    st = os.stat(path)
    return [os.path.abspath(path), st.st_size, int(st.st_mtime)]


def tokenizer_id(tokenizer) -> dict:
    vocab = tokenizer.get_vocab()
    digest = hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).hexdigest()[:16]
    return {"vocab_size": len(vocab), "vocab_sha256": digest}


class Datastore:
    """A static `TokenIndex` plus online documents (e.g. earlier prompts and answers) searched together."""

    def __init__(self, index: TokenIndex | None = None, meta: dict | None = None) -> None:
        self.index = index
        self.meta = meta or {}
        self._online_docs: list[np.ndarray] = []
        self._online: TokenIndex | None = None
        self.online_tokens = 0

    def add(self, tokens, max_online_tokens: int = 1_000_000) -> None:
        """Grow the online part with one document (e.g. a prompt and its answer); oldest documents go first
        beyond `max_online_tokens`."""
        doc = np.asarray(tokens, dtype=np.int32).reshape(-1)
        if not len(doc):
            return
        self._online_docs.append(doc)
        self.online_tokens += len(doc)
        while self.online_tokens > max_online_tokens and len(self._online_docs) > 1:
            self.online_tokens -= len(self._online_docs.pop(0))
        self._online = None  # re-indexed on the next search

    def search(
        self, context: np.ndarray, max_len: int, depth: int, min_len: int = 1, max_occurrences: int = 256
    ) -> Matches:
        """Longest-suffix matches in the static and online parts; the longer match wins, equal lengths pool."""
        if self._online is None and self._online_docs:
            self._online = TokenIndex(flatten_documents(self._online_docs))
        found = [
            part.search(context, max_len, depth, min_len, max_occurrences)
            for part in (self.index, self._online)
            if part is not None
        ]
        return pool_longest(found, depth)

    @property
    def num_tokens(self) -> int:
        return (self.index.num_tokens if self.index is not None else 0) + self.online_tokens


def pool_longest(found: list[Matches], depth: int) -> Matches:
    """Keep the matches of the longest length; pool their continuations and counts."""
    found = [m for m in found if m.length > 0]
    if not found:
        return Matches.none(depth)
    best = max(m.length for m in found)
    top = [m for m in found if m.length == best]
    if len(top) == 1:
        return top[0]
    rows = np.concatenate([np.repeat(m.sequences, m.counts, axis=0) for m in top])
    return group_continuations(rows, best, sum(m.occurrences for m in top))


# ---- building, saving, loading ----------------------------------------------------------------------


def build_datastore(
    recipe: DatastoreRecipe, model, tokenizer, exit_head: ExitHead | None = None, progress: bool = True
) -> tuple[TokenIndex, dict]:
    """Tokenize / generate every source of `recipe` and index the result. Returns the index and its meta."""
    if recipe.empty:
        raise ValueError("the datastore recipe has no source: give corpus, responses or early_exit_prompts")
    start = time.perf_counter()
    docs: list[list[int]] = []
    per_source: dict[str, int] = {}

    def take(name: str, it) -> None:
        before = sum(len(d) for d in docs)
        docs.extend(tqdm(it, desc=f"datastore: {name}", unit="doc", disable=not progress))
        per_source[name] = sum(len(d) for d in docs) - before

    if recipe.corpus:
        take("corpus", corpus_documents(recipe.corpus, tokenizer))
    for path in recipe.responses:
        take("responses", response_documents(path, tokenizer))
    if recipe.early_exit_prompts:
        take("early-exit", _early_exit_documents(recipe, model, tokenizer, exit_head))
    empty = [name for name, count in per_source.items() if not count]
    if empty:
        raise ValueError(
            f"the datastore source(s) {empty} gave no tokens: check the files hold ShareGPT / Alpaca texts "
            "(corpus) or target answers (responses)"
        )
    index_start = time.perf_counter()
    index = TokenIndex(flatten_documents(docs))
    meta = {
        "format": FORMAT_VERSION,
        "tokenizer": tokenizer_id(tokenizer),
        "tokens": index.num_tokens,
        "tokens_per_source": per_source,
        "documents": len(docs),
        "index_bytes": index.nbytes,
        "index_seconds": round(time.perf_counter() - index_start, 3),
        "build_seconds": round(time.perf_counter() - start, 3),
    }
    return index, meta


def _early_exit_documents(recipe: DatastoreRecipe, model, tokenizer, exit_head: ExitHead | None):
    from hf_spec.models.layers import decoder_parts

    if model is None:
        raise ValueError("the early-exit source needs the target model")
    layer = recipe.early_exit_layer or max(1, round(0.75 * decoder_parts(model).num_layers))
    prompts = [t for path in recipe.early_exit_prompts for t in read_texts(path)]
    for text in prompts[: recipe.early_exit_max_prompts]:
        ids = chat_ids(tokenizer, text)[-256:]
        yield ids + early_exit_continuation(model, ids, layer, recipe.early_exit_new_tokens, exit_head)


def chat_ids(tokenizer, text: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        templated = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        return tokenizer(templated, add_special_tokens=False).input_ids
    return tokenizer(text).input_ids


def is_datastore_folder(folder: Path) -> bool:
    """An earlier datastore (any format version): `meta.json` and `recipe.json` side by side."""
    return (folder / "meta.json").is_file() and (folder / "recipe.json").is_file()


def save_datastore(folder: str | os.PathLike, index: TokenIndex, recipe: DatastoreRecipe, meta: dict) -> Path:
    """Write atomically: a folder that exists is complete."""
    folder = Path(folder)
    check_output_folder(folder, is_datastore_folder, "datastore")
    with staged_folder(folder) as tmp:
        index.save(tmp)
        (tmp / "recipe.json").write_text(json.dumps(recipe.to_dict(), indent=2) + "\n")
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        write_checksums(tmp)  # last: checked at load
    return folder


def load_datastore(folder: str | os.PathLike, tokenizer=None) -> Datastore:
    """Load a saved datastore (memory-mapped); with `tokenizer`, check it is the one the datastore was built
    with."""
    folder = Path(folder)
    if not (folder / "meta.json").exists():
        raise FileNotFoundError(f"no datastore at {folder} (build one with `hf-spec datastore build`)")
    try:
        meta = json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{folder}/meta.json is not readable JSON ({err}); rebuild the datastore") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"{folder}: datastore format {found}, expected {FORMAT_VERSION}; rebuild it")
    if tokenizer is not None and meta.get("tokenizer") != tokenizer_id(tokenizer):
        raise ValueError(f"{folder} was built with another tokenizer ({meta.get('tokenizer')}); rebuild it")
    try:
        index = TokenIndex.load(folder)
        verify_checksums(folder, f"the datastore at {folder}")
    except (OSError, ValueError) as err:  # missing, truncated, foreign or altered .npy files
        raise ValueError(f"{folder}: corrupt datastore arrays ({err}); rebuild the datastore") from None
    return Datastore(index, meta)


def datastore_cache_dir() -> Path:
    from hf_spec.models.fetch import cache_root

    return cache_root() / "datastores"


def get_datastore(
    recipe: DatastoreRecipe | None,
    model,
    tokenizer,
    path: str = "",
    exit_head: ExitHead | None = None,
    progress: bool = True,
) -> Datastore:
    """A prebuilt datastore from `path`, or the recipe's cached build (built now if missing), or an empty one."""
    if path:
        return load_datastore(path, tokenizer)
    if recipe is None or recipe.empty:
        return Datastore()
    if tokenizer is None:
        raise ValueError(
            "building a datastore needs the target's tokenizer (SpeculativeDecoder(..., tokenizer=tok))"
        )
    folder = datastore_cache_dir() / recipe.key(tokenizer)
    if not (folder / "meta.json").exists():
        index, meta = build_datastore(recipe, model, tokenizer, exit_head, progress)
        save_datastore(folder, index, recipe, meta)
    return load_datastore(folder, tokenizer)
