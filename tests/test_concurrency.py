"""One `SpeculativeDecoder` shared by several threads on one model: every registered method, every thread's output
equal to what the same call gives alone; the drafter built by two threads at once; `last_stats` per thread; the
transformers assisted loop and saved `custom_generate` recipes under threads."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hf_spec import SpeculativeDecoder
from hf_spec.core.registry import list_methods
from hf_spec.datastore import DatastoreRecipe, TokenIndex, save_datastore
from hf_spec.heads.hub import save_head_folder
from hf_spec.integrations import enable_assistant
from hf_spec.methods.eagle import EagleConfig
from hf_spec.methods.eagle.modeling import EagleHeadConfig, EagleHeadModel
from hf_spec.methods.hispec.config import HiSpecConfig
from hf_spec.methods.lyanna.config import LyannaConfig
from hf_spec.methods.lyanna.modeling import LyannaHeadConfig, LyannaHeadModel
from hf_spec.methods.postuse import PostUseConfig
from hf_spec.methods.retrieval.config import RetrievalConfig
from hf_spec.methods.talon.config import TalonConfig
from tests.conftest import make_tiny_model, prompt_ids

THREADS = 3
NEW = 20


def _head(cls, config_cls, model, folder: Path, recipe, **fields) -> str:
    torch.manual_seed(0)
    head = cls(config_cls.for_target(model, 64, **fields))
    head.d2t.copy_(torch.arange(64) + (model.config.vocab_size - 64))
    save_head_folder(head.attach_target(model).eval(), folder, recipe, "card")
    return str(folder)


def _datastore(model, folder: Path) -> str:
    docs = [
        model.generate(prompt_ids(8, seed=s), max_new_tokens=40, do_sample=False)[0].tolist()
        for s in (11, 12)
    ]
    save_datastore(
        folder, TokenIndex.from_documents(docs), DatastoreRecipe(), {"format": 1, "tokenizer": None}
    )
    return str(folder)


def _draft_model(folder: Path) -> str:
    make_tiny_model("llama", seed=3).save_pretrained(folder)  # weights and config only: no tokenizer files
    return str(folder)


def _eagle3(model, folder: Path) -> str:
    from tests.eagle3_checkpoints import write_eagle3_checkpoint

    write_eagle3_checkpoint(folder, model, "sglang", layer_ids=[0, 1, 2])
    return str(folder)


# method -> the recipe its case decodes with, built from the target and a scratch folder
CASES: dict[str, Callable] = {
    "pld": lambda m, d: "pld",
    "oracle": lambda m, d: "oracle:4",
    "early-exit": lambda m, d: "early-exit:2",
    "hispec": lambda m, d: HiSpecConfig(
        draft_layer=1, verify_layer=2, num_draft_tokens=2, num_buffer_tokens=4
    ),
    "draft-model": lambda m, d: f"draft-model:{_draft_model(d / 'draft')}",
    "retrieval": lambda m, d: RetrievalConfig(datastore_path=_datastore(m, d / "ds"), max_nodes=8),
    "eagle": lambda m, d: EagleConfig(
        head=_head(EagleHeadModel, EagleHeadConfig, m, d / "eagle", EagleConfig(head=".")), depth=3, topk=2
    ),
    "lyanna": lambda m, d: LyannaConfig(
        head=_head(
            LyannaHeadModel, LyannaHeadConfig, m, d / "lyanna", LyannaConfig(head="."), token_info_rank=4
        )
    ),
    "eagle3": lambda m, d: f"eagle3:{_eagle3(m, d / 'eagle3')}",
    "postuse": lambda m, d: PostUseConfig(drafter="early-exit:2"),  # reuse at both sides and Pre-cut
    "talon": lambda m, d: TalonConfig(
        retrieval={"datastore_path": _datastore(m, d / "ds")}, drafter="early-exit:2"
    ),
    "talon-async": lambda m, d: TalonConfig(
        retrieval=None, drafter="early-exit:2", schedule={"mode": "async"}
    ),
    "postuse-eagle": lambda m, d: PostUseConfig(
        drafter=EagleConfig(
            head=_head(EagleHeadModel, EagleHeadConfig, m, d / "eagle", EagleConfig(head="."))
        ),
    ),
}


VARIANT_OF = {"talon-async": "talon", "postuse-eagle": "postuse"}  # cases that are another mode of a method


@pytest.fixture(scope="module")
def target():
    return make_tiny_model("llama")


def inputs(i: int) -> dict:
    """Thread `i`'s call: prompts of different lengths; thread 0 decodes a left-padded batch of two."""
    ids = prompt_ids(9 + 3 * i, seed=20 + i)
    if i:
        return {"input_ids": ids}
    other = prompt_ids(6, seed=40)
    batch = torch.cat([ids, torch.cat([torch.zeros(1, 3, dtype=torch.long), other], dim=1)])
    mask = torch.ones_like(batch)
    mask[1, :3] = 0
    return {"input_ids": batch, "attention_mask": mask, "pad_token_id": 0}


def in_threads(fn: Callable[[int], object], n: int = THREADS) -> list:
    """`fn(i)` on `n` threads started together; the first error is raised here."""
    start = threading.Barrier(n)
    results, errors = [None] * n, []

    def work(i: int) -> None:
        try:
            start.wait()
            results[i] = fn(i)
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(err)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def test_every_registered_method_has_a_concurrency_case():
    assert set(list_methods()) <= {VARIANT_OF.get(case, case) for case in CASES}


@pytest.mark.parametrize("case", sorted(CASES))
def test_concurrent_generations_with_one_decoder_give_each_thread_its_own_output(case, target, tmp_path):
    """A server keeps one decoder per model and serves requests on threads: each output is the one the same call
    gives alone, for every method; both threads build the drafter at once at the first call."""
    recipe = CASES[case](target, tmp_path)
    kwargs = dict(max_new_tokens=NEW, do_sample=False)
    alone = SpeculativeDecoder(recipe)
    want = [target.generate(**inputs(i), **kwargs, custom_generate=alone) for i in range(THREADS)]
    shared = SpeculativeDecoder(recipe)  # nothing built yet: the threads build it together
    for _ in range(2):  # the second time the drafters of the first are lent again
        got = in_threads(lambda i: target.generate(**inputs(i), **kwargs, custom_generate=shared))
        for i in range(THREADS):
            assert torch.equal(got[i], want[i]), (case, i)


def test_last_stats_are_per_thread(target):
    dec = SpeculativeDecoder("pld")
    lengths = in_threads(
        lambda i: (
            target.generate(prompt_ids(8), max_new_tokens=4 + 8 * i, do_sample=False, custom_generate=dec),
            dec.last_stats.new_tokens,
        )[1]
    )
    assert lengths == [4 + 8 * i for i in range(THREADS)]
    assert dec.last_stats.new_tokens in lengths  # a thread that made no call sees the latest call of any


def test_the_first_drafter_is_used_alone_and_copies_share_loaded_parts(target, tmp_path):
    dec = SpeculativeDecoder(CASES["eagle"](target, tmp_path))
    first = dec.drafter_for(target)
    with dec.lend(target, 3) as drafters:
        assert drafters[0] is first and len({id(d) for d in drafters}) == 3
        assert all(d.head is first.head for d in drafters)  # the loaded head is shared, not copied
        with dec.lend(target) as (other,):
            assert other not in drafters  # lent drafters are not lent twice
    with dec.lend(target) as (again,):
        assert again is first


@pytest.mark.parametrize("case", ["talon", "talon-async"])
def test_talon_copies_share_the_exit_lm_and_datastore(case, target, tmp_path):
    """A copy of a Talon drafter keeps its own chain cache and round state but not a second exit LM."""
    dec = SpeculativeDecoder(CASES[case](target, tmp_path))
    with dec.lend(target, 2) as (first, copy):
        assert copy.chain is not first.chain and copy.chain.head is first.chain.head
        assert (
            copy.chain.quantized.keys() == first.chain.quantized.keys()
        )  # packed weights shared, not repacked
        assert all(copy.chain.quantized[k] is v for k, v in first.chain.quantized.items())
        assert copy.rounds is not first.rounds
        if first.retriever is not None:
            assert copy.retriever is not first.retriever
            assert copy.retriever.datastore is first.retriever.datastore


def test_assisted_loop_of_transformers_under_threads(target):
    dec = SpeculativeDecoder("pld")
    want = [
        target.generate(prompt_ids(9 + i, seed=i), max_new_tokens=NEW, do_sample=False)
        for i in range(THREADS)
    ]
    with enable_assistant(target, loop="transformers"):
        got = in_threads(
            lambda i: target.generate(
                prompt_ids(9 + i, seed=i), max_new_tokens=NEW, do_sample=False, assistant_model=dec
            )
        )
        assert "_get_candidate_generator" in target.__dict__  # installed once while enabled
    assert "_get_candidate_generator" not in target.__dict__
    for i in range(THREADS):
        assert torch.equal(got[i], want[i])
