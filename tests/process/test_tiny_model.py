"""The tiny test model: deterministic, idempotent, loadable, offline."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvbridge.tools.tiny_model import (
    NUM_SPECIAL_TOKENS,
    STAMP_NAME,
    VOCAB_SIZE,
    build_tiny_model,
    random_prompts,
)

pytest.importorskip("transformers")
pytest.importorskip("torch")

pytestmark = pytest.mark.timeout(180)


def _digests(d: Path) -> dict[str, str]:
    return {p.name: hashlib.md5(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def test_shape_and_files(built: Path) -> None:
    cfg = json.loads((built / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert cfg["hidden_size"] == 128
    assert cfg["num_hidden_layers"] == 2
    assert cfg["num_attention_heads"] == 4
    assert cfg["num_key_value_heads"] == 2
    assert cfg["head_dim"] == 32
    assert cfg["vocab_size"] == VOCAB_SIZE
    assert cfg["max_position_embeddings"] >= 2048
    assert cfg["dtype"] == "float32"
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", STAMP_NAME):
        assert (built / name).is_file(), name


def test_same_bytes_on_rebuild_and_seed_matters(built: Path, tmp_path: Path) -> None:
    again = build_tiny_model(tmp_path / "again", seed=0)
    assert _digests(again) == _digests(built)
    other = build_tiny_model(tmp_path / "other", seed=1)
    a, b = _digests(built), _digests(other)
    assert a["model.safetensors"] != b["model.safetensors"]
    assert a["tokenizer.json"] == b["tokenizer.json"]


def test_idempotent_when_stamped(built: Path) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in built.iterdir()}
    assert build_tiny_model(built, seed=0) == built
    assert {p.name: p.stat().st_mtime_ns for p in built.iterdir()} == before


def test_rebuilds_when_stamp_does_not_match(built: Path, tmp_path: Path) -> None:
    target = build_tiny_model(tmp_path / "m", seed=0)
    stamp = target / STAMP_NAME
    stamp.write_text(json.dumps({"hash": "stale"}))
    build_tiny_model(target, seed=0)
    assert json.loads(stamp.read_text())["hash"] != "stale"
    assert _digests(target) == _digests(built)


def test_loads_offline_and_runs(built: Path) -> None:
    # A fresh interpreter with the hub unreachable: loading and one forward must still work.
    code = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "p = sys.argv[1]\n"
        "tok = AutoTokenizer.from_pretrained(p)\n"
        "ids = tok('hello world the capital of france is')['input_ids']\n"
        "assert tok.unk_token_id not in ids, ids\n"
        "m = AutoModelForCausalLM.from_pretrained(p)\n"
        "out = m(torch.tensor([ids])).logits\n"
        "assert out.shape == (1, len(ids), 1024), out.shape\n"
        "assert out.dtype == torch.float32\n"
        "print('ok', ids)\n"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HTTPS_PROXY="http://127.0.0.1:9", HTTP_PROXY="http://127.0.0.1:9")  # fmt: skip
    r = subprocess.run(
        [sys.executable, "-c", code, str(built)],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("ok")


def test_random_prompts() -> None:
    a = random_prompts(5, 64, seed=3)
    assert a == random_prompts(5, 64, seed=3)
    assert a != random_prompts(5, 64, seed=4)
    assert len(a) == 5 and all(len(p) == 64 for p in a)
    assert all(NUM_SPECIAL_TOKENS <= t < VOCAB_SIZE for p in a for t in p)
    assert random_prompts(0, 8) == []
    with pytest.raises(ValueError):
        random_prompts(1, 0)
