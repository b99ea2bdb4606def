"""Checksum lists that cannot be bypassed: a head folder's list names every file it ships (configs,
`custom_generate/` code, weights) and only files inside it; an empty, partial or removed list of a folder hf-spec
marked is refused by name; a folder from before lists loads with a warning naming `hf-spec seal`."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch

from hf_spec.cli.export import export_head
from hf_spec.cli.main import main
from hf_spec.io.integrity import CHECKSUM_FILE, IntegrityError, file_sha256
from hf_spec.methods.eagle3 import Eagle3Head, Eagle3HeadConfig, load_eagle3_head, save_eagle3_head
from tests.conftest import make_tiny_model
from tests.test_reliability import as_saved_before_checksums, eagle_head, flip_a_byte, load_eagle

HEAD_FILES = {
    "README.md",
    "config.json",
    "configuration_hf_spec.py",
    "custom_generate/generate.py",
    "custom_generate/requirements.txt",
    "hf_spec_config.json",
    "model.safetensors",
    "modeling_hf_spec.py",
}


@pytest.fixture(scope="module")
def target():
    return make_tiny_model("llama")


def eagle3_folder(target, folder: Path) -> Path:
    torch.manual_seed(0)
    return save_eagle3_head(
        folder, Eagle3Head(Eagle3HeadConfig.for_target(target, 50, (1, 2, 3))).eval(), target=target
    )


def rewrite_list(folder: Path, files: dict[str, str], version: int | None = 2) -> None:
    body = {"format": "hf-spec-checksums", "algorithm": "sha256", "files": files}
    if version is not None:
        body["version"] = version
    (folder / CHECKSUM_FILE).write_text(json.dumps(body))


def test_a_head_folder_lists_every_file_it_ships_and_an_edited_one_is_refused(target, tmp_path):
    folder = eagle_head(target, tmp_path / "head")
    listed = json.loads((folder / CHECKSUM_FILE).read_text())["files"]
    assert set(listed) == HEAD_FILES
    assert json.loads((folder / "config.json").read_text())["hf_spec_checksums"] == 2  # says it has a list
    load_eagle(folder, target)
    generate_py = folder / "custom_generate" / "generate.py"
    generate_py.write_text(generate_py.read_text() + "\nimport os  # planted\n")
    with pytest.raises(IntegrityError, match=r"custom_generate/generate\.py does not match its checksum"):
        load_eagle(folder, target)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_an_empty_or_partial_list_does_not_let_edited_weights_load(target, tmp_path, kind):
    folder = eagle_head(target, tmp_path / "h") if kind == "eagle" else eagle3_folder(target, tmp_path / "h")
    load = (
        (lambda: load_eagle(folder, target))
        if kind == "eagle"
        else (lambda: load_eagle3_head(str(folder), target))
    )
    files = json.loads((folder / CHECKSUM_FILE).read_text())["files"]
    flip_a_byte(folder / "model.safetensors")
    rewrite_list(folder, {})
    with pytest.raises(IntegrityError, match=r"hf_spec_checksums\.json lists no files"):
        load()
    readme_only = {name: files[name] for name in files if name in ("README.md", "config.json")}
    for version in (2, None):  # a list in today's format, and one in an earlier hf-spec's (weights only)
        rewrite_list(folder, readme_only, version)
        with pytest.raises(IntegrityError, match=r"h/model\.safetensors is not in hf_spec_checksums\.json"):
            load()


def test_a_list_removed_from_a_marked_folder_is_refused_by_name(target, tmp_path):
    folder = eagle3_folder(target, tmp_path / "e3")
    (folder / CHECKSUM_FILE).unlink()
    missing = r"e3/hf_spec_checksums\.json is missing, though .*e3/config\.json says hf-spec wrote the folder"
    with pytest.raises(IntegrityError, match=missing):
        load_eagle3_head(str(folder), target)
    (folder / "hf_spec.json").unlink()  # no longer looks like hf-spec's own EAGLE-3 format: still refused
    with pytest.raises(IntegrityError, match=missing):
        load_eagle3_head(str(folder), target)
    head = eagle_head(target, tmp_path / "head")
    (head / CHECKSUM_FILE).unlink()
    with pytest.raises(IntegrityError, match=r"head/hf_spec_checksums\.json is missing"):
        load_eagle(head, target)


def test_a_list_cannot_name_files_outside_the_folder(target, tmp_path):
    folder = eagle_head(target, tmp_path / "head")
    files = json.loads((folder / CHECKSUM_FILE).read_text())["files"]
    outside = tmp_path / "outside.txt"
    outside.write_text("not the head's\n")
    for name in ("../outside.txt", str(outside), "../../../../etc/hostname"):
        rewrite_list(folder, files | {name: file_sha256(outside)})
        with pytest.raises(IntegrityError, match=r"which is not a path inside the folder"):
            load_eagle(folder, target)
    os.symlink(outside, folder / "notes.txt")  # a link out of the folder, listed
    rewrite_list(folder, files | {"notes.txt": file_sha256(outside)})
    with pytest.raises(IntegrityError, match=r"head/notes\.txt leads to .*outside\.txt, outside the folder"):
        load_eagle(folder, target)
    rewrite_list(folder, files)  # the link not listed: a file the list does not name
    with pytest.raises(IntegrityError, match=r"head/notes\.txt is not in hf_spec_checksums\.json"):
        load_eagle(folder, target)


def test_an_old_folder_warns_how_to_seal_it_and_hf_spec_seal_does(target, tmp_path, caplog):
    folder = as_saved_before_checksums(eagle_head(target, tmp_path / "old"))
    with caplog.at_level(logging.WARNING, logger="hf_spec.io.integrity"):
        load_eagle(folder, target)
    assert f"add a complete list with `hf-spec seal {folder}`" in caplog.text
    assert main(["seal", str(folder)]) == 0
    assert set(json.loads((folder / CHECKSUM_FILE).read_text())["files"]) == HEAD_FILES
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hf_spec.io.integrity"):
        load_eagle(folder, target)
    assert "checksum" not in caplog.text
    flip_a_byte(folder / "model.safetensors")  # a damaged folder is refused, not sealed
    with pytest.raises(IntegrityError, match=r"does not match its checksum"):
        main(["seal", str(folder)])
    with pytest.raises(ValueError, match=r"holds no config\.json or meta\.json"):
        main(["seal", str(tmp_path)])


def test_an_earlier_weights_only_list_loads_with_a_warning(target, tmp_path, caplog):
    folder = eagle_head(target, tmp_path / "v1")
    as_saved_before_checksums(folder)
    rewrite_list(folder, {"model.safetensors": file_sha256(folder / "model.safetensors")}, version=None)
    with caplog.at_level(logging.WARNING, logger="hf_spec.io.integrity"):
        load_eagle(folder, target)
    assert "checksum list of its weights only" in caplog.text and "hf-spec seal" in caplog.text


def test_a_truncated_head_weights_file_is_named_as_damaged(target, tmp_path):
    folder = eagle_head(target, tmp_path / "head")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(IntegrityError, match=r"head/model\.safetensors does not match its checksum"):
        load_eagle(folder, target)


def test_export_lists_every_file_and_refuses_what_it_did_not_write(target, tmp_path):
    source = eagle3_folder(target, tmp_path / "src")
    model_copy = tmp_path / "model"
    model_copy.mkdir()
    (model_copy / "config.json").write_text('{"model_type": "llama"}')
    (model_copy / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(
        ValueError, match=r"model already holds other files \(config\.json, model\.safetensors\)"
    ):
        export_head(str(source), "eagle3-vllm", model_copy)
    assert (model_copy / "model.safetensors").read_bytes() == b"weights"  # untouched
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("x")
    with pytest.raises(ValueError, match=r"notes already holds other files"):
        main(["export", str(source), "--format", "eagle3-sglang", "--out", str(other)])
    out = export_head(str(source), "eagle3-vllm", tmp_path / "out")
    export_head(str(source), "eagle3-sglang", out)  # an earlier export is replaced
    assert set(json.loads((out / CHECKSUM_FILE).read_text())["files"]) == {
        "config.json",
        "hf_spec.json",
        "model.safetensors",
    }
    load_eagle3_head(str(out), target)
