"""Datastore: suffix-array search against a brute-force scan, index persistence, recipes and sources."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_spec.datastore import (
    Datastore,
    DatastoreRecipe,
    TokenIndex,
    build_datastore,
    load_datastore,
    scan_search,
)
from hf_spec.datastore.index import flatten_documents
from hf_spec.datastore.sources import check_not_eval, read_texts
from hf_spec.datastore.store import pool_longest, save_datastore
from hf_spec.datastore.suffix_array import SEP, _prefix_doubling, build_suffix_array


def brute_force(docs: list[list[int]], context: list[int], max_len: int, min_len: int, depth: int):
    """Plain-Python Algorithm 1: shrink l from max_len until the context's last l tokens occur in a document;
    return l, the number of occurrences and {continuation: count}."""
    for length in range(min(max_len, len(context)), min_len - 1, -1):
        suffix = context[-length:]
        conts: dict[tuple, int] = {}
        occurrences = 0
        for doc in docs:
            for end in range(length - 1, len(doc)):
                if doc[end - length + 1 : end + 1] == suffix:
                    occurrences += 1
                    cont = tuple(doc[end + 1 : end + 1 + depth])
                    if cont:
                        conts[cont] = conts.get(cont, 0) + 1
        if occurrences:
            return length, occurrences, conts
    return 0, 0, {}


def as_dict(m) -> dict[tuple, int]:
    return {
        tuple(t for t in row if t != SEP): int(c)
        for row, c in zip(m.sequences.tolist(), m.counts, strict=True)
    }


docs_strategy = st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=25), min_size=0, max_size=6)


@given(
    docs_strategy, st.lists(st.integers(0, 3), min_size=1, max_size=8), st.integers(1, 6), st.integers(1, 4)
)
@settings(max_examples=400, deadline=None)
def test_suffix_search_matches_brute_force(docs, context, max_len, depth):
    index = TokenIndex.from_documents(docs)
    got = index.search(np.array(context), max_len=max_len, depth=depth, max_occurrences=10_000)
    length, occurrences, conts = brute_force(docs, context, max_len, 1, depth)
    assert got.length == length
    assert got.occurrences == occurrences
    assert as_dict(got) == conts


@given(st.lists(st.integers(0, 3), min_size=2, max_size=40), st.integers(1, 6), st.integers(1, 4))
@settings(max_examples=300, deadline=None)
def test_context_scan_matches_brute_force(text, max_len, depth):
    """The prompt + generated text is searched by a scan; an occurrence must be followed by a token."""
    got = scan_search(np.array(text), np.array(text), max_len, depth)
    length, _, conts = brute_force([text[:-1]], text, max_len, 1, depth)
    if length:  # occurrences inside text[:-1]; continuations may run into the last token
        ends = [e for e in range(length - 1, len(text) - 1) if text[e - length + 1 : e + 1] == text[-length:]]
        conts = {}
        for e in ends:
            cont = tuple(text[e + 1 : e + 1 + depth])
            conts[cont] = conts.get(cont, 0) + 1
    assert got.length == length
    assert as_dict(got) == conts


@given(st.lists(st.integers(-1, 6), min_size=0, max_size=60))
@settings(max_examples=200, deadline=None)
def test_prefix_doubling_fallback_equals_divsufsort(tokens):
    arr = np.array(tokens, dtype=np.int32)
    expected = sorted(range(len(tokens)), key=lambda i: tokens[i:])
    assert _prefix_doubling(arr).tolist() == expected if len(arr) else True
    assert build_suffix_array(arr).tolist() == expected


def test_min_len_and_sampling_cap():
    docs = [[1, 2, 3, 4]] * 50 + [[9, 2, 5]]
    index = TokenIndex.from_documents(docs)
    m = index.search(np.array([7, 2]), max_len=4, depth=1, min_len=2)
    assert m.length == 0 and not len(m.sequences)
    m = index.search(np.array([7, 2]), max_len=4, depth=1, max_occurrences=8)
    assert m.length == 1 and m.occurrences == 51 and m.counts.sum() == 8


def test_index_save_load_roundtrip(tmp_path):
    index = TokenIndex.from_documents([[5, 6, 7], [5, 6, 8], [1]])
    index.save(tmp_path)
    loaded = TokenIndex.load(tmp_path)
    a = index.search(np.array([5, 6]), 3, 2)
    b = loaded.search(np.array([5, 6]), 3, 2)
    assert a.length == b.length == 2 and as_dict(a) == as_dict(b)


def test_online_growth_and_pooling():
    store = Datastore(TokenIndex.from_documents([[1, 2, 3]]))
    assert store.search(np.array([1, 2]), 4, 1).length == 2
    store.add([7, 1, 2, 9])
    m = store.search(np.array([7, 1, 2]), 4, 1)
    assert m.length == 3 and as_dict(m) == {(9,): 1}
    m = store.search(np.array([1, 2]), 4, 1)  # both parts match 2 tokens: pooled
    assert as_dict(m) == {(3,): 1, (9,): 1}
    assert pool_longest([], 2).length == 0


def test_flatten_rejects_negative_ids():
    with pytest.raises(ValueError, match="non-negative"):
        flatten_documents([[1, -3]])


def test_eval_files_are_refused(tmp_path):
    bad = tmp_path / "data" / "eval" / "spec_bench.jsonl"
    bad.parent.mkdir(parents=True)
    bad.write_text('{"instruction": "x"}\n')
    with pytest.raises(ValueError, match="eval"):
        list(read_texts(bad))
    check_not_eval(tmp_path / "data" / "train" / "x.json")  # fine


def test_build_from_corpus_and_responses(tmp_path, stories):
    _, tok = stories
    corpus = tmp_path / "corpus.json"
    corpus.write_text(
        json.dumps([{"conversations": [{"from": "human", "value": "Once upon a time there was a cat."}]}])
    )
    alpaca = tmp_path / "tasks.jsonl"
    alpaca.write_text(
        json.dumps({"instruction": "Tell a story.", "instances": [{"input": "", "output": "A dog ran."}]})
        + "\n"
    )
    responses = tmp_path / "responses.jsonl"
    responses.write_text(
        json.dumps({"id": "a", "prompt": "Lily said", "response": " hello to the cat."}) + "\n"
    )
    recipe = DatastoreRecipe(corpus=[str(corpus), str(alpaca)], responses=[str(responses)])
    index, meta = build_datastore(recipe, None, tok, progress=False)
    assert meta["tokens_per_source"]["corpus"] > 0 and meta["tokens_per_source"]["responses"] > 0
    save_datastore(tmp_path / "ds", index, recipe, meta)
    store = load_datastore(tmp_path / "ds", tok)
    ctx = np.array(tok("there was a", add_special_tokens=False).input_ids)
    m = store.search(ctx, 8, 2)
    assert m.length == len(ctx)
    assert tok.decode(m.sequences[0]).strip().startswith("cat")
    with pytest.raises(ValueError, match="unknown datastore recipe keys"):
        DatastoreRecipe.from_dict({"corpra": []})
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match=r"source\(s\) \['responses'\] gave no tokens"):
        build_datastore(DatastoreRecipe(responses=[str(empty)]), None, tok, progress=False)
    save_datastore(tmp_path / "ds", index, recipe, meta)  # over an earlier datastore: replaced
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"already holds other files \(notes.txt\)"):
        save_datastore(tmp_path / "project", index, recipe, meta)  # was: deleted the folder's contents
    assert (tmp_path / "project" / "notes.txt").read_text() == "mine"


def test_corrupt_or_foreign_datastores_are_clear_errors(tmp_path, tiny_llama):
    from hf_spec import SpeculativeDecoder
    from hf_spec.methods.retrieval.config import RetrievalConfig
    from tests.conftest import prompt_ids

    recipe = DatastoreRecipe()
    meta = {"format": 1, "tokenizer": None, "tokens_per_source": {}}

    def retrieval(folder):
        return SpeculativeDecoder(RetrievalConfig(datastore_path=str(folder))).drafter_for(tiny_llama)

    foreign = tmp_path / "foreign"  # ids past the tiny target's 96-token vocabulary
    save_datastore(foreign, TokenIndex(flatten_documents([[5, 6, 500, 501]])), recipe, meta)
    with pytest.raises(ValueError, match=r"token id 501, outside the target's vocabulary \(96\)"):
        retrieval(foreign)
    good = tmp_path / "good"
    save_datastore(good, TokenIndex(flatten_documents([prompt_ids(30, seed=3)[0].tolist()])), recipe, meta)
    assert retrieval(good).retriever.datastore.num_tokens == 31
    (good / "tokens.npy").write_bytes((good / "tokens.npy").read_bytes()[:100])  # truncated
    time.sleep(0.01)
    (good / "meta.json").write_text(json.dumps(meta))  # as a rebuild writes it last
    with pytest.raises(ValueError, match="corrupt datastore arrays"):
        retrieval(good)  # a rewritten folder is loaded again, not taken from the process-wide cache
    (good / "meta.json").write_text("{not json")
    with pytest.raises(ValueError, match="meta.json is not readable JSON"):
        load_datastore(good)
    (good / "meta.json").write_text("[1]")
    with pytest.raises(ValueError, match="datastore format list"):
        load_datastore(good)


def test_build_from_early_exit_layers(tmp_path, stories):
    model, tok = stories
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "\n".join(json.dumps({"instruction": t}) for t in ["Once upon a time", "The dog"]) + "\n"
    )
    recipe = DatastoreRecipe(early_exit_prompts=[str(prompts)], early_exit_layer=3, early_exit_new_tokens=6)
    index, meta = build_datastore(recipe, model, tok, progress=False)
    assert meta["documents"] == 2 and meta["tokens_per_source"]["early-exit"] > 0
    # the generated part equals a greedy run of the first 3 layers + final norm + LM head
    ids = tok("Once upon a time").input_ids
    from hf_spec.datastore.sources import early_exit_continuation

    cont = early_exit_continuation(model, ids, 3, 6)
    assert index.text[: len(ids) + len(cont)].tolist() == ids + cont


def test_responses_from_a_token_id_cache(tmp_path):
    from hf_spec.datastore.sources import response_documents
    from hf_spec.training.responses import Conversation, ResponseCache

    ResponseCache(tmp_path / "cache").append([Conversation("a", [1, 2], [3, 4, 2])])
    assert list(response_documents(str(tmp_path / "cache"), None)) == [[1, 2, 3, 4, 2]]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x"}\n')
    with pytest.raises(ValueError, match="prompt_ids"):
        list(response_documents(str(bad), None))
