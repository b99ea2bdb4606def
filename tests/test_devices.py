"""The drafters on a device other than the CPU, without a GPU: torch's lazy-tensor backend (TorchScript, run on
this CPU) stands in for an accelerator. An op mixing one of its tensors with a CPU tensor raises, as it would with
a CUDA tensor, so a mask, index or head left on the CPU fails here instead of on a user's GPU."""

from __future__ import annotations

import contextlib

import pytest
import torch

from hf_spec import SpeculativeDecoder
from hf_spec.methods.draft_model.config import DraftModelConfig
from hf_spec.methods.draft_model.drafter import DraftModelDrafter
from hf_spec.methods.eagle import EagleConfig, EagleDrafter
from hf_spec.methods.eagle.modeling import EagleHeadConfig, EagleHeadModel
from hf_spec.methods.lyanna import LyannaConfig, LyannaDrafter
from hf_spec.methods.lyanna.modeling import LyannaHeadConfig, LyannaHeadModel
from tests.conftest import make_tiny_model, prompt_ids

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def lazy_device() -> str:
    try:
        import torch._lazy.ts_backend

        with contextlib.suppress(RuntimeError):  # initialised once per process
            torch._lazy.ts_backend.init()
        torch.ones(1, device="lazy") + torch.ones(1, device="lazy")
    except Exception as err:  # noqa: BLE001 - a torch build without the lazy backend
        pytest.skip(f"torch's lazy-tensor backend is unavailable: {err}")
    return "lazy"


def to_lazy(model, device: str):
    """`model` on the lazy device, its graphs cut after every layer (else they grow with the KV cache all
    generation long: the backend only runs a graph when a value is read)."""
    import torch._lazy

    for layer in model.model.layers:
        layer.register_forward_hook(lambda *_: torch._lazy.mark_step())
    return model.to(device)


@pytest.fixture(scope="module")
def on_device(lazy_device):
    """A tiny llama on the CPU (for references and for building heads) and its copy on the stand-in device."""
    cpu = make_tiny_model("llama", seed=0)
    moved = to_lazy(make_tiny_model("llama", seed=0), lazy_device)
    return cpu, moved


def check_greedy(cpu, moved, spec, seed: int = 1, new_tokens: int = NEW_TOKENS) -> None:
    ids = prompt_ids(12, seed=seed)
    ref = cpu.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    out = moved.generate(
        ids.to(moved.device),
        max_new_tokens=new_tokens,
        do_sample=False,
        custom_generate=SpeculativeDecoder(spec),
    )
    assert out.device == moved.device
    assert torch.equal(out.cpu(), ref), spec


@pytest.mark.parametrize(
    "spec", ["pld", "early-exit:2", "retrieval", "talon", "hispec", "postuse:early-exit:2"]
)
def test_methods_off_the_cpu(on_device, spec):
    check_greedy(*on_device, spec)


def test_qwen2_with_tied_embeddings_off_the_cpu(lazy_device):
    """The main target's shape: Qwen2 (attention biases), LM head tied to the embedding (the lazy backend's move
    unties the two parameters; their values stay equal)."""
    from transformers import AutoModelForCausalLM

    from tests.conftest import tiny_config

    config = tiny_config("qwen2")
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    cpu = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    moved = to_lazy(AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval(), lazy_device)
    moved.load_state_dict(cpu.state_dict())
    for spec in ("early-exit:2", "talon", "hispec"):
        check_greedy(cpu, moved, spec)


def test_method_options_off_the_cpu(on_device):
    """Post-use's cache at drafter and target, Talon's best-of switch with the retrieval extension, sampling."""
    from hf_spec.methods.postuse import PostUseConfig, PostUseDrafter
    from hf_spec.methods.talon import TalonConfig, TalonDrafter

    cpu, moved = on_device
    for seed in (1, 3):
        fixed = PostUseConfig(
            drafter="early-exit:2", precut=None, draft_length=2, cache={"admit_prompt": True}
        )
        check_greedy(cpu, moved, PostUseDrafter(fixed, moved), seed=seed)
        check_greedy(cpu, moved, PostUseDrafter(PostUseConfig(drafter="early-exit:2"), moved), seed=seed)
        talon = TalonConfig(switch={"rule": "best"}, fusion={"extend_tokens": 3})
        check_greedy(cpu, moved, TalonDrafter(talon, moved), seed=seed)
    ids = prompt_ids(12, seed=2).to(moved.device)
    for spec in ("early-exit:2", "talon", "hispec"):
        decoder = SpeculativeDecoder(spec)
        out = moved.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=True, custom_generate=decoder)
        assert out.device == moved.device and out.shape[1] == ids.shape[1] + NEW_TOKENS


@pytest.mark.parametrize("kind", ["eagle", "lyanna"])
def test_heads_loaded_from_folders_follow_the_target(on_device, tmp_path, kind):
    """A head folder loads on the CPU; attaching it to the target moves it (and the drafter's masks, ids and
    positions are built where the head is). Small trees: every new tree shape costs the lazy backend a compile."""
    cpu, moved = on_device
    torch.manual_seed(0)
    if kind == "eagle":
        head = EagleHeadModel(EagleHeadConfig.for_target(cpu, 64))
        head.init_layer_from(cpu)
        head.save_pretrained(tmp_path)
        drafter = EagleDrafter(EagleConfig(depth=2, topk=2, total_tokens=3, head=str(tmp_path)), moved)
    else:
        head = LyannaHeadModel(LyannaHeadConfig.for_target(cpu, 64, token_info_rank=8))
        head.save_pretrained(tmp_path)
        drafter = LyannaDrafter(LyannaConfig(depth=2, topk=2, budget=3, head=str(tmp_path)), moved)
    assert drafter.head.device == moved.device
    check_greedy(cpu, moved, drafter, new_tokens=8)


def test_batches_off_the_cpu(on_device):
    cpu, moved = on_device
    ids = torch.zeros(2, 10, dtype=torch.long)
    ids[0], ids[1, 4:] = prompt_ids(10, seed=2)[0], prompt_ids(6, seed=3)[0]
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    kw = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    ref = cpu.generate(ids, attention_mask=mask, **kw)
    out = moved.generate(
        ids.to(moved.device),
        attention_mask=mask.to(moved.device),
        custom_generate=SpeculativeDecoder("pld"),
        **kw,
    )
    assert torch.equal(out.cpu(), ref)


def test_a_draft_model_on_another_device_is_refused(on_device):
    cpu, moved = on_device
    with pytest.raises(ValueError, match="move the draft model to the target's device"):
        DraftModelDrafter(DraftModelConfig(), moved, draft_model=make_tiny_model("llama", seed=5, layers=2))


def test_training_data_and_losses_where_the_target_is(lazy_device, tmp_path):
    """Answers (batched, left-padded), captured features and a head's training loss with the target off the CPU
    equal those on the CPU. (Training steps themselves are not run here: the lazy backend fails on a double
    scalar inside the backward graph, a limit of that backend, not of CUDA.)"""
    from hf_spec.training.batches import collate
    from hf_spec.training.eagle import EagleTrainConfig, head_step
    from hf_spec.training.features import capture_features
    from hf_spec.training.responses import Conversation, _continue_batch
    from hf_spec.training.trainer import batch_on

    def run(device: str):
        model = make_tiny_model("llama", temperature=16.0).to(device)
        prompts = [Conversation(f"c{i}", prompt_ids(6 + i, seed=100 + i)[0].tolist(), []) for i in range(3)]
        convs = _continue_batch(model, prompts, 10, pad_id=0, eos_ids=[2])
        seqs = capture_features(model, convs, tmp_path / device, topk=4, progress=False).load_sequences()
        torch.manual_seed(0)
        head = EagleHeadModel(EagleHeadConfig.for_target(model, 96)).attach_target(model)
        t2d = torch.arange(96, device=model.device)
        loss, accs, _ = head_step(
            head, batch_on(collate(seqs, 64), model.device), EagleTrainConfig(topk=2), t2d
        )
        return convs, seqs, float(loss.detach()), accs

    convs, seqs, loss, accs = run("cpu")
    convs_dev, seqs_dev, loss_dev, accs_dev = run(lazy_device)
    assert [c.response_ids for c in convs_dev] == [c.response_ids for c in convs]
    assert all(torch.equal(a["topk_ids"], b["topk_ids"]) for a, b in zip(seqs, seqs_dev, strict=True))
    assert loss_dev == pytest.approx(loss, rel=1e-4) and accs_dev == pytest.approx(accs)


def test_exit_heads_where_the_target_is(lazy_device, tmp_path):
    """Exit-head features and evaluation with the target off the CPU equal those on the CPU; a saved heads folder
    follows the target into `early-exit` (with its draft vocabulary) and `hispec`."""
    from hf_spec.methods.early_exit import EarlyExitConfig, EarlyExitDrafter
    from hf_spec.methods.early_exit.exit_heads import ExitHeads
    from hf_spec.methods.hispec.config import HiSpecConfig
    from hf_spec.methods.hispec.drafter import HiSpecDrafter
    from hf_spec.training.exits import evaluate_heads, extract_features, train_heads

    cpu = make_tiny_model("llama", layers=6)
    moved = to_lazy(make_tiny_model("llama", layers=6), lazy_device)
    seqs = [(cpu.generate(prompt_ids(8, seed=s), max_new_tokens=12, do_sample=False)[0], 7) for s in range(3)]
    feats = extract_features(cpu, seqs, [2, 4], top_k=8)
    feats_dev = extract_features(moved, seqs, [2, 4], top_k=8)
    assert torch.equal(feats_dev.top_ids, feats.top_ids)
    heads = ExitHeads.for_target(cpu, [2, 4], rank=4)
    train_heads(cpu, heads, feats, steps=5, batch_size=16, lr=1e-2, negatives=8)
    heads.set_draft_vocab(torch.arange(64))
    heads.save_pretrained(tmp_path)
    quality = evaluate_heads(cpu, heads, feats)
    quality_dev = evaluate_heads(moved, ExitHeads.from_pretrained(tmp_path, moved).to(lazy_device), feats_dev)
    assert quality_dev[4]["agreement"] == quality[4]["agreement"]
    assert quality_dev[4]["loss"] == pytest.approx(quality[4]["loss"], rel=1e-4)

    ee = EarlyExitConfig(exit_layer=4, num_draft_tokens=2, exit_heads=str(tmp_path), draft_vocab=True)
    check_greedy(cpu, moved, EarlyExitDrafter(ee, moved))
    hs = HiSpecConfig(
        draft_layer=2, verify_layer=4, num_draft_tokens=2, num_buffer_tokens=2, exit_heads=str(tmp_path)
    )
    check_greedy(cpu, moved, HiSpecDrafter(hs, moved))


def test_cli_device_option(capsys, monkeypatch, lazy_device):
    """`--device auto` is the CPU without a GPU; a device torch cannot use is a one-line error, not a traceback."""
    from hf_spec.cli.common import resolve_device, resolve_dtype
    from hf_spec.cli.main import console_main
    from tests.conftest import STORIES

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_dtype("float32", "cuda") == torch.float32
    with pytest.raises(ValueError, match="torch sees no CUDA device"):
        resolve_device("cuda:0")
    with pytest.raises(ValueError, match="not a device torch knows"):
        resolve_device("gpu7")
    argv = ["generate", "--target", str(STORIES), "--method", "pld", "--prompt", "Once", "--dtype", "auto"]
    argv += ["--device"]
    assert console_main([*argv, "cuda"]) != 0
    assert "torch sees no CUDA device" in capsys.readouterr().err
    assert console_main([*argv, "cpu", "--max-new-tokens", "8", "--threads", "1"]) == 0
    assert console_main([*argv, lazy_device, "--max-new-tokens", "8", "--threads", "1"]) == 0
    assert "identical to plain greedy generate: yes" in capsys.readouterr().out


def test_bench_off_the_cpu(lazy_device, tmp_path):
    import json

    from hf_spec.cli.main import main
    from tests.conftest import STORIES

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"question_id": 1, "category": "writing", "turns": ["Once upon a time, Tom"]}) + "\n"
    )
    argv = ["bench", "--target", str(STORIES), "--methods", "ar,pld", "--prompts", str(prompts)]
    argv += ["--max-new-tokens", "8", "--check-lossless", "--threads", "1", "--device", lazy_device]
    argv += ["--dtype", "float32"]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["machine"]["device"] == lazy_device
    assert all(run.get("lossless", True) for run in results["runs"])


def test_heads_in_batches_and_sampling_off_the_cpu(on_device, tmp_path):
    """Head drafters per batch row (`for_another_row`), Post-use around a head, and sampled drafts from heads."""
    from hf_spec.methods.postuse import PostUseConfig, PostUseDrafter

    cpu, moved = on_device
    torch.manual_seed(0)
    eagle = EagleHeadModel(EagleHeadConfig.for_target(cpu, 64))
    eagle.init_layer_from(cpu)
    eagle.save_pretrained(tmp_path / "eagle")
    LyannaHeadModel(LyannaHeadConfig.for_target(cpu, 64, token_info_rank=8)).save_pretrained(
        tmp_path / "lyanna"
    )
    eagle_cfg = dict(depth=2, topk=2, total_tokens=4, head=str(tmp_path / "eagle"))
    drafters = {
        "eagle": lambda: EagleDrafter(EagleConfig(**eagle_cfg), moved),
        "lyanna": lambda: LyannaDrafter(
            LyannaConfig(depth=3, topk=2, budget=4, head=str(tmp_path / "lyanna")), moved
        ),
        "postuse": lambda: PostUseDrafter(
            PostUseConfig(drafter={"method": "eagle", **eagle_cfg}, precut=None), moved
        ),
    }
    ids = torch.zeros(2, 10, dtype=torch.long)
    ids[0], ids[1, 4:] = prompt_ids(10, seed=2)[0], prompt_ids(6, seed=3)[0]
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    kw = dict(max_new_tokens=10, pad_token_id=0)
    ref = cpu.generate(ids, attention_mask=mask, do_sample=False, **kw)
    for name, make in drafters.items():
        out = moved.generate(
            ids.to(moved.device), attention_mask=mask.to(moved.device), do_sample=False,
            custom_generate=SpeculativeDecoder(make()), **kw,
        )  # fmt: skip
        assert torch.equal(out.cpu(), ref), name
        sampled = moved.generate(
            ids[:1].to(moved.device), do_sample=True, custom_generate=SpeculativeDecoder(make()), **kw
        )
        assert sampled.shape == (1, 20), name
