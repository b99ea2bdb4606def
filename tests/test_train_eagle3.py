"""EAGLE-3 training (`training/eagle3.py`, `hf-spec train eagle3`) on tiny random targets: the training-time-test
steps see what drafting sees, a head learns, resumes, reads lazily from a store, and saves a loadable folder."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import DynamicCache

from hf_spec.cli.main import main
from hf_spec.heads.card import portable_paths
from hf_spec.methods.eagle3.modeling import Eagle3Head, Eagle3HeadConfig
from hf_spec.models.fingerprint import target_fingerprint
from hf_spec.training.eagle3 import Eagle3TrainConfig, Eagle3Trainee, train_eagle3, unrolled_states
from hf_spec.training.features import FeatureStore, capture_sequences
from hf_spec.training.lazy_store import lazy_sequences
from tests.conftest import STORIES, load_script, make_tiny_model, prompt_ids

LAYERS = (1, 2, 3)
KEYS = ("input_ids", "features", "aux_features", "topk_ids", "topk_logp", "response_mask")


def captured(model, folder, count: int = 24, new: int = 40) -> FeatureStore:
    items = []
    for seed in range(count):
        ids = prompt_ids(10, seed=100 + seed)
        out = model.generate(ids, max_new_tokens=new, do_sample=False)[0].tolist()
        items.append((f"toy/c{seed}", out, [0] * 10 + [1] * (len(out) - 10)))
    return capture_sequences(model, items, folder, topk=8, aux_layers=LAYERS, progress=False)


def test_each_step_sees_what_drafting_depth_sees():
    model = make_tiny_model("llama")
    torch.manual_seed(0)
    config = Eagle3HeadConfig.for_target(model, 96, LAYERS)
    trainee = Eagle3Trainee(Eagle3Head(config), target_fingerprint(model)).attach_target(model).eval()
    n = 12
    aux = torch.randn(1, n, config.fused_width)
    ids = torch.randint(3, 96, (1, n))
    pos = torch.arange(1, n + 1)[None]
    with torch.no_grad():
        steps = list(unrolled_states(trainee, aux, ids, pos, 3))
        for i in range(3, n):  # depth 3 at query i: verified through query i-3, then two of its own states
            cache = DynamicCache()
            causal = torch.zeros(1, 1, i - 1, i - 1).masked_fill(
                torch.ones(i - 1, i - 1, dtype=torch.bool).triu(1), torch.finfo(torch.float32).min
            )
            h1 = trainee(aux[:, : i - 1], ids[:, : i - 1], pos[:, : i - 1], causal, cache)  # target-fed
            h2 = trainee(h1[:, -1:], ids[:, i - 1 : i], pos[:, i - 1 : i], None, cache)  # its own state
            h3 = trainee(h2, ids[:, i : i + 1], pos[:, i : i + 1], None, cache)
            assert torch.allclose(steps[2][:, i], h3[:, 0], atol=1e-5), i
            assert torch.allclose(steps[1][:, i - 1], h2[:, 0], atol=1e-5), i


def test_a_head_learns_and_resumes(tmp_path):
    model = make_tiny_model("qwen2", temperature=16.0)  # peaked: a head can learn it
    store = captured(model, tmp_path / "features")
    sequences = store.load_sequences(keys=KEYS)
    cfg = Eagle3TrainConfig(
        align_steps=3, topk=4, draft_vocab=80, epochs=12, lr=5e-3, batch_tokens=512, heldout=2
    )
    head, report = train_eagle3(model, sequences, tmp_path / "run", cfg, LAYERS, progress=False)
    assert report["final_loss"] < 0.75 * report["first_loss"]
    depth = report["heldout"]["accuracy_by_depth"]
    assert len(depth) == 4 and depth[0] > 0.1, depth  # chance: 1/80
    assert head.t2d.sum() == 80 and torch.equal(
        head.t2d.nonzero()[:, 0].sort().values, head.draft_token_ids().sort().values
    )
    # the finished run's checkpoint resumes to the same head, reading the store lazily
    again, _ = train_eagle3(
        model, lazy_sequences(store, keys=KEYS), tmp_path / "run", cfg, LAYERS, progress=False
    )
    assert all(
        torch.equal(a, b)
        for a, b in zip(head.state_dict().values(), again.state_dict().values(), strict=True)
    )
    with pytest.raises(ValueError, match="other settings"):
        train_eagle3(
            model, sequences, tmp_path / "run", Eagle3TrainConfig(align_steps=2), LAYERS, progress=False
        )
    with pytest.raises(ValueError, match="aux values per token"):
        train_eagle3(model, sequences, tmp_path / "run2", cfg, (1, 2), progress=False)
    other_layers = Eagle3Head(Eagle3HeadConfig.for_target(model, 80, (0, 1, 2)))
    with pytest.raises(
        ValueError, match=r"reads target layers \[0, 1, 2\], the features hold layers \[1, 2, 3\]"
    ):
        train_eagle3(model, sequences, tmp_path / "run3", cfg, LAYERS, progress=False, init_from=other_layers)


def test_lazy_sequences_equal_loaded_ones(tmp_path):
    model = make_tiny_model("qwen2")
    store = captured(model, tmp_path, count=4, new=8)
    lazy = lazy_sequences(store, {"toy/c1", "toy/c3"}, KEYS)
    loaded = store.load_sequences({"toy/c1", "toy/c3"}, KEYS)
    assert len(lazy) == 2 and set(lazy[0]) == set(KEYS)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(lazy, loaded, strict=True) for k in KEYS)
    with pytest.raises(ValueError, match="no \\['extra'\\]"):
        lazy_sequences(store, keys=("input_ids", "extra"))


def test_cli_trains_and_saves_a_loadable_eagle3_folder(stories, tmp_path, keep_threads):
    model, _ = stories
    store = captured(model, tmp_path / "features", count=8, new=16)
    out = tmp_path / "head"
    args = ["train", "eagle3", "--target", str(STORIES), "--features", str(store.folder)]
    args += ["--out", str(out), "--draft-vocab", "64", "--epochs", "1", "--heldout", "2", "--threads", "1"]
    assert main([*args, "--checkpoint-dir", str(tmp_path / "run"), "--sources", "toy"]) == 0
    sidecar = json.loads((out / "hf_spec.json").read_text())
    assert sidecar["format"] == "hf_spec_eagle3" and sidecar["hidden_state_indices"] == list(LAYERS)
    assert sidecar["training"]["heldout"]["accuracy_by_depth"]
    from hf_spec.methods.eagle3.drafter import load_eagle3_head

    head = load_eagle3_head(str(out), model)
    assert head.config.draft_vocab_size == 64
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"  # --save-dtype default
    card = (out / "README.md").read_text()
    assert "# EAGLE-3 draft head" in card and "training-time test over 4 steps" in card
    assert "eagle3:{HEAD}" in card and "--features" in card  # how to use it, and the command that trained it
    recipe = json.loads((out / "hf_spec_config.json").read_text())
    assert recipe["method"] == "eagle3" and recipe["head"] == "."
    # the folder's own recipe, through transformers' custom_generate, is the target's greedy output
    ids = torch.tensor([[1, 5, 6, 7, 8]])
    ref = model.generate(ids, max_new_tokens=12, do_sample=False)
    out_ids = model.generate(
        ids, max_new_tokens=12, do_sample=False, custom_generate=str(out), trust_remote_code=True
    )
    assert torch.equal(out_ids, ref)
    # scripts/update_head_card.py rewrites the card as the canonical report does, keeping what training wrote
    update_card = load_script("update_head_card").update_card
    before = card
    (out / "README.md").write_text("stale")
    # (a head trained for two steps collapses: its card, as training wrote it, says so)
    assert update_card(out, [], allow_collapsed=True) == 0 and (out / "README.md").read_text() == before
    # training on from the saved head keeps its draft vocabulary and starts from its weights
    again = ["train", "eagle3", "--target", str(STORIES), "--features", str(store.folder), "--sources", "toy"]
    again += ["--epochs", "1", "--heldout", "2", "--threads", "1", "--lr", "1e-12", "--save-dtype", "float32"]
    again += ["--checkpoint-dir", str(tmp_path / "run-on")]  # not the user's cache
    assert main([*again, "--init-from", str(out), "--out", str(tmp_path / "on")]) == 0
    tuned = load_eagle3_head(str(tmp_path / "on"), model)
    assert torch.equal(tuned.draft_token_ids(), head.draft_token_ids())
    assert all(
        torch.allclose(a.float(), b.float(), atol=1e-6)
        for a, b in zip(head.state_dict().values(), tuned.state_dict().values(), strict=True)
    )
    on_report = json.loads((tmp_path / "on" / "training_report.json").read_text())
    assert on_report["config"]["extra"] == {"init_from": str(out)}
    # the report and card of the head trained on show the start head's own training
    first = json.loads((out / "training_report.json").read_text())
    assert on_report["started_from"]["head"] == str(out)
    assert on_report["started_from"]["training"]["heldout"] == first["heldout"]
    on_card = (tmp_path / "on" / "README.md").read_text()
    # the card writes the training machine's paths portably (an absolute path by its last part)
    assert f"- Started from the head `{out.name}`, itself trained on " in on_card
    assert f"Its command: `{portable_paths(first['command'])}`" in on_card
    with pytest.raises(ValueError, match="64-token draft vocabulary, the training config asks for 32"):
        main([*again, "--init-from", str(out), "--draft-vocab", "32", "--out", str(tmp_path / "x")])
    with pytest.raises(ValueError, match="no sequences"):
        main([*args, "--out", str(tmp_path / "h2"), "--sources", "python-docs"])
    bare = capture_sequences(model, [("a", [1, 5, 6, 7], [0, 1, 1, 1])], tmp_path / "bare", progress=False)
    with pytest.raises(ValueError, match="--aux-layers eagle3"):
        main([*args[:4], "--features", str(bare.folder), "--out", str(tmp_path / "h3")])


@pytest.mark.parametrize("topk", [0, 4])
def test_logits_at_trained_positions_only_give_the_same_loss_and_gradients(tmp_path, topk):
    """The LM head runs on the trained rows only (not on padding and prompts): the loss, its gradients and the
    agreement equal those of logits at every position."""
    from hf_spec.training import eagle3 as eagle3_training
    from hf_spec.training.batches import collate
    from hf_spec.training.trainer import Unroll

    model = make_tiny_model("qwen2", temperature=16.0)
    sequences = captured(model, tmp_path / "features", count=3).load_sequences(keys=KEYS)
    sequences[1] = {k: v[:30] for k, v in sequences[1].items()}  # a shorter row: padding in the batch
    batch = collate(sequences, 512)
    torch.manual_seed(0)
    cfg = Eagle3TrainConfig(draft_vocab=96, align_steps=3, topk=topk)
    trainee = Eagle3Trainee(
        Eagle3Head(Eagle3HeadConfig.for_target(model, 96, LAYERS)), target_fingerprint(model)
    )
    trainee.attach_target(model)
    t2d = torch.arange(96)
    d = Unroll.of(trainee, batch, t2d)
    assert 0 < int(d.trained.sum()) < d.trained.numel()

    def run(select: bool):
        trainee.zero_grad()
        loss, accs, parts = torch.zeros(()), [], {}
        for j, h in enumerate(
            unrolled_states(trainee, batch["aux_features"][:, :-1], d.ids, d.position_ids, 3), 1
        ):
            logits = trainee.head.logits(h[d.trained] if select else h)
            l_tokens, agreement = d.token_loss(torch.log_softmax(logits.float(), -1), j, cfg, parts)
            loss, accs = loss + l_tokens / 3, [*accs, agreement]
        loss.backward()
        return loss.detach(), accs, [p.grad.clone() for p in trainee.head.parameters() if p.grad is not None]

    full, selected = run(False), run(True)
    assert torch.allclose(full[0], selected[0], rtol=1e-5) and full[1] == selected[1]
    for a, b in zip(full[2], selected[2], strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)
    step_loss, step_accs, _ = eagle3_training.eagle3_step(trainee, batch, cfg, t2d)  # what training runs
    assert torch.allclose(step_loss, selected[0], rtol=1e-5) and step_accs == selected[1]
