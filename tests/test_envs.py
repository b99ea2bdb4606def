"""`hf_spec.core.envs`: one table of every `HF_SPEC_*` variable, read on access, documented in docs/environment.md."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hf_spec.core import envs
from hf_spec.kernels import cpu_skinny_gemm as csg

ROOT = Path(__file__).resolve().parent.parent
NAME = re.compile(r"\bHF_SPEC_[A-Z0-9_]*[A-Z0-9]\b")


def _doc_table() -> str:
    text = (ROOT / "docs" / "environment.md").read_text()
    start = text.index("| Variable |")
    return text[start : text.index("<!-- end of table -->", start)].strip()


def test_docs_table_is_the_envs_table():
    """Every variable of envs.py is in docs/environment.md with its default and doc, and nothing else is."""
    assert _doc_table() == envs.markdown_table(), (
        "docs/environment.md's table is out of date: replace it with `envs.markdown_table()`"
    )
    documented = set(NAME.findall(_doc_table()))
    assert documented == set(envs.ENVIRONMENT_VARIABLES)


def test_every_variable_named_in_the_repository_is_declared():
    """A `HF_SPEC_*` name in the code, tests, benchmarks or docs is one envs.py declares (a typo in a test's
    `setenv` would otherwise set nothing)."""
    this = Path(__file__).resolve()
    files = [
        *(ROOT / "hf_spec").rglob("*.py"),
        *(ROOT / "tests").rglob("*.py"),
        *(ROOT / "benchmarks").rglob("*"),
    ]
    files += [*(ROOT / "docs").glob("*.md"), ROOT / "README.md"]
    unknown = {
        f"{path.relative_to(ROOT)}: {name}"
        for path in files
        if path.is_file() and path.resolve() != this and path.suffix in (".py", ".md", ".sh")
        for name in NAME.findall(path.read_text(errors="replace"))
        if name not in envs.ENVIRONMENT_VARIABLES
    }
    assert not unknown, (
        f"undeclared HF_SPEC_* variables (add them to hf_spec/core/envs.py): {sorted(unknown)}"
    )


def test_only_envs_reads_the_environment_for_hf_spec_variables():
    reads = re.compile(r"(os\.environ|os\.getenv|environ\.get)[^\n]*HF_SPEC_")
    offenders = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "hf_spec").rglob("*.py")
        if path.name != "envs.py" and reads.search(path.read_text())
    ]
    assert not offenders, f"read HF_SPEC_* variables through hf_spec.core.envs: {offenders}"


def test_defaults_when_unset(monkeypatch):
    for name in envs.ENVIRONMENT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert envs.HF_SPEC_SCREENED_HEAD is True and envs.HF_SPEC_GROUPED_ATTENTION is True
    assert envs.HF_SPEC_SCREEN_INT8_X is True and envs.HF_SPEC_TREE_CHECK is True
    assert envs.HF_SPEC_NO_CPP_KERNELS is False and envs.HF_SPEC_DEBUG is False
    assert (
        envs.HF_SPEC_MM_TRICK is None
        and envs.HF_SPEC_BF16_KERNEL is None
        and envs.HF_SPEC_ONE_ROW_KERNEL is None
    )
    assert envs.HF_SPEC_CACHE == Path.home() / ".cache" / "hf-spec"
    monkeypatch.setenv("XDG_CACHE_HOME", "/xdg")
    assert envs.HF_SPEC_KERNEL_CACHE == Path("/xdg/hf-spec/torch_extensions")


@pytest.mark.parametrize(
    "value, expected",
    [
        ("1", True),
        ("true", True),
        (" YES ", True),
        ("on", True),
        ("0", False),
        ("False", False),
        ("no", False),
    ],
)
def test_switches_read_on_every_access(monkeypatch, value, expected):
    monkeypatch.setenv("HF_SPEC_SCREENED_HEAD", value)
    monkeypatch.setenv("HF_SPEC_MM_TRICK", value)
    assert envs.HF_SPEC_SCREENED_HEAD is expected and envs.HF_SPEC_MM_TRICK is expected
    monkeypatch.setenv("HF_SPEC_MM_TRICK", "auto")
    assert envs.HF_SPEC_MM_TRICK is None
    monkeypatch.setenv("HF_SPEC_SCREENED_HEAD", "")  # empty: the default
    assert envs.HF_SPEC_SCREENED_HEAD is True


def test_bad_values_name_the_variable(monkeypatch):
    monkeypatch.setenv("HF_SPEC_GROUPED_ATTENTION", "maybe")
    with pytest.raises(ValueError, match="HF_SPEC_GROUPED_ATTENTION.*'maybe'"):
        _ = envs.HF_SPEC_GROUPED_ATTENTION
    monkeypatch.setenv("HF_SPEC_DEBUG", "auto")  # `auto` is for measured decisions only
    with pytest.raises(ValueError, match="HF_SPEC_DEBUG"):
        _ = envs.HF_SPEC_DEBUG
    with pytest.raises(AttributeError, match="HF_SPEC_NOT_DECLARED"):
        _ = envs.HF_SPEC_NOT_DECLARED


def test_paths(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_SPEC_CACHE", str(tmp_path / "cache"))
    assert envs.HF_SPEC_CACHE == tmp_path / "cache"
    monkeypatch.setenv("HF_SPEC_CACHE", "~/somewhere")
    assert envs.HF_SPEC_CACHE == Path.home() / "somewhere"
    assert "HF_SPEC_CACHE" in dir(envs)


def test_kernel_build_folder_follows_the_cache_variable_and_the_sources(monkeypatch, tmp_path):
    """The C++ kernel builds under `HF_SPEC_KERNEL_CACHE`, in a folder named after a hash of its sources: an edited
    source builds afresh, the same sources load the same build."""
    monkeypatch.setenv("HF_SPEC_KERNEL_CACHE", str(tmp_path / "kc"))
    folder = csg.build_directory()
    assert folder.parent.parent == tmp_path / "kc" and folder.name == csg.kernel_name()
    sources = csg.source_files()
    assert {p.name for p in sources} >= {"module.cpp", "skinny_gemm.h"}
    copy = tmp_path / "csrc"
    copy.mkdir()
    for p in sources:
        (copy / p.name).write_bytes(p.read_bytes())
    monkeypatch.setattr(csg, "CSRC", copy)
    assert csg.kernel_name() == folder.name
    (copy / "skinny_gemm.h").write_text((copy / "skinny_gemm.h").read_text() + "\n// edited\n")
    assert csg.kernel_name() != folder.name
    monkeypatch.setattr(csg, "CSRC", tmp_path / "missing")
    with pytest.raises(RuntimeError, match="sources are missing"):
        csg.kernel_name()


def test_is_set_tells_a_known_variable_in_the_environment(monkeypatch):
    monkeypatch.delenv("HF_SPEC_NO_CPP_KERNELS", raising=False)
    assert envs.is_set("HF_SPEC_NO_CPP_KERNELS") is False
    monkeypatch.setenv("HF_SPEC_NO_CPP_KERNELS", "0")
    assert envs.is_set("HF_SPEC_NO_CPP_KERNELS") is True and envs.HF_SPEC_NO_CPP_KERNELS is False
    with pytest.raises(KeyError, match="HF_SPEC_NOT_A_VARIABLE"):
        envs.is_set("HF_SPEC_NOT_A_VARIABLE")
