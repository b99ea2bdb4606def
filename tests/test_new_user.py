"""What a new user meets: the benchmark prompts ship with the repository, the documented install lines agree, the
committed heads' cards render as the Hub shows them (no collapsed head, no machine path, no duplicate tag, snippets
that name only what they define), every `hf_spec.x.y(` the docs and messages name exists, and what the GGUF round
trip of the known models does to a head's fingerprint check."""

from __future__ import annotations

import ast
import builtins
import copy
import hashlib
import importlib
import json
import re
from pathlib import Path

import pytest
import torch

from hf_spec.heads.card import (
    CollapsedHeadError,
    check_not_collapsed,
    collapse_reason,
    head_card,
    portable_paths,
)
from hf_spec.models.fingerprint import check_fingerprint, target_fingerprint
from tests.conftest import STORIES

REPO = Path(__file__).resolve().parents[1]
PROMPTS = REPO / "benchmarks" / "prompts" / "spec_bench_dev.jsonl"
CARDS = sorted(p for p in (REPO / "model_cards").iterdir() if (p / "README.md").is_file())
# pages that lab work keeps (moved out of the user docs separately)
NOT_USER_DOCS = {"head-data.md"}
USER_DOCS = [
    REPO / "README.md",
    *(p for p in (REPO / "docs").rglob("*.md") if p.name not in NOT_USER_DOCS),
]


# ------------------------------------------------------------------------------------------------ benchmarks


def test_the_benchmark_prompts_ship_with_their_source():
    text = (REPO / "benchmarks" / "prompts" / "README.md").read_text()
    digest = hashlib.sha256(PROMPTS.read_bytes()).hexdigest()
    assert digest in text and "hemingkx/Spec-Bench" in text and "Apache-2.0" in text
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()]
    assert len(rows) == 240 and len({r["category"] for r in rows}) == 13
    assert all(r["turns"] and isinstance(r["turns"][0], str) for r in rows)


def test_docs_cite_nothing_outside_the_clone():
    """Every documented command runs from a clone: no path into `../shared` (where the figures' inputs lived)."""
    for page in USER_DOCS:
        assert "../shared" not in page.read_text(), page.relative_to(REPO)


def test_canonical_benchmark_reads_the_shipped_prompts():
    import importlib.util

    spec = importlib.util.spec_from_file_location("canonical", REPO / "benchmarks" / "canonical.py")
    canonical = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(canonical)
    assert canonical.PROMPTS == PROMPTS
    for methods in canonical.CANONICAL.values():  # every run needs nothing beyond the clone
        assert canonical.missing_datastore_sources(methods) == []
    assert canonical.shown_command("x --prompts ../shared/data/eval/spec_bench_dev.jsonl y") == (
        "x --prompts benchmarks/prompts/spec_bench_dev.jsonl y"
    )


def _datastore_sources(node) -> list[str]:
    """The source files named by every datastore recipe in a config's JSON."""
    if isinstance(node, list):
        return [path for value in node for path in _datastore_sources(value)]
    if not isinstance(node, dict):
        return []
    recipe = node["datastore"] if isinstance(node.get("datastore"), dict) else {}
    own = [path for key in ("corpus", "responses", "early_exit_prompts") for path in recipe.get(key, [])]
    return own + [path for value in node.values() for path in _datastore_sources(value)]


def test_every_config_builds_its_datastore_from_shipped_files():
    configs = sorted((REPO / "benchmarks" / "configs").glob("*.json"))
    named = 0
    for config in configs:
        for path in _datastore_sources(json.loads(config.read_text())):
            source = (config.parent / path).resolve()
            assert source.is_relative_to(REPO) and source.is_file(), (config.name, path)
            named += 1
    assert named  # the retrieval and talon configs name theirs


def _word_grams(text: str, n: int) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def test_the_shipped_datastore_prompts_are_not_the_evaluation_prompts():
    """The datastore's prompts share no prompt and no run of 8 words with the benchmark prompts, and its answers
    answer them."""
    folder = REPO / "benchmarks" / "datastore"
    rows = [json.loads(line) for line in (folder / "prompts.jsonl").read_text().splitlines()]
    texts = {r["id"]: f"{r['instruction']}\n\n{r.get('input', '')}".strip() for r in rows}
    assert len(texts) == len(rows) >= 150 and f"{len(rows)} prompts" in (folder / "README.md").read_text()
    evaluation = [turn for line in PROMPTS.read_text().splitlines() for turn in json.loads(line)["turns"]]
    seen = {" ".join(turn.lower().split()) for turn in evaluation}
    grams = set().union(*(_word_grams(turn, 8) for turn in evaluation))
    for prompt_id, text in texts.items():
        assert " ".join(text.lower().split()) not in seen, prompt_id
        assert not _word_grams(text, 8) & grams, prompt_id
    answer_files = sorted(folder.glob("answers-*.jsonl"))
    assert answer_files
    for answers in answer_files:
        for line in answers.read_text().splitlines():
            row = json.loads(line)
            assert texts[row["id"]].split("\n\n")[0] in row["prompt"], (answers.name, row["id"])


# ------------------------------------------------------------------------------------------------ install


def _block(text: str, start: str, end: str) -> list[str]:
    body = text.split(start, 1)[1].split(end, 1)[0]
    return [line.strip() for line in body.splitlines() if line.strip() and not line.startswith("```")]


def test_the_readme_cpu_install_is_the_one_ci_runs():
    """CI runs docs/getting-started.md's CPU block as written (.ci/install-cpu); the README's lines are its lines."""
    cpu = _block(
        (REPO / "docs" / "getting-started.md").read_text(), "<!-- install:cpu -->", "<!-- /install -->"
    )
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in cpu
    readme = (REPO / "README.md").read_text().split("## Install", 1)[1].split("##", 1)[0]
    pip_lines = [line.strip() for line in readme.splitlines() if line.strip().startswith("pip install")]
    assert pip_lines and all(line in cpu for line in pip_lines)
    assert "install-cpu" in (REPO / ".github" / "workflows" / "ci.yml").read_text()


def test_head_folders_requirements_are_satisfied_by_an_install():
    """transformers checks custom_generate/requirements.txt before it runs a folder's generate.py: the line must
    be one an installed hf-spec meets (this environment's is one)."""
    from transformers.dynamic_module_utils import check_python_requirements

    folders = [c for c in CARDS if (c / "custom_generate" / "requirements.txt").is_file()]
    assert folders
    for folder in folders:
        check_python_requirements(str(folder), "custom_generate/requirements.txt")


# ------------------------------------------------------------------------------------------------ cards


def _front_matter(card: str) -> list[str]:
    assert card.startswith("---\n")
    return card.split("---\n")[1].splitlines()


def _undefined_names(code: str) -> set[str]:
    """Names a snippet reads that it neither imports nor assigns (nor Python defines)."""
    tree = ast.parse(code)
    defined = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            defined |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return used - defined


@pytest.mark.parametrize("folder", CARDS, ids=lambda p: p.name)
def test_committed_cards_render_as_the_hub_shows_them(folder):
    card = (folder / "README.md").read_text()
    meta = _front_matter(card)
    yaml = pytest.importorskip("yaml")
    parsed = yaml.safe_load("\n".join(meta))  # the Hub reads the front matter as YAML
    assert parsed["library_name"] == "hf-spec" and "/" in parsed["base_model"] and parsed["tags"]
    tags = [line[2:] for line in meta if line.startswith("- ")]
    assert len(tags) == len(set(tags)), f"duplicate tags: {tags}"
    assert not any(line.startswith("pipeline_tag:") for line in meta), "a head does not generate on its own"
    assert not re.search(r"(?<![\w.~$])/(root|home|work|tmp)/", card), "a path of the training machine"
    assert "GGUF" in card  # which build of the target the folder was trained against
    for code in re.findall(r"```python\n(.*?)```", card, re.S):
        assert not _undefined_names(code), f"{folder.name}: snippet uses {_undefined_names(code)}"


@pytest.mark.parametrize("folder", CARDS, ids=lambda p: p.name)
def test_no_committed_head_has_collapsed(folder):
    report = folder / "training_report.json"
    if report.is_file():
        assert collapse_reason(json.loads(report.read_text())) is None


def test_card_generation_refuses_a_collapsed_head():
    """The withdrawn Qwen EAGLE head's held-out figures, and the committed SmolLM2 EAGLE head's."""
    collapsed = {
        "heldout": {"accuracy_by_depth": [0.3721, 0.0112, 0.0063, 0.0079], "loss": 14.35},
        "final_loss": 1.25,
    }
    assert "does not follow its own drafts" in collapse_reason(collapsed)
    with pytest.raises(CollapsedHeadError, match="collapsed on its held-out data"):
        head_card("EAGLE", "eagle", "qwen2.5-coder-0.5b-instruct", collapsed, "hf-spec train eagle ...")
    saved = head_card("EAGLE", "eagle", "qwen2.5-coder-0.5b-instruct", collapsed, "cmd", allow_collapsed=True)
    assert "> **Collapsed head: not for publishing.** Held-out agreement falls from 0.372" in saved
    assert "not for publishing" not in head_card("EAGLE", "eagle", "qwen2.5-coder-0.5b-instruct", {}, "cmd")
    overfit = {"heldout": {"accuracy_by_depth": [0.30, 0.25, 0.2, 0.2], "loss": 9.0}, "final_loss": 2.0}
    assert "over 4x the final training loss" in collapse_reason(overfit)
    useless = {"heldout": {"accuracy_by_depth": [0.01, 0.01, 0.01, 0.01]}}
    assert "under 0.05" in collapse_reason(useless)
    healthy = {
        "heldout": {"accuracy_by_depth": [0.3559, 0.1566, 0.0957, 0.0778], "loss": 6.5},
        "final_loss": 3.59,
    }
    check_not_collapsed(healthy)
    check_not_collapsed({})  # no held-out figures: nothing to judge by


def test_cards_write_machine_paths_portably():
    text = "--features /root/.cache/hf-spec/corpus/x --init-from ~/.cache/hf-spec/heads/h --out /home/ann/out"
    assert (
        portable_paths(text)
        == "--features $HF_SPEC_CACHE/corpus/x --init-from $HF_SPEC_CACHE/heads/h --out ~/out"
    )
    kept = "--out /srv/runs/my-head --prompts data/train.json [hf-spec](https://github.com/hf-spec/hf-spec)"
    assert (
        portable_paths(kept)
        == "--out my-head --prompts data/train.json [hf-spec](https://github.com/hf-spec/hf-spec)"
    )


def test_hub_page_lists_every_committed_head():
    hub = (REPO / "docs" / "hub.md").read_text()
    for folder in CARDS:
        if (folder / "training_report.json").is_file() or (folder / "hf_spec.json").is_file():
            assert f"`{folder.name}`" in hub, folder.name


# ------------------------------------------------------------------------------------------------ references

_CALL = re.compile(r"hf_spec(?:\.[A-Za-z_]\w*)+(?=\()")


def _resolve(dotted: str):
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def test_every_hf_spec_call_named_in_messages_and_docs_exists():
    """`hf_spec.x.y(` in an error message, a docstring or a page names something a user can call."""
    sources = [*(REPO / "hf_spec").rglob("*.py"), *USER_DOCS, *(c / "README.md" for c in CARDS)]
    named = {m.group(0): path for path in sources for m in _CALL.finditer(path.read_text())}
    assert "hf_spec.integrations.enable_assistant" in named
    for dotted, path in named.items():
        try:
            assert callable(_resolve(dotted)), dotted
        except (ImportError, AttributeError) as err:
            pytest.fail(f"{path.relative_to(REPO)} names {dotted}(), which does not exist ({err})")


def test_api_reference_covers_the_entry_points():
    text = (REPO / "docs" / "api" / "entry-points.md").read_text()
    for name in (
        "hf_spec.models.load_model",
        "hf_spec.integrations.enable_assistant",
        "hf_spec.integrations.save_custom_generate",
    ):
        assert f"::: {name}" in text


# ------------------------------------------------------------------------------------------------ GGUF builds


def _gguf_round_trip(model, embedding_type, layer_type):
    """A copy of `model` whose 2D weights went through a GGUF quantization and back (`embedding_type` for the
    embedding, `layer_type` for the rest; float16 where a row does not fill whole blocks, as converters do)."""
    import numpy as np

    gguf = pytest.importorskip("gguf")
    from gguf import GGMLQuantizationType, quants

    copy_ = copy.deepcopy(model)
    with torch.no_grad():
        for name, weight in copy_.named_parameters():
            if weight.dim() != 2:
                continue
            kind = getattr(GGMLQuantizationType, embedding_type if "embed" in name else layer_type)
            if weight.shape[-1] % 32:
                kind = GGMLQuantizationType.F16
            data = weight.float().numpy()
            back = quants.dequantize(quants.quantize(data, kind), kind)
            weight.copy_(torch.from_numpy(np.asarray(back, dtype=np.float32).reshape(data.shape)))
    assert gguf
    return copy_


@pytest.mark.parametrize(
    ("embedding", "layers", "loads"),
    [
        ("Q8_0", "Q4_1", True),  # smollm2-135m-instruct's build: Q8_0 embedding, Q4_1 layers
        ("Q5_0", "Q5_0", True),  # qwen2.5-coder-0.5b-instruct's embedding is Q5_0
        ("Q4_1", "Q4_1", False),
        ("Q4_0", "Q4_0", False),
    ],
)
def test_a_head_for_a_gguf_build_on_the_original_weights(embedding, layers, loads):
    """A head records the fingerprint of the build it was trained on (here: stories260K's weights after a GGUF
    round trip) and is checked against the original weights: 8- and 5-bit embeddings pass the check, 4-bit ones
    are refused with a message that says what to do."""
    from hf_spec.models import load_model

    original, _ = load_model(str(STORIES))
    build = _gguf_round_trip(original, embedding, layers)
    assert not torch.equal(
        build.model.layers[0].mlp.up_proj.weight, original.model.layers[0].mlp.up_proj.weight
    )
    recorded = target_fingerprint(build)
    if loads:
        check_fingerprint(recorded, original, "the head")
    else:
        with pytest.raises(ValueError, match="another build") as refused:
            check_fingerprint(recorded, original, "the head")
        assert "hf-spec fetch" in str(refused.value) and "--init-from" in str(refused.value)


# ------------------------------------------------------------------------------------------------ commands


def _documented_commands() -> list[tuple[str, str]]:
    """`(page, command)` of every `hf-spec ...` line in the shell blocks of the user docs (continuations joined)."""
    found = []
    for page in [*USER_DOCS, *(c / "README.md" for c in CARDS)]:
        for block in re.findall(r"```(?:bash|sh|shell)\n(.*?)```", page.read_text(), re.S):
            joined = block.replace("\\\n", "")  # a line continuation, as the shell reads it
            for line in joined.splitlines():
                line = line.strip()
                if line.startswith("hf-spec ") or line.startswith(".venv/bin/hf-spec "):
                    found.append((str(page.relative_to(REPO)), line))
    return found


def test_documented_commands_parse_as_written():
    """Every documented `hf-spec` command is one the parser accepts as written, its old spellings included
    (they would warn). Skipped, as they cannot parse: lines that expand shell variables (`$P`) or hold
    placeholders in angle brackets; what each command then does with its files is covered by its own tests."""
    import shlex
    import warnings

    from hf_spec.cli.main import build_parser

    commands = _documented_commands()
    assert len(commands) > 30
    parser, skipped, failed = build_parser(), [], []
    for page, line in commands:
        argv = shlex.split(line, comments=True)[1:]
        argv = argv[: argv.index("|")] if "|" in argv else argv  # a pipe into another program
        if any("$" in a or "<" in a for a in argv) or "..." in argv:
            skipped.append((page, line))
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)  # the docs use the current spellings
            try:
                parser.parse_args(argv)
            except SystemExit as err:  # --help and --version exit 0
                if err.code != 0:
                    failed.append(f"{page}: `{line}` (exit {err.code})")
            except FutureWarning as err:
                failed.append(f"{page}: `{line}` ({err})")
    assert not failed, "\n".join(failed)
    assert len(skipped) < len(commands) / 2


def test_head_folder_notebook_finds_the_head_from_any_working_directory(monkeypatch, tmp_path):
    """The notebook's `repository_folder` finds the committed head from anywhere inside the clone; outside one it
    would clone the repository for its files (not run here: no network)."""
    nb = json.loads((REPO / "examples" / "head_folder.ipynb").read_text())
    source = next(
        "".join(c["source"]) for c in nb["cells"] if "def repository_folder" in "".join(c["source"])
    )
    definition = source[source.index("def repository_folder") : source.index("\nHEAD = ")]
    namespace = {"Path": Path, "subprocess": None}
    exec(definition, namespace)
    for cwd in (REPO, REPO / "examples", REPO / "hf_spec" / "cli"):
        monkeypatch.chdir(cwd)
        found = namespace["repository_folder"]("model_cards/hass-smollm2-135m-instruct")
        assert (found / "hf_spec_config.json").is_file(), cwd
    install = "".join(next(c for c in nb["cells"] if c["cell_type"] == "code")["source"])
    assert '%pip install -q "hf-spec[gguf,bench,train] @ git+' in install and "git clone" not in install


def test_a_head_for_an_untied_gguf_build_on_the_tied_original():
    """The Qwen GGUF build stores its LM head apart (`output.weight`, Q8_0) where the Hub model ties it to the
    embedding: a head records both in its fingerprint and is refused on the tied model, with what to do."""
    from hf_spec.models import load_model

    original, _ = load_model(str(STORIES))
    assert original.lm_head.weight is original.get_input_embeddings().weight
    build = _gguf_round_trip(original, "Q5_0", "Q5_0")
    build.lm_head.weight = torch.nn.Parameter(
        _gguf_round_trip(original, "Q8_0", "Q8_0").lm_head.weight.clone()
    )
    build.config.tie_word_embeddings = False
    with pytest.raises(
        ValueError, match="LM head is not tied to its embedding, and this model ties them"
    ) as err:
        check_fingerprint(target_fingerprint(build), original, "the head")
    assert "hf-spec fetch" in str(err.value) and "--init-from" in str(err.value)
