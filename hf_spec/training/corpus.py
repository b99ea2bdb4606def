"""Fixed-text training corpora for draft heads: documents from licensed sources, never evaluation prompts.

A head learns the target's own next-token distribution at each position, and the prefill features
(`training/corpus_features.py`) label any text with it in one forward; so text the target did not write teaches
a head too. A corpus is a JSONL of `Document`s (chat messages and the roles whose tokens are trained), built from
`Source`s that each carry a licence and an origin, in the order the features are captured: `priority` groups
first to last, each shuffled with a fixed seed, so every prefix of the capture is a mix of its sources.

Two refusals keep evaluation prompts out: every input file goes through `check_not_eval` (files under an `eval`
folder or named like an evaluation set), and `EvalFilter` drops every document that shares a run of words with
any text of the evaluation sets.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from hf_spec.training.prompts import check_not_eval

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Document:
    """One training sequence: `messages` as `(role, content)` pairs; the tokens of the messages whose role is in
    `train_roles` are trained on (their `response_mask` is 1), the others are context."""

    id: str
    source: str
    messages: tuple[tuple[str, str], ...]
    train_roles: tuple[str, ...] = ("assistant",)

    def to_json(self) -> str:
        return json.dumps(
            {"id": self.id, "source": self.source, "messages": self.messages, "train_roles": self.train_roles}
        )

    @classmethod
    def from_row(cls, row: dict, where: str) -> Document:
        try:
            messages = tuple((str(r), str(c)) for r, c in row["messages"])
            doc = cls(
                str(row["id"]), str(row["source"]), messages, tuple(row.get("train_roles", ("assistant",)))
            )
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{where}: not a corpus document ({err!r})") from None
        if not messages or any(role not in ROLES for role, _ in messages):
            raise ValueError(
                f"{where}: messages must be non-empty (role, content) pairs with roles in {ROLES}"
            )
        return doc

    @property
    def text(self) -> str:
        return "\n".join(content for _, content in self.messages)


@dataclass(frozen=True)
class Source:
    """Where a group of documents comes from: `licence` and `origin` go to the corpus manifest and provenance;
    `priority`: lower groups are captured first."""

    name: str
    licence: str
    origin: str
    priority: int = 1
    max_tokens: int | None = None  # keep about this many tokens (estimated at 3.5 characters a token)


def chunk_text(text: str, max_chars: int) -> list[str]:
    """`text` cut into pieces of at most `max_chars` characters, at blank lines where it can, else at line ends,
    else anywhere; blank-only pieces dropped."""
    if max_chars <= 0:
        raise ValueError(f"max_chars must be positive, got {max_chars}")
    pieces: list[str] = []
    current = ""
    for block in re.split(r"(?<=\n\n)", text):
        parts = [block] if len(block) <= max_chars else re.split(r"(?<=\n)", block)
        for part in parts:
            if current and len(current) + len(part) > max_chars:
                pieces.append(current)
                current = ""
            while len(part) > max_chars:  # one overlong line
                pieces.append(part[:max_chars])
                part = part[max_chars:]
            current += part
    pieces.append(current)
    return [p for p in pieces if p.strip()]


def documents_from_tree(
    source: str,
    root: str | os.PathLike,
    patterns: Iterable[str],
    prompt: str,
    *,
    exclude: Iterable[str] = (),
    max_chars: int = 3000,
    max_line: int = 1000,
) -> list[Document]:
    """Every file under `root` matching a glob of `patterns` (none matching a regex of `exclude`, none with a line
    longer than `max_line`: data, not prose or code), cut by `chunk_text` into documents `[user: prompt, assistant:
    chunk]`; `prompt` is formatted with `{path}` (relative to `root`) and `{part}` (" (part 2 of 3)" or "")."""
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"{root}: not a folder")
    skip = [re.compile(x) for x in exclude]
    files = sorted({p for pattern in patterns for p in root.glob(pattern) if p.is_file()})
    docs = []
    for path in files:
        rel = path.relative_to(root).as_posix()
        check_not_eval(path)
        if any(x.search(rel) for x in skip):
            continue
        text = path.read_text(errors="replace")
        if not text.strip() or max(map(len, text.splitlines()), default=0) > max_line:
            continue
        chunks = chunk_text(text, max_chars)
        for k, chunk in enumerate(chunks):
            part = f" (part {k + 1} of {len(chunks)})" if len(chunks) > 1 else ""
            question = prompt.format(path=rel, part=part)
            docs.append(Document(f"{source}/{rel}#{k}", source, (("user", question), ("assistant", chunk))))
    return docs


def documents_from_file(source: str, path: str | os.PathLike, max_chars: int = 3000) -> list[Document]:
    """Documents of one chat or text file: corpus JSONL (`messages`), ShareGPT (`conversations`: every turn; a
    first turn alone is trained as user text), Alpaca (`instruction`, its `instances`' outputs as answers),
    `{"text"}` rows, or a plain `.txt` file (trained throughout). A target's answers: `answers`."""
    path = Path(path)
    check_not_eval(path)
    raw = path.read_text()
    if path.suffix == ".txt":
        return [
            Document(f"{source}/{path.name}#{k}", source, (("assistant", chunk),))
            for k, chunk in enumerate(chunk_text(raw, max_chars))
        ]
    try:
        rows = json.loads(raw) if path.suffix == ".json" else [json.loads(x) for x in raw.splitlines() if x]
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    docs = []
    for i, row in enumerate(rows):
        doc_id = f"{source}/{row.get('id', i)}"
        if "messages" in row:
            docs.append(Document.from_row(row | {"source": source, "id": doc_id}, f"{path}: row {i}"))
        elif "conversations" in row:
            roles = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
            turns = tuple(
                (roles[t["from"]], t["value"]) for t in row["conversations"] if t.get("from") in roles
            )
            if turns and any(c.strip() for _, c in turns):
                trained = ("assistant",) if any(r == "assistant" for r, _ in turns) else ("user",)
                docs.append(Document(doc_id, source, turns, trained))
        elif "instruction" in row:
            for k, inst in enumerate(row.get("instances") or [{"input": row.get("input", ""), "output": ""}]):
                question = row["instruction"] + (f"\n\n{inst['input']}" if inst.get("input") else "")
                answer = inst.get("output") or row.get("output", "")
                if answer.strip():
                    docs.append(
                        Document(f"{doc_id}#{k}", source, (("user", question), ("assistant", answer)))
                    )
        elif "text" in row:
            docs += [
                Document(f"{doc_id}#{k}", source, (("assistant", chunk),))
                for k, chunk in enumerate(chunk_text(row["text"], max_chars))
            ]
        else:
            raise ValueError(f"{path}: row {i} has none of messages, conversations, instruction, text")
    return docs


def answers(source: str, responses: str | os.PathLike, prompts: str | os.PathLike) -> list[Document]:
    """A target's answers (a response cache JSONL: `id`, `response`) to the prompts of a ShareGPT/Alpaca file, as
    `[user: prompt, assistant: answer]` documents."""
    from hf_spec.training.prompts import load_train_prompts

    by_id = {p.id: p for p in load_train_prompts(prompts)}
    check_not_eval(responses)
    docs = []
    for line in Path(responses).read_text().splitlines():
        row = json.loads(line)
        prompt = by_id.get(str(row.get("id")))
        if prompt is not None and row.get("response", "").strip():
            messages = (*prompt.messages, ("assistant", row["response"]))
            docs.append(Document(f"{source}/{prompt.id}", source, messages))
    return docs


@dataclass
class EvalFilter:
    """Finds documents that share a run of `n` words (lower-cased `\\w+` tokens) with any evaluation text; an
    evaluation text shorter than `n` words (but at least `min_words`) is matched whole, as a run of its own length.
    Shorter texts are too generic to match on."""

    grams: dict[int, set[str]] = field(default_factory=dict)  # run length -> hashes of the runs
    n: int = 13
    min_words: int = 6

    @classmethod
    def from_files(cls, paths: Iterable[str | os.PathLike], n: int = 13, min_words: int = 6) -> EvalFilter:
        """From evaluation JSONL files: every string in their rows (questions, turns, references)."""
        filt = cls(n=n, min_words=min_words)
        for path in paths:
            for line in Path(path).read_text().splitlines():
                if line.strip():
                    for text in _strings(json.loads(line)):
                        filt.add(text)
        if not filt.grams:
            raise ValueError("no evaluation text found to filter against: give the evaluation prompt files")
        return filt

    def add(self, text: str) -> None:
        words = _words(text)
        if len(words) < self.min_words:
            return
        size = min(self.n, len(words))
        self.grams.setdefault(size, set()).update(_runs(words, size))

    def overlaps(self, text: str) -> bool:
        words = _words(text)
        return any(not grams.isdisjoint(_runs(words, size)) for size, grams in self.grams.items())


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def _runs(words: list[str], size: int) -> set[str]:
    return {
        hashlib.blake2b(" ".join(words[i : i + size]).encode(), digest_size=8).hexdigest()
        for i in range(len(words) - size + 1)
    }


def _strings(value) -> Iterable[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def build_corpus(
    groups: list[tuple[Source, list[Document]]],
    eval_filter: EvalFilter,
    out: str | os.PathLike,
    seed: int = 0,
) -> dict:
    """Write the documents of `groups` to the JSONL `out` (atomically) in capture order, dropping those that
    overlap evaluation text and capping each source at its `max_tokens`; returns the manifest (per source:
    licence, origin, documents, characters, dropped overlaps; the file's sha256)."""
    if not groups:
        raise ValueError("no corpus sources given")
    ordered: dict[int, list[Document]] = {}
    sources = {}
    for source, docs in groups:
        if source.name in sources:
            raise ValueError(f"corpus source {source.name!r} given twice")
        overlapping = [eval_filter.overlaps(d.text) for d in docs]
        kept = [d for d, bad in zip(docs, overlapping, strict=True) if not bad]
        # the cap keeps a random sample of the source, the same whatever the other sources are
        random.Random(f"{seed}:{source.name}").shuffle(kept)
        if source.max_tokens is not None:
            budget, capped = source.max_tokens * 3.5, []
            for doc in kept:
                if budget <= 0:
                    break
                capped.append(doc)
                budget -= len(doc.text)
            kept = capped
        ordered.setdefault(source.priority, []).extend(kept)
        sources[source.name] = {
            "licence": source.licence,
            "origin": source.origin,
            "documents": len(kept),
            "characters": sum(len(d.text) for d in kept),
            "dropped_eval_overlap": sum(overlapping),
            "available_documents": len(docs),
        }
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    digest = hashlib.sha256()
    with tmp.open("w") as f:
        for priority in sorted(ordered):
            docs = ordered[priority]
            random.Random(f"{seed}:priority {priority}").shuffle(docs)
            for doc in docs:
                line = doc.to_json() + "\n"
                digest.update(line.encode())
                f.write(line)
    tmp.replace(out)
    return {"file": out.name, "sha256": digest.hexdigest(), "seed": seed, "sources": sources}


def read_documents(path: str | os.PathLike) -> list[Document]:
    """The documents of a corpus JSONL written by `build_corpus` (or by hand, in its format), in file order."""
    path = Path(path)
    check_not_eval(path)
    rows = [line for line in path.read_text().splitlines() if line.strip()]
    return [Document.from_row(json.loads(row), f"{path}:{i + 1}") for i, row in enumerate(rows)]


def load_corpus(path: str | os.PathLike) -> list[Document]:
    """A corpus JSONL of `build_corpus` (rows with `source` and `messages`), else `documents_from_file` with the
    file's name as the source."""
    path = Path(path)
    if path.suffix == ".jsonl":
        with path.open() as f:
            first = next((line for line in f if line.strip()), "{}")
        row = json.loads(first)
        if isinstance(row, dict) and "source" in row and "messages" in row:
            return read_documents(path)
    return documents_from_file(path.stem, path)
