"""`retrieval` and `talon`: lossless greedy and sampling, async == sync, no leaked thread on errors."""

from __future__ import annotations

import threading

import pytest
import torch

from hf_spec import SpeculativeDecoder
from hf_spec.datastore import DatastoreRecipe, TokenIndex
from hf_spec.datastore.store import save_datastore
from hf_spec.methods.retrieval.config import RetrievalConfig
from hf_spec.methods.talon.config import TalonConfig
from hf_spec.methods.talon.drafter import TalonDrafter
from hf_spec.methods.talon.overlap import THREAD_PREFIX
from tests.conftest import make_tiny_model, prompt_ids
from tests.stats import sampled_marginals_pvalues
from tests.test_sampling import SampledTreeDrafter, V


def tiny_datastore(model, folder, seeds=(11, 12, 13, 14), length=60) -> str:
    """The model's own greedy continuations of other prompts (a target-response source)."""
    docs = [
        model.generate(prompt_ids(8, seed=s), max_new_tokens=length, do_sample=False)[0].tolist()
        for s in seeds
    ]
    save_datastore(
        folder, TokenIndex.from_documents(docs), DatastoreRecipe(), {"format": 1, "tokenizer": None}
    )
    return str(folder)


def talon(path: str, **kw) -> TalonConfig:
    retrieval = {"datastore_path": path, "num_draft_tokens": 6, "max_nodes": 8, "weak_nodes": 4}
    return TalonConfig(retrieval=retrieval, **{"drafter": "early-exit:3", **kw})


def leaked() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)]


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("talon")


def test_greedy_equals_generate(tiny_model, store_dir, seed=1):
    path = tiny_datastore(tiny_model, store_dir / f"{tiny_model.config.model_type}")
    ids = prompt_ids(14, seed=seed)
    ref = tiny_model.generate(ids, max_new_tokens=40, do_sample=False)
    configs = [
        RetrievalConfig(datastore_path=path),
        RetrievalConfig(datastore_path=path, search_context=False, max_nodes=24, strong_match=1),
        talon(path),
        talon(path, adaptive=False),
        talon(path, mode="async", adaptive=False),
        talon(path, drafter="pld"),
        TalonConfig(retrieval=None, drafter="early-exit:2"),
    ]
    for config in configs:
        dec = SpeculativeDecoder(config)
        out = tiny_model.generate(ids, max_new_tokens=40, do_sample=False, custom_generate=dec)
        assert torch.equal(out, ref), config
        assert dec.last_stats.new_tokens == ref.shape[1] - ids.shape[1]
    assert not leaked()


def test_retrieval_finds_the_datastore(tiny_llama, store_dir):
    """A prompt that is a prefix of a datastore document: retrieval drafts its continuation (tau >> 1)."""
    path = tiny_datastore(tiny_llama, store_dir / "prefix", seeds=(21,), length=60)
    ids = prompt_ids(8, seed=21)
    dec = SpeculativeDecoder(RetrievalConfig(datastore_path=path, search_context=False))
    tiny_llama.generate(ids, max_new_tokens=40, do_sample=False, custom_generate=dec)
    assert dec.last_stats.tau > 4


def test_async_output_equals_sync_output(tiny_llama, store_dir):
    path = tiny_datastore(tiny_llama, store_dir / "async")
    outs = {}
    for mode in ("sync", "async"):
        dec = SpeculativeDecoder(talon(path, mode=mode, adaptive=False, drafter="early-exit:3"))
        drafter = dec.drafter_for(tiny_llama)
        outs[mode] = [
            tiny_llama.generate(
                prompt_ids(12, seed=s), max_new_tokens=48, do_sample=False, custom_generate=dec
            )
            for s in (3, 4, 5)
        ]
        if mode == "async":  # the worker really drafted ahead, and some of those blocks were used
            assert drafter.rounds["ahead_kept"] + drafter.rounds["ahead_dropped"] > 0
    for a, b in zip(outs["sync"], outs["async"], strict=True):
        assert torch.equal(a, b)
    assert not leaked()


class Boom(Exception):
    pass


class RaisingStreamer:
    def __init__(self, after: int, exc: type[BaseException]) -> None:
        self.calls, self.after, self.exc = 0, after, exc

    def put(self, value) -> None:
        self.calls += 1
        if self.calls > self.after:
            raise self.exc("stop")

    def end(self) -> None:
        pass


@pytest.mark.parametrize("exc", [Boom, KeyboardInterrupt])
def test_no_leaked_thread_on_error_or_interrupt(tiny_llama, exc):
    threads = torch.get_num_threads()
    dec = SpeculativeDecoder(TalonConfig(retrieval={}, drafter="early-exit:3", mode="async", adaptive=False))
    with pytest.raises(exc):
        tiny_llama.generate(
            prompt_ids(12),
            max_new_tokens=40,
            do_sample=False,
            custom_generate=dec,
            streamer=RaisingStreamer(3, exc),
        )
    assert not leaked() and torch.get_num_threads() == threads
    # the decoder still works afterwards
    ref = tiny_llama.generate(prompt_ids(12), max_new_tokens=20, do_sample=False)
    assert torch.equal(
        tiny_llama.generate(prompt_ids(12), max_new_tokens=20, do_sample=False, custom_generate=dec), ref
    )


def test_worker_error_is_raised_not_hung(tiny_llama, monkeypatch):
    dec = SpeculativeDecoder(TalonConfig(retrieval=None, drafter="early-exit:3", mode="async"))
    drafter = dec.drafter_for(tiny_llama)
    calls = {"n": 0}
    step = drafter.chain._step

    def flaky():
        calls["n"] += 1
        if calls["n"] > 4 and threading.current_thread().name.startswith(THREAD_PREFIX):
            raise Boom("draft failed")
        step()

    monkeypatch.setattr(drafter.chain, "_step", flaky)
    with pytest.raises(Boom):
        tiny_llama.generate(prompt_ids(12), max_new_tokens=40, do_sample=False, custom_generate=dec)
    assert not leaked()


def test_thread_counts_are_restored(tiny_llama):
    before = torch.get_num_threads()
    dec = SpeculativeDecoder(
        TalonConfig(retrieval=None, drafter="early-exit:3", mode="async", verify_threads=1)
    )
    tiny_llama.generate(prompt_ids(12), max_new_tokens=30, do_sample=False, custom_generate=dec)
    assert torch.get_num_threads() == before


def test_bad_configs_are_clear_errors(tiny_llama):
    with pytest.raises(ValueError, match="both halves are off"):
        TalonConfig(retrieval=None, drafter="")
    with pytest.raises(ValueError, match="mode"):
        TalonConfig(mode="parallel")
    with pytest.raises(ValueError, match="own state"):
        TalonDrafter(TalonConfig(drafter="pld", mode="async"), tiny_llama)
    with pytest.raises(ValueError, match="unknown retrieval config keys"):
        TalonDrafter(TalonConfig(retrieval={"nodes": 3}), tiny_llama)
    with pytest.raises(FileNotFoundError, match="no datastore"):
        SpeculativeDecoder(RetrievalConfig(datastore_path="/nonexistent/ds")).drafter_for(tiny_llama)
    with pytest.raises(ValueError, match="min_match"):
        RetrievalConfig(min_match=5, max_match=2)


@pytest.mark.parametrize("async_mode", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_fused_tree_sampling_matches_plain_sampling(tmp_path, async_mode):
    """A sampled model tree (reporting q) fused with a deterministic retrieval tree that often proposes the same
    tokens: per-position distributions must equal plain sampling's (chi-square)."""
    target = make_tiny_model("llama", seed=11, vocab_size=V, layers=2, temperature=2.0)
    draft = make_tiny_model("llama", seed=12, vocab_size=V, layers=1, temperature=2.0)
    prompt = torch.tensor([[1, 5, 7, 3, 9]])
    docs = [target.generate(prompt, max_new_tokens=6, do_sample=True, top_k=0)[0].tolist() for _ in range(30)]
    save_datastore(
        tmp_path / "ds", TokenIndex.from_documents(docs), DatastoreRecipe(), {"format": 1, "tokenizer": None}
    )
    retrieval = {
        "datastore_path": str(tmp_path / "ds"),
        "num_draft_tokens": 3,
        "max_nodes": 4,
        "weak_nodes": 4,
    }
    if (
        async_mode
    ):  # the early-exit chain drafts ahead on the worker; retrieval fused with it (all deterministic)
        drafter = TalonDrafter(
            TalonConfig(retrieval=retrieval, drafter="early-exit:1", mode="async", adaptive=False), target
        )
    else:
        drafter = TalonDrafter(TalonConfig(retrieval=retrieval, drafter="pld", adaptive=False), target)
        drafter.sub = SampledTreeDrafter(target, draft, width=2)  # any drafter that reports its q
    pvalues, accepted = sampled_marginals_pvalues(
        target, lambda: SpeculativeDecoder(drafter), n=800, seed=2025
    )
    assert accepted > 800 * 0.3
    assert min(pvalues) > 1e-3, pvalues
    assert not leaked()
