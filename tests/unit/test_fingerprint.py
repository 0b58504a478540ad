"""The model identity: checkpoints named by content, never by path or modification time."""

from __future__ import annotations

import os
import shutil
import struct
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvbridge.config import Config
from kvbridge.errors import ConfigError
from kvbridge.fingerprint import SAMPLE_BYTES, SAMPLES, checkpoint_digest


def _checkpoint(path: Path, seed: int = 0, size: int = 1 << 20) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    header = b'{"w":{"dtype":"F32","shape":[%d],"data_offsets":[0,%d]}}' % (size // 4, size)
    data = bytes((i * 7 + seed) % 251 for i in range(size))
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + data)
    (path / "config.json").write_text('{"model_type": "tiny"}')
    (path / "tokenizer.json").write_text('{"vocab": {"a": 0}}')
    (path / "README.md").write_text("not part of the model")
    return path


def test_a_copy_elsewhere_with_other_mtimes_has_the_same_digest(tmp_path: Path) -> None:
    a = _checkpoint(tmp_path / "a")
    b = tmp_path / "elsewhere" / "b"
    shutil.copytree(a, b, copy_function=shutil.copyfile)  # new mtimes
    later = time.time() + 3600
    for f in b.iterdir():
        os.utime(f, (later, later))
    (b / "README.md").write_text("edited docs do not change the model")
    assert checkpoint_digest(str(a)) == checkpoint_digest(str(b)) is not None


@pytest.mark.parametrize("change", ["weights", "config", "tokenizer", "header", "new file"])
def test_what_changes_the_model_changes_the_digest(tmp_path: Path, change: str) -> None:
    a = _checkpoint(tmp_path / "a")
    b = _checkpoint(tmp_path / "b")
    assert checkpoint_digest(str(a)) == checkpoint_digest(str(b))
    if change == "weights":  # one byte, in a sampled window (the middle of the last one)
        blob = bytearray((b / "model.safetensors").read_bytes())
        blob[len(blob) - SAMPLE_BYTES // 2] ^= 1
        (b / "model.safetensors").write_bytes(bytes(blob))
    elif change == "config":
        (b / "config.json").write_text('{"model_type": "tiny", "rope_theta": 2}')
    elif change == "tokenizer":
        (b / "tokenizer.json").write_text('{"vocab": {"b": 0}}')
    elif change == "header":
        _checkpoint(b, size=(1 << 20) + 4)
    else:
        (b / "model-00002.safetensors").write_bytes(b"\0" * 16)
    assert checkpoint_digest(str(a)) != checkpoint_digest(str(b))


def test_other_training_seeds_differ_and_a_hub_name_has_no_digest(tmp_path: Path) -> None:
    assert (checkpoint_digest(str(_checkpoint(tmp_path / "a", seed=0)))
            != checkpoint_digest(str(_checkpoint(tmp_path / "b", seed=1))))
    assert checkpoint_digest("Qwen/Qwen3-0.6B") is None


def test_a_large_checkpoint_is_sampled_not_read(tmp_path: Path) -> None:
    """A sparse 8 GiB file: the digest reads SAMPLES windows, not the file."""
    d = tmp_path / "big"
    d.mkdir()
    with open(d / "model.bin", "wb") as f:
        f.truncate(8 << 30)
    t0 = time.perf_counter()
    digest = checkpoint_digest(str(d))
    assert digest is not None and time.perf_counter() - t0 < 5.0  # bounded, not 8 GiB of I/O
    assert SAMPLES * SAMPLE_BYTES < 1 << 20


def _vllm_config(model: str, revision: str | None = None) -> Any:
    hf = SimpleNamespace(to_dict=lambda: {"model_type": "tiny", "_name_or_path": model})
    mc = SimpleNamespace(model=model, revision=revision, hf_config=hf, dtype="torch.float32",
                         quantization=None, tokenizer=model, tokenizer_revision=None)
    return SimpleNamespace(model_config=mc,
                           cache_config=SimpleNamespace(cache_dtype="auto", block_size=16),
                           parallel_config=SimpleNamespace(tensor_parallel_size=1,
                                                           pipeline_parallel_size=1))


def test_model_identity_is_content_and_a_declared_one_replaces_it(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from kvbridge.integrations.vllm_meta import identity_digest, model_identity

    a = str(_checkpoint(tmp_path / "a"))
    b = str(tmp_path / "b")
    shutil.copytree(a, b, copy_function=shutil.copyfile)
    other = str(_checkpoint(tmp_path / "c", seed=3))
    ida, idb, idc = (model_identity(_vllm_config(m)) for m in (a, b, other))
    assert ida == idb and ida != idc  # a copy is the same model; other weights are not
    assert identity_digest(ida) != identity_digest(idc)
    declared = model_identity(_vllm_config(a), "release-7")
    assert declared["weights"] == "declared:release-7"
    assert declared == model_identity(_vllm_config(other), "release-7")
    # the layout and head split check block size and TP size themselves
    wider = model_identity(_vllm_config(a))
    wider["block_size"], wider["tp_size"] = "32", "2"
    assert identity_digest(wider) == identity_digest(ida)
    hub = model_identity(_vllm_config("org/model", revision="abc123"))
    assert hub["weights"] == "name:org/model@abc123"


@pytest.mark.parametrize("bad", ["x" * 257, "two\nlines", "\x00"])
def test_a_bad_declared_identity_is_refused_naming_the_key(bad: str) -> None:
    with pytest.raises(ConfigError, match="model_identity"):
        Config.load({"model_identity": bad}, env={})
    with pytest.raises(ConfigError, match="model_identity"):
        Config.load({}, env={"KVBRIDGE_MODEL_IDENTITY": bad})
    assert Config.load({}, env={"KVBRIDGE_MODEL_IDENTITY": "release-7"}).model_identity == (
        "release-7")
