"""The fixed-text corpus builder (`training/corpus.py`): chunking, the readers, the refusal of evaluation prompts
(by path and by overlapping text), capture order and caps, and the committed manifests' provenance."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

from hf_spec.training.corpus import (
    Document,
    EvalFilter,
    Source,
    answers,
    build_corpus,
    chunk_text,
    documents_from_file,
    documents_from_tree,
    load_corpus,
    read_documents,
)

REPO = Path(__file__).resolve().parent.parent
SHARED_EVAL = REPO.parent / "shared" / "data" / "eval"
EVAL_QUESTION = (
    "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences"
)


def doc(i: int, text: str, source: str = "s") -> Document:
    return Document(f"{source}/{i}", source, (("user", "Explain."), ("assistant", text)))


def eval_filter(tmp_path: Path) -> EvalFilter:
    path = tmp_path / "eval" / "bench.jsonl"
    path.parent.mkdir()
    rows = [{"question_id": 1, "turns": [EVAL_QUESTION]}, {"turns": ["Name six rivers of Europe please"]}]
    rows.append({"turns": ["Hi there"], "reference": ["def add(a, b):\n    return a + b"]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return EvalFilter.from_files([path])


def test_chunk_text_cuts_at_blank_lines_and_keeps_every_character():
    short = "".join(f"paragraph {i}\n" + "word " * (i % 20) + "\n\n" for i in range(40))  # paragraphs < 200
    pieces = chunk_text(short, 200)
    assert "".join(pieces) == short and all(len(p) <= 200 for p in pieces)
    assert all(p.endswith("\n\n") for p in pieces)  # every cut at a paragraph's end
    long = "line of words\n" * 40 + "x" * 450  # one paragraph: cut at line ends, an overlong line anywhere
    pieces = chunk_text(long, 200)
    assert "".join(pieces) == long and all(len(p) <= 200 for p in pieces)
    assert all(p.endswith("\n") for p in pieces[:2])
    with pytest.raises(ValueError, match="max_chars"):
        chunk_text(long, 0)


def test_eval_filter_drops_overlapping_text(tmp_path):
    filt = eval_filter(tmp_path)
    assert filt.overlaps(f"My notes.\n{EVAL_QUESTION.upper()} and more")  # case and spacing do not hide it
    assert filt.overlaps("Sure: name six rivers of Europe, please!")  # a short question is matched whole
    assert not filt.overlaps("Compose an engaging travel blog post about a recent trip to Spain")
    assert not filt.overlaps("Hi there, how are you?")  # under 6 words: too generic to match on
    assert filt.overlaps("x = 1\ndef add(a, b):\n    return a + b\n")  # references count too
    with pytest.raises(ValueError, match="no evaluation text"):
        EvalFilter.from_files([])


@pytest.mark.skipif(not SHARED_EVAL.is_dir(), reason="needs ../shared/data/eval")
def test_the_real_evaluation_sets_are_caught():
    filt = EvalFilter.from_files(sorted(SHARED_EVAL.glob("*.jsonl")))
    for path in sorted(SHARED_EVAL.glob("*.jsonl")):
        row = json.loads(path.read_text().splitlines()[3])
        assert filt.overlaps("Some answer first.\n\n" + row["turns"][0]), path.name
    assert not filt.overlaps(
        "import os\n\ndef walk(top):\n    for root, dirs, files in os.walk(top):\n        yield root"
    )


def test_build_corpus_refuses_eval_overlap_orders_and_caps(tmp_path):
    filt = eval_filter(tmp_path)
    first = [doc(i, f"answer number {i} " * 5, "answers") for i in range(5)]
    rest = [doc(i, f"text {i} " * 40) for i in range(20)] + [doc(99, "Intro. " + EVAL_QUESTION)]
    out = tmp_path / "corpus" / "c.jsonl"
    manifest = build_corpus(
        [
            (Source("s", "MIT", "somewhere", max_tokens=300), rest),
            (Source("answers", "Apache-2.0", "the target", priority=0), first),
        ],
        filt,
        out,
    )
    docs = read_documents(out)
    assert [d.source for d in docs[:5]] == ["answers"] * 5  # priority 0 first
    assert all(d.id != "s/99" for d in docs)
    assert manifest["sources"]["s"]["dropped_eval_overlap"] == 1
    assert (
        manifest["sources"]["s"]["licence"] == "MIT"
        and manifest["sources"]["answers"]["origin"] == "the target"
    )
    kept = manifest["sources"]["s"]["characters"]
    assert 300 * 3.5 <= kept < 300 * 3.5 + 400  # the cap: about 300 tokens, one document over at most
    assert manifest["sha256"] == hashlib.sha256(out.read_bytes()).hexdigest()
    again = build_corpus(
        [
            (Source("s", "MIT", "somewhere", max_tokens=300), rest),
            (Source("answers", "x", "y", priority=0), first),
        ],
        filt,
        tmp_path / "e.jsonl",
    )
    assert again["sha256"] == manifest["sha256"]  # the same seed, the same corpus
    alone = build_corpus(
        [(Source("s", "MIT", "somewhere", max_tokens=300), rest)], filt, tmp_path / "g.jsonl"
    )
    kept_alone = {d.id for d in read_documents(tmp_path / "g.jsonl")}
    assert kept_alone == {
        d.id for d in docs if d.source == "s"
    }  # a source's sample ignores the other sources
    assert alone["sources"]["s"] == manifest["sources"]["s"]
    with pytest.raises(ValueError, match="given twice"):
        build_corpus(
            [(Source("s", "a", "b"), rest), (Source("s", "a", "b"), first)], filt, tmp_path / "f.jsonl"
        )


def test_eval_files_are_refused_as_sources(tmp_path):
    bench = tmp_path / "eval" / "questions.jsonl"
    bench.parent.mkdir()
    bench.write_text(json.dumps({"text": "a question"}) + "\n")
    with pytest.raises(ValueError, match="evaluation prompt set"):
        documents_from_file("x", bench)
    tree = tmp_path / "pkg"
    tree.mkdir()
    (tree / "humaneval_tasks.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match="evaluation prompt set"):
        documents_from_tree("x", tree, ["*.py"], "Show `{path}`{part}.")


def test_readers(tmp_path):
    tree = tmp_path / "pkg"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "mod.py").write_text("def f():\n    return 1\n\n" * 200)
    (tree / "data.py").write_text("TABLE = '" + "x" * 5000 + "'\n")  # data, not code: skipped
    (tree / "CHANGES.py").write_text("x = 1\n")
    docs = documents_from_tree("pkg", tree, ["**/*.py"], "Show `{path}`{part}.", exclude=["CHANGES"])
    assert {d.id.split("#")[0] for d in docs} == {"pkg/sub/mod.py"}
    assert docs[0].messages[0] == ("user", f"Show `sub/mod.py` (part 1 of {len(docs)}).")
    sharegpt = tmp_path / "chats.json"
    sharegpt.write_text(
        json.dumps(
            [
                {
                    "id": "a",
                    "conversations": [{"from": "human", "value": "Hi?"}, {"from": "gpt", "value": "Hello."}],
                },
                {"id": "b", "conversations": [{"from": "human", "value": "Only a question"}]},
            ]
        )
    )
    chats = documents_from_file("sg", sharegpt)
    assert chats[0].messages == (("user", "Hi?"), ("assistant", "Hello.")) and chats[0].train_roles == (
        "assistant",
    )
    assert chats[1].train_roles == ("user",)  # a first turn alone: trained as user text
    alpaca = tmp_path / "tasks.jsonl"
    alpaca.write_text(
        json.dumps({"instruction": "Add.", "instances": [{"input": "1+1", "output": "2"}]}) + "\n"
    )
    assert documents_from_file("al", alpaca)[0].messages == (("user", "Add.\n\n1+1"), ("assistant", "2"))
    text = tmp_path / "book.txt"
    text.write_text("A story.\n\n" * 10)
    assert documents_from_file("book", text)[0].messages[0][0] == "assistant"
    responses = tmp_path / "responses.jsonl"
    responses.write_text(json.dumps({"id": "a", "response": "Hello there."}) + "\n")
    assert answers("ans", responses, sharegpt)[0].messages == (("user", "Hi?"), ("assistant", "Hello there."))
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(chats[0].to_json() + "\n")
    assert load_corpus(corpus) == [chats[0]] and load_corpus(sharegpt)[0].source == "chats"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": 1, "source": "s", "messages": [["robot", "x"]]}) + "\n")
    with pytest.raises(ValueError, match="roles"):
        read_documents(bad)


@pytest.mark.parametrize("target", ["qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"])
def test_committed_manifest_names_licence_and_origin_of_every_source(target):
    manifest = json.loads((REPO / "data" / "corpus" / f"manifest-{target}.json").read_text())
    provenance = (REPO / "data" / "corpus" / "PROVENANCE.md").read_text()
    assert manifest["tokens"] >= 4_000_000
    assert manifest["tokens"] == sum(s["tokens"] for s in manifest["sources"].values())
    assert {"spec_bench_dev.jsonl", "humaneval_80.jsonl"} <= set(manifest["eval_files"])
    for name, source in manifest["sources"].items():
        assert source["licence"] and source["origin"], name
        assert f"`{name}`" in provenance, f"{name} missing from data/corpus/PROVENANCE.md"


def test_more_answers_skip_the_store_the_heldout_prompts_and_evaluation_text(tmp_path):
    from hf_spec.training.prompts import TrainPrompt
    from hf_spec.training.responses import Conversation, sampled_id
    from tests.conftest import load_script

    module = load_script("answers_corpus")

    class Tok:  # token ids -> text: each id is a letter
        def decode(self, ids, skip_special_tokens=True):
            return " ".join(chr(ord("a") + i) for i in ids)

    prompts = {p: TrainPrompt(p, (("user", f"question {p}"),)) for p in ("old", "new", "held", "evalish")}
    prompts["evalish"] = TrainPrompt("evalish", (("user", EVAL_QUESTION),))
    convs = [
        Conversation("old", [1], [0, 1]),  # greedy answer the store holds
        Conversation(sampled_id("old", 1), [1], [2, 3]),  # sampled: kept, as answers-sampled
        Conversation("new", [1], [4]),  # greedy answer to a prompt the store lacks: answers-more
        Conversation(sampled_id("held", 1), [1], [5]),  # sampled answer to a held-out prompt: refused
        Conversation("gone", [1], [6]),  # its prompt is not in the prompt files
        Conversation("empty", [1], []),
        Conversation("evalish", [1], [7]),  # the prompt overlaps an evaluation question
    ]
    prompts["empty"] = TrainPrompt("empty", (("user", "q"),))
    docs, skipped = module.answer_documents(
        convs, prompts, Tok(), have={"old", "held"}, heldout={"held"}, eval_filter=eval_filter(tmp_path)
    )
    assert [(d.id, d.source) for d in docs] == [
        ("answers-sampled/old#sample1", "answers-sampled"),
        ("answers-more/new", "answers-more"),
    ]
    assert docs[1].messages == (("user", "question new"), ("assistant", "e"))
    assert skipped == {"in store": 1, "held out": 1, "no prompt": 1, "empty": 1, "evaluation overlap": 1}


def test_build_script_names_a_debian_pin_the_archive_no_longer_serves(monkeypatch, tmp_path):
    """When the pinned Debian version is gone from the package lists, the error lists what they name instead and
    where its .deb would go; a listed version that fails to download points at apt-get's own message."""
    spec = importlib.util.spec_from_file_location("build_corpus", REPO / "scripts" / "build_corpus.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    madison = (
        " python3.11-doc | 3.11.2-6+deb12u10 | http://deb.debian.org/debian-security bookworm-security/main\n"
    )
    monkeypatch.setattr(
        script.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, stdout=madison, stderr="")
    )
    deb = tmp_path / "python3.11-doc_3.11.2-6+deb12u9_all.deb"
    gone = script.apt_download_error("python3.11-doc", "3.11.2-6+deb12u9", deb)
    assert "(they name 3.11.2-6+deb12u10)" in gone and "no longer serves it" in gone and str(deb) in gone
    listed = script.apt_download_error("python3.11-doc", "3.11.2-6+deb12u10", deb)
    assert listed == "apt-get could not download python3.11-doc=3.11.2-6+deb12u10 (its message is above)"
