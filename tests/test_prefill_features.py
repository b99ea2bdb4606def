"""Prefill-only features over fixed text (`training/corpus_features.py`) on the real stories260K model: the same
tensors as the generate-based path on the same tokens, aux layers and top-K against a plain forward, chat-template
masks, resuming an interrupted capture, and the store's refusals."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from hf_spec.cli.main import main
from hf_spec.training import features as features_module
from hf_spec.training.corpus import Document
from hf_spec.training.corpus_features import capture_corpus, corpus_sequences, tokenize_document
from hf_spec.training.features import FeatureStore, capture_features, capture_sequences
from hf_spec.training.responses import Conversation
from tests.conftest import STORIES

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def generated(model, tok, text: str, new: int = 24) -> Conversation:
    ids = tok(text, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=new, do_sample=False)
    return Conversation(text, ids[0].tolist(), out[0, ids.shape[1] :].tolist())


def stories_docs(count: int = 12) -> list[Document]:
    words = "Once upon a time there was a little girl who loved her dog and the big red ball".split()
    return [
        Document(
            f"toy/{i}", "toy", (("user", " ".join(words[i % 5 :])), ("assistant", " ".join(words[: 8 + i])))
        )
        for i in range(count)
    ]


def test_prefill_features_equal_generate_based_features(stories, tmp_path):
    model, tok = stories
    convs = [generated(model, tok, t) for t in ("Once upon a time", "The cat sat", "Lily had a")]
    gen = capture_features(model, convs, tmp_path / "gen", topk=6, progress=False).load_sequences()
    items = [(c.id, c.input_ids, [0] * len(c.prompt_ids) + [1] * len(c.response_ids)) for c in convs]
    pre = capture_sequences(model, items, tmp_path / "pre", topk=6, progress=False).load_sequences()
    assert len(gen) == len(pre) == 3
    for a, b in zip(gen, pre, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), key


def test_aux_layers_and_topk_match_a_plain_forward(stories, tmp_path):
    model, tok = stories
    doc = stories_docs(1)[0]
    ids, _ = tokenize_document(doc, tok, 64)
    store = capture_corpus(model, tok, [doc], tmp_path, topk=5, aux_layers=(1, 3), progress=False)
    assert store.aux_layers == [1, 3] and store.dtype == "float32"
    seq = store.load_sequences(keys=("input_ids", "aux_features", "topk_ids", "topk_logp"))[0]
    assert "features" not in seq  # only the keys asked for are read
    out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    aux = torch.cat([out.hidden_states[1][0], out.hidden_states[3][0]], dim=-1)
    assert seq["aux_features"].shape == (len(ids), 2 * model.config.hidden_size)
    assert torch.allclose(seq["aux_features"].float(), aux, atol=0.02, rtol=0.02)  # stored in bf16
    top = torch.topk(torch.log_softmax(out.logits[0].float(), -1), 5)
    assert torch.equal(seq["topk_ids"].long(), top.indices)
    assert torch.allclose(seq["topk_logp"].float(), top.values, atol=1e-2)
    assert "aux_features" not in store.load_sequences()[0]  # head trainers without aux layers skip them


def test_chat_template_masks_the_answer_up_to_its_end_of_turn(stories):
    _, tok = stories
    doc = Document(
        "d", "toy", (("user", "Tell me a story."), ("assistant", "Once upon a time."), ("user", "More"))
    )
    chat_tok = type(tok).from_pretrained(STORIES)
    chat_tok.chat_template = TEMPLATE
    ids, mask = tokenize_document(doc, chat_tok, 512)
    text = chat_tok.apply_chat_template([{"role": r, "content": c} for r, c in doc.messages], tokenize=False)
    assert ids == chat_tok(text, add_special_tokens=False).input_ids  # tokenized whole, as the target sees it
    trained = chat_tok.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert trained.replace(" ", "") == "Onceuponatime.</s>"
    plain_ids, plain_mask = tokenize_document(doc, tok, 512)  # no template: the texts joined, BOS first
    assert plain_ids[0] == tok.bos_token_id
    assert (
        tok.decode([i for i, m in zip(plain_ids, plain_mask, strict=True) if m]).strip()
        == "Once upon a time."
    )
    cut_ids, cut_mask = tokenize_document(doc, chat_tok, 5)
    assert len(cut_ids) == len(cut_mask) == 5


def test_interrupted_capture_resumes_and_skips_finished_shards(stories, tmp_path, monkeypatch):
    model, tok = stories
    docs = stories_docs()
    whole = capture_corpus(model, tok, docs, tmp_path / "whole", topk=4, shard_tokens=40, progress=False)

    def stop_after_two(store: FeatureStore) -> None:
        if len(store.shards) == 2:
            raise KeyboardInterrupt  # the job killed after its second shard

    folder = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        capture_corpus(model, tok, docs, folder, topk=4, shard_tokens=40, on_shard=stop_after_two)
    first = FeatureStore.open(folder)
    assert len(first.shards) == 2 and 0 < first.num_tokens < whole.num_tokens
    (folder / "shard-00002.safetensors.tmp").write_bytes(b"half a shard")  # torn writes never load
    (folder / "shard-00002.safetensors").write_bytes(b"written, never listed")
    assert len(FeatureStore.open(folder).load_sequences()) == len(first.done)

    forwards = []
    real = features_module.batch_features
    monkeypatch.setattr(
        features_module,
        "batch_features",
        lambda model, parts, batch, *a: forwards.extend(batch) or real(model, parts, batch, *a),
    )
    resumed = capture_corpus(model, tok, docs, folder, topk=4, shard_tokens=40, progress=False)
    assert len(forwards) == len(docs) - len(first.done)  # finished documents are not run again
    assert resumed.done == whole.done and resumed.num_tokens == whole.num_tokens
    for a, b in zip(resumed.load_sequences(), whole.load_sequences(), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)
    progress = json.loads((folder / "progress.json").read_text())
    assert progress["tokens_done"] == progress["tokens_total"] == whole.num_tokens
    assert not (folder / "capture.lock").exists()


def test_a_second_capture_into_a_live_store_is_refused(stories, tmp_path):
    model, tok = stories
    (tmp_path / "capture.lock").write_text(str(os.getppid()))  # a live process holds the store
    with pytest.raises(RuntimeError, match="being captured by process"):
        capture_corpus(model, tok, stories_docs(1), tmp_path, topk=4)
    (tmp_path / "capture.lock").write_text("999999999")  # a dead one's lock is taken over
    assert capture_corpus(model, tok, stories_docs(1), tmp_path, topk=4).num_tokens > 0


def test_store_refuses_other_settings(stories, tmp_path):
    model, tok = stories
    docs = stories_docs(2)
    capture_corpus(model, tok, docs, tmp_path, topk=4, aux_layers=(1,), progress=False)
    with pytest.raises(ValueError, match="aux layers"):
        capture_corpus(model, tok, docs, tmp_path, topk=4, aux_layers=(2,), progress=False)
    with pytest.raises(ValueError, match="aux layers must be in 0..4"):
        capture_corpus(model, tok, docs, tmp_path / "new", topk=4, aux_layers=(5,), progress=False)
    with pytest.raises(ValueError, match="in float32, not bfloat16"):
        capture_corpus(copy.deepcopy(model).to(torch.bfloat16), tok, docs, tmp_path, topk=4, aux_layers=(1,))


def test_corpus_sequences_drop_documents_with_nothing_to_train(stories):
    _, tok = stories
    docs = [Document("a", "toy", (("user", "Only a question"),)), *stories_docs(1)]
    assert [s[0] for s in corpus_sequences(docs, tok, 64)] == ["toy/0"]


def test_cli_captures_a_corpus_and_refuses_prompts_with_it(stories, tmp_path, keep_threads):
    docs = stories_docs(3)
    corpus = tmp_path / "toy.jsonl"
    corpus.write_text("".join(d.to_json() + "\n" for d in docs))
    first = len(tokenize_document(docs[0], stories[1], 1024)[0])
    args = ["data", "features", "--target", str(STORIES), "--corpus", str(corpus), "--threads", "1"]
    out = tmp_path / "store"
    log = tmp_path / "capture.log"
    assert (
        main(
            [
                *args,
                "--features-dir",
                str(out),
                "--topk",
                "3",
                "--log",
                str(log),
                "--limit-tokens",
                str(first + 1),
            ]
        )
        == 0
    )
    store = FeatureStore.open(out)
    assert store.done == ["toy/0", "toy/1"]  # the first documents up to --limit-tokens
    assert "tokens/s this run" in log.read_text()
    with pytest.raises(ValueError, match="either --prompts or --corpus"):
        main([*args, "--prompts", str(corpus)])
    with pytest.raises(ValueError, match="--aux-layers"):
        main([*args, "--features-dir", str(tmp_path / "x"), "--aux-layers", "low,high"])


def test_documents_batched_in_one_forward_store_what_one_at_a_time_stores(stories, tmp_path, keep_threads):
    docs = stories_docs(7)  # of different lengths: the batches of 3 are right-padded
    corpus = tmp_path / "toy.jsonl"
    corpus.write_text("".join(d.to_json() + "\n" for d in docs))
    args = ["data", "features", "--target", str(STORIES), "--corpus", str(corpus), "--threads", "1", "--topk", "4",
            "--aux-layers", "1,3"]  # fmt: skip
    assert main([*args, "--features-dir", str(tmp_path / "one")]) == 0
    assert main([*args, "--features-dir", str(tmp_path / "three"), "--docs-per-forward", "3"]) == 0
    one, three = FeatureStore.open(tmp_path / "one"), FeatureStore.open(tmp_path / "three")
    assert three.done == one.done == [d.id for d in docs] and three.num_tokens == one.num_tokens
    keys = ("input_ids", "response_mask", "features", "aux_features", "topk_ids", "topk_logp")
    for a, b in zip(one.load_sequences(keys=keys), three.load_sequences(keys=keys), strict=True):
        for key in ("input_ids", "response_mask", "topk_ids"):
            assert torch.equal(a[key], b[key]), key
        for key in (
            "features",
            "aux_features",
            "topk_logp",
        ):  # float32 forwards of other shapes, stored in 16 bits
            assert torch.allclose(a[key].float(), b[key].float(), atol=1e-2, rtol=1e-2), key
    with pytest.raises(ValueError, match="--docs-per-forward batches the documents of --corpus"):
        main(
            [
                "data",
                "features",
                "--target",
                str(STORIES),
                "--prompts",
                str(corpus),
                "--docs-per-forward",
                "2",
            ]
        )


def test_a_second_corpus_joins_a_store_and_its_progress_counts_its_own_tokens(stories, tmp_path):
    model, tok = stories
    first = capture_corpus(model, tok, stories_docs(6), tmp_path, topk=4, shard_tokens=40, progress=False)
    more = [Document(f"more/{d.id.split('/')[1]}", "more", d.messages) for d in stories_docs(3)]
    store = capture_corpus(model, tok, more, tmp_path, topk=4, shard_tokens=40, progress=False)
    added = store.num_tokens - first.num_tokens
    assert store.done[: len(first.done)] == first.done and len(store.done) == len(first.done) + 3
    progress = json.loads((tmp_path / "progress.json").read_text())
    assert progress["tokens_done"] == progress["tokens_total"] == added
