"""The package as users install it: the wheel and sdist build from the checkout and carry the C++ kernel sources
and the `hf-spec` command; a wheel installed into a fresh virtual environment decodes speculatively there, with the
kernels built from its installed sources, token for token as plain `generate` (slow: it compiles the kernels)."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest

from hf_spec import __version__
from tests.conftest import STORIES

REPO = Path(__file__).resolve().parents[1]
pytest.importorskip("build", reason="needs the `build` package (the dev extra)")


def _build(out: Path, *kinds: str) -> dict[str, Path]:
    """Build `kinds` (--sdist, --wheel; none: the sdist, then the wheel from it) without network access."""
    subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", *kinds, "--outdir", str(out), str(REPO)],
        check=True,
        capture_output=True,
        text=True,
    )
    return {p.suffix: p for p in out.iterdir()}


def test_wheel_carries_the_kernels_and_the_command(tmp_path):
    """What CI checks cheaply: the wheel has every C++ source the kernels build from, and the entry point."""
    wheel = _build(tmp_path, "--wheel")[".whl"]
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {
        f"hf_spec/csrc/{p.name}" for p in (REPO / "hf_spec" / "csrc").iterdir() if p.suffix in (".cpp", ".h")
    }
    assert sources and sources <= names
    assert f"hf_spec-{__version__}.dist-info/entry_points.txt" in names
    entry_points = zipfile.ZipFile(wheel).read(f"hf_spec-{__version__}.dist-info/entry_points.txt").decode()
    assert "hf-spec = hf_spec.cli.main:console_main" in entry_points


def _fresh_env(root: Path) -> Path:
    """A fresh virtual environment whose third-party packages are this environment's (the CPU torch and the rest,
    linked, so nothing is downloaded) but not its hf_spec: the wheel alone provides that."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "env")], check=True)
    env_python = root / "env" / "bin" / "python"
    purelib = subprocess.run(
        [str(env_python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    deps = root / "deps"
    deps.mkdir()
    import site

    here = Path(site.getsitepackages()[0])
    for entry in here.iterdir():
        if entry.name.startswith(("hf_spec", "__editable__", "__pycache__")) or entry.suffix == ".pth":
            continue
        (deps / entry.name).symlink_to(entry)
    Path(purelib, "_deps.pth").write_text(f"{deps}\n")
    ninja = Path(sys.executable).parent / "ninja"  # the ninja wheel's script, as pip would install it there
    if ninja.exists():
        (root / "env" / "bin" / "ninja").symlink_to(ninja)
    return env_python


@pytest.mark.slow
def test_installed_wheel_decodes_like_plain_generate(tmp_path):
    """Build the sdist and the wheel from it, install the wheel into a fresh environment and decode there."""
    built = _build(tmp_path / "dist")
    assert {".gz", ".whl"} <= set(built)
    with tarfile.open(built[".gz"]) as sdist:
        assert any(name.endswith("hf_spec/csrc/gemm_f32.cpp") for name in sdist.getnames())
    python = _fresh_env(tmp_path)
    subprocess.run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--no-index",
            "--disable-pip-version-check",
            "--quiet",
            str(built[".whl"]),
        ],
        check=True,
    )
    version = subprocess.run([str(python.parent / "hf-spec"), "--version"], capture_output=True, text=True)
    assert version.returncode == 0 and version.stdout.strip() == f"hf-spec {__version__}"
    script = textwrap.dedent(
        """
        import sys
        from pathlib import Path

        import torch

        import hf_spec
        from hf_spec import SpeculativeDecoder
        from hf_spec.kernels import cpu_skinny_gemm
        from hf_spec.models import load_model

        assert Path(hf_spec.__file__).resolve().is_relative_to(Path(sys.prefix).resolve()), hf_spec.__file__
        assert Path(cpu_skinny_gemm.CSRC).resolve().is_relative_to(Path(sys.prefix).resolve())
        assert cpu_skinny_gemm.load_kernel() is not None, "the C++ kernels did not build from the installed sources"
        model, tok = load_model(sys.argv[1])
        ids = tok("Once upon a time, Tom had a dog. Once upon a time, Tom", return_tensors="pt")
        plain = model.generate(**ids, max_new_tokens=32, do_sample=False)
        decoder = SpeculativeDecoder("pld", tokenizer=tok)
        spec = model.generate(**ids, max_new_tokens=32, do_sample=False, custom_generate=decoder)
        assert torch.equal(plain, spec), (plain, spec)
        print("ok", decoder.last_stats.tau)
        """
    )
    env = {**os.environ, "HF_SPEC_KERNEL_CACHE": str(tmp_path / "kernels"), "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    run = subprocess.run(
        [str(python), "-c", script, str(STORIES)], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.startswith("ok")
    assert any((tmp_path / "kernels").rglob("*.so"))
