"""Compiled rounds without dynamo's module guards (`hf_spec.engine.target.module_guards`): the structure token
changes with what a trace reads and with nothing else, a model changed between generations compiles again and
stays exact, and no module changes within a generation, where the token is taken once."""

from __future__ import annotations

import sys

import pytest
import torch

from hf_spec.engine.target import module_guards
from hf_spec.engine.target.module_guards import GuardedCompile, can_skip_module_guards, structure_token
from tests.conftest import make_tiny_model, prompt_ids
from tests.test_compiled import FAST, compiled

pytestmark = pytest.mark.skipif(
    not can_skip_module_guards(), reason="this torch cannot filter a compile call's guards"
)


def test_the_token_follows_what_a_trace_reads():
    model = make_tiny_model("llama")
    token = structure_token([model])
    assert structure_token([model]) == token
    # what no trace reads: weights changed in place or replaced by same-shaped ones, hf-spec's and generate's
    # bookkeeping on the model
    with torch.no_grad():
        model.lm_head.weight.mul_(2)
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    model.__dict__["_hf_spec_compiled_verifier"] = object()
    model.generation_config.max_new_tokens = 7
    assert structure_token([model]) == token
    # what a trace reads
    norm = model.model.norm
    handle = norm.register_forward_hook(lambda m, args, out: out * 2)
    assert structure_token([model]) != token
    handle.remove()
    assert structure_token([model]) == token
    model.train()
    assert structure_token([model]) != token
    model.eval()
    norm.forward = lambda x: x  # a forward patched on the instance
    assert structure_token([model]) != token
    del norm.forward
    assert structure_token([model]) == token
    model.config._attn_implementation = "eager"
    assert structure_token([model]) != token
    model.config._attn_implementation = "sdpa"
    assert structure_token([model]) == token
    norm.weight = torch.nn.Parameter(torch.ones(norm.weight.shape[0] * 2))
    assert structure_token([model]) != token


def test_a_model_changed_between_generations_compiles_again_and_stays_exact():
    model = make_tiny_model("llama")
    ids = prompt_ids(14, seed=1)
    dec = compiled("pld:3", model)

    def both() -> None:
        ref = model.generate(ids, max_new_tokens=24, do_sample=False)
        out = model.generate(
            ids, max_new_tokens=24, do_sample=False, compile_config=FAST, custom_generate=dec
        )
        assert torch.equal(out, ref)
        assert dec.last_stats.compiled_rounds > 0

    both()
    guarded = model.__dict__["_hf_spec_compiled_verifier"]._forward
    assert guarded.skips_guards and len(guarded._compiled) == 1
    plain = model.generate(ids, max_new_tokens=24, do_sample=False)
    handle = model.model.norm.register_forward_hook(lambda m, args, out: out.flip(-1))
    assert not torch.equal(model.generate(ids, max_new_tokens=24, do_sample=False), plain)
    both()  # the hook is in the compiled rounds too
    assert len(guarded._compiled) == 2
    handle.remove()
    both()  # back to the first graphs
    assert len(guarded._compiled) == 2


# eagle3 (a head's steps and the target) by default; the others take 13-16 s each
@pytest.mark.parametrize(
    "spec",
    [
        "eagle3",
        pytest.param("lyanna", marks=pytest.mark.slow),
        pytest.param("hispec", marks=pytest.mark.slow),
        pytest.param("early-exit:2", marks=pytest.mark.slow),
    ],
)
def test_modules_look_the_same_at_every_compiled_call_of_a_generation(monkeypatch, spec):
    """The token is taken at a generation's first compiled call: every later call of that generation must find the
    modules as they were then (hf-spec's own patches, as a head's packed linears, are the same at each call)."""
    model = make_tiny_model("llama")
    checked = []
    real = GuardedCompile.current

    def current(self):
        fn = real(self)
        if self.skips_guards:
            assert structure_token(self.modules) == self.token
            checked.append(self.fn.__name__)
        return fn

    monkeypatch.setattr(GuardedCompile, "current", current)
    dec = compiled(spec, model)
    ids = prompt_ids(14, seed=2)
    for _ in range(2):
        model.generate(ids, max_new_tokens=24, do_sample=False, compile_config=FAST, custom_generate=dec)
    assert "_full" in checked  # the drafter's steps
    assert ("_step" in checked) == (spec != "hispec")  # the verification (hispec continues its own forward)


def test_guards_stay_where_they_cannot_be_skipped(monkeypatch):
    """No modules named, or no filtering in this torch: dynamo keeps every guard (one compiled function)."""
    from hf_spec.engine.target.compiled import CompileSettings

    cpu = torch.device("cpu")
    assert not GuardedCompile(lambda x: x + 1, CompileSettings(backend="aot_eager"), cpu).skips_guards
    model = make_tiny_model("llama")
    monkeypatch.setattr(module_guards, "can_skip_module_guards", lambda: False)
    guarded = GuardedCompile(lambda x: x + 1, CompileSettings(backend="aot_eager"), cpu, modules=(model,))
    assert not guarded.skips_guards
    guarded.current()
    assert guarded.token == 0


def test_cpu_rounds_compile_with_the_cpp_wrapper_unless_told_otherwise(monkeypatch):
    """On CPU hf-spec's compiled functions ask inductor for its C++ wrapper built apart from the kernels; a caller's
    own options win, and `HF_SPEC_CPP_WRAPPER=0` leaves inductor's default."""
    from hf_spec.engine.target.compiled import CompileSettings

    if not sys.platform.startswith("linux"):
        assert module_guards.cpu_wrapper_options() == {}
        return
    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: seen.append(kwargs.get("options") or {}) or fn)
    wrapper = {"cpp_wrapper": True, "cpp_wrapper_build_separate": True}
    assert module_guards.cpu_wrapper_options() == wrapper

    def options_of(settings: CompileSettings) -> dict:
        GuardedCompile(lambda: None, settings, torch.device("cpu"), (torch.nn.Linear(2, 2),)).current()
        return {k: v for k, v in seen[-1].items() if k in wrapper}

    assert options_of(CompileSettings()) == wrapper
    assert options_of(CompileSettings(options={"cpp_wrapper": False})) == {
        "cpp_wrapper": False,
        "cpp_wrapper_build_separate": True,
    }
    monkeypatch.setenv("HF_SPEC_CPP_WRAPPER", "0")
    assert module_guards.cpu_wrapper_options() == {}
    assert options_of(CompileSettings()) == {}
