"""A tiny random-weight Qwen3 model for tests, benchmarks and the demo.

:func:`build_tiny_model` writes a complete Hugging Face model directory (``config.json``,
``model.safetensors``, ``generation_config.json`` and a ``tokenizers`` WordLevel tokenizer saved
as ``PreTrainedTokenizerFast``) that ``vllm serve`` loads like any checkpoint:

- Qwen3ForCausalLM, hidden 128, 2 layers, 4 attention heads / 2 KV heads, head dim 32,
  vocabulary 1024, float32, ``max_position_embeddings`` 4096 (about 0.6 M parameters, 2.5 MB).
- Deterministic from the seed: a rebuild with the same seed writes the same bytes.
- Idempotent and cheap: a stamp file holds a hash of the full specification; when it matches,
  nothing is rebuilt (no transformers import at all).
- Never touches the network: ``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE`` are set before
  transformers is imported, and nothing is downloaded.

Concurrent builders of the same directory are serialised with an ``flock`` on a sibling lock
file, and a build goes to a temporary directory first, so a reader never sees half a model.

:func:`random_prompts` returns seeded token-id prompts that avoid the special ids.

:func:`build_tiny_hybrid_model` builds a hybrid sibling the same way: a Gemma 3 text model whose
layers mix sliding-window and full attention, so vLLM's hybrid KV-cache manager gives it several
KV-cache groups (:func:`tiny_hybrid_model_spec`).

:func:`build_bench_model` builds a bigger sibling the same way (~100 M parameters, for
``kvbridge bench offload``: prefill has to cost real time), :func:`bench_prompts` its prompts.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import json
import logging
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

__all__ = [
    "VOCAB_SIZE",
    "NUM_SPECIAL_TOKENS",
    "PAD_ID",
    "UNK_ID",
    "BOS_ID",
    "EOS_ID",
    "STAMP_NAME",
    "tiny_model_spec",
    "build_tiny_model",
    "random_prompts",
    "default_cache_dir",
    "BENCH_VOCAB_SIZE",
    "BENCH_MIN_PARAMS",
    "bench_model_spec",
    "spec_param_count",
    "build_bench_model",
    "bench_prompts",
    "HYBRID_WINDOW",
    "tiny_hybrid_model_spec",
    "build_tiny_hybrid_model",
]

log = logging.getLogger("kvbridge.tools.tiny_model")

VOCAB_SIZE = 1024
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
NUM_SPECIAL_TOKENS = 4
STAMP_NAME = ".kvbridge-tiny-model.json"
_BUILDER_VERSION = 2

# A few real words first, so that text prompts like "hello world" map to known tokens.
_WORDS = (
    "the of and to in is was for on that with as by at from it be this are an or which "
    "hello world capital city france paris germany berlin japan tokyo river mountain sea "
    "one two three four five six seven eight nine ten red green blue black white cat dog "
    "bird fish tree house car road book water fire earth air sun moon star day night time "
    "year man woman child people good new first last long great little own other old right "
    "big high small large next early young important few public bad same able what when "
    "where who how why yes no not all any each many more most some such only very can will "
    "just do go get make know think take see come want look use find give tell work call try "
    "ask need feel become leave put mean keep let begin seem help show hear play run move "
    "live believe hold bring happen write provide sit stand lose pay meet include continue "
    "set learn change lead understand watch follow stop create speak read allow add spend "
    "grow open walk win offer remember love consider appear buy wait serve die send expect "
    "build stay fall cut reach kill remain"
).split()


def tiny_model_spec(seed: int = 0) -> dict[str, Any]:
    """The full specification the model is built from; its hash is the stamp."""
    return {
        "builder_version": _BUILDER_VERSION,
        "seed": seed,
        "config": {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "vocab_size": VOCAB_SIZE,
            "hidden_size": 128,
            "intermediate_size": 512,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "hidden_act": "silu",
            "max_position_embeddings": 4096,
            "initializer_range": 0.02,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True,
            "rope_theta": 10000.0,
            "attention_bias": False,
            "use_sliding_window": False,
            "bos_token_id": BOS_ID,
            "eos_token_id": EOS_ID,
            "pad_token_id": PAD_ID,
            "dtype": "float32",
        },
    }


def _spec_hash(spec: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def default_cache_dir() -> Path:
    """``$KVBRIDGE_CACHE_DIR`` or ``~/.cache/kvbridge``."""
    env = os.environ.get("KVBRIDGE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "kvbridge"


def _is_built(path: Path, digest: str) -> bool:
    stamp = path / STAMP_NAME
    try:
        data = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(data, dict)
        and data.get("hash") == digest
        and (path / "model.safetensors").is_file()
        and (path / "config.json").is_file()
        and (path / "tokenizer.json").is_file()
    )


def _vocab(size: int = VOCAB_SIZE) -> dict[str, int]:
    vocab = {"<pad>": PAD_ID, "<unk>": UNK_ID, "<s>": BOS_ID, "</s>": EOS_ID}
    for word in _WORDS:
        if word not in vocab and len(vocab) < size:
            vocab[word] = len(vocab)
    while len(vocab) < size:
        vocab[f"t{len(vocab)}"] = len(vocab)
    return vocab


def _write_tokenizer(out: Path, vocab_size: int = VOCAB_SIZE,
                     model_max_length: int = 4096) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # vLLM's: optional

    transformers: Any = importlib.import_module("transformers")
    tok = Tokenizer(models.WordLevel(vocab=_vocab(vocab_size), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        model_max_length=model_max_length,
    )
    fast.save_pretrained(str(out))


#: architecture → its transformers config class
_CONFIGS = {"Qwen3ForCausalLM": "Qwen3Config", "Gemma3ForCausalLM": "Gemma3TextConfig"}


def _write_model(out: Path, spec: dict[str, Any]) -> None:
    import torch  # optional and heavy: only building a model needs it

    transformers: Any = importlib.import_module("transformers")
    cfg = dict(spec["config"])
    arch = cfg.pop("architectures")[0]
    cfg.pop("model_type")
    cfg.pop("dtype")
    config = getattr(transformers, _CONFIGS[arch])(**cfg)
    config.architectures = [arch]
    init = spec.get("init", {})
    torch.manual_seed(spec["seed"])
    with torch.no_grad():
        model = getattr(transformers, arch)(config).to(torch.float32)
        # Re-draw every parameter from a private generator: the result depends on the seed only,
        # not on how transformers happens to order its default initialisation.
        gen = torch.Generator().manual_seed(spec["seed"])
        for name, param in sorted(model.named_parameters()):
            if name.endswith(("q_norm.weight", "k_norm.weight")) and "qk_norm" in init:
                param.fill_(init["qk_norm"])
            elif name.endswith("norm.weight"):
                param.fill_(init.get("norm", 1.0))
            elif "embed" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * init.get("embed", 1.0))
            else:
                # 2/sqrt(fan_in): large enough that attention over the whole prompt decides the
                # next token (with the usual 0.02 a random model repeats one token whatever its
                # KV cache holds, and a P/D test comparing outputs would have no teeth).
                scale = 2.0 / param.shape[1] ** 0.5
                param.copy_(torch.randn(param.shape, generator=gen) * scale)
    transformers.utils.logging.disable_progress_bar()
    model.save_pretrained(str(out), safe_serialization=True)


def build_tiny_model(path: str | Path | None = None, seed: int = 0) -> Path:
    """Build (or reuse) the tiny model at *path* and return its directory.

    *path* defaults to ``default_cache_dir() / f"tiny-qwen3-s{seed}"``. Blocking (about 5–10 s
    for a fresh build, dominated by importing transformers; milliseconds when the stamp matches).
    Safe to call from several processes at once. Raises ``OSError`` if the directory cannot be
    written.
    """
    target = Path(path) if path is not None else default_cache_dir() / f"tiny-qwen3-s{seed}"
    return _build(target, tiny_model_spec(seed), "tiny model")


def _build(target: Path, spec: dict[str, Any], what: str) -> Path:
    """Build *spec* at *target* unless its stamp matches (locked, via a temporary directory)."""
    target = target.expanduser().resolve()
    seed = spec["seed"]
    digest = _spec_hash(spec)
    if _is_built(target, digest):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.parent / f".{target.name}.lock"
    with open(lock_path, "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if _is_built(target, digest):  # another process built it meanwhile
                return target
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
            os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
            log.info("building %s (seed %d) at %s", what, seed, target)
            tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
            try:
                _write_model(tmp, spec)
                cfg = spec["config"]
                if cfg["vocab_size"] == VOCAB_SIZE:
                    _write_tokenizer(tmp)
                else:
                    _write_tokenizer(tmp, cfg["vocab_size"], cfg["max_position_embeddings"])
                (tmp / STAMP_NAME).write_text(
                    json.dumps({"hash": digest, "spec": spec}, sort_keys=True, indent=1) + "\n"
                )
                tmp.chmod(0o755)  # mkdtemp makes it private; the model is not a secret
                for child in tmp.iterdir():
                    child.chmod(0o644)
                if target.exists():
                    shutil.rmtree(target)
                os.replace(tmp, target)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return target


# -- the hybrid model ----------------------------------------------------------------------------

#: sliding window of the hybrid model's windowed layers (tokens; not a multiple of a block)
HYBRID_WINDOW = 48


def tiny_hybrid_model_spec(seed: int = 0) -> dict[str, Any]:
    """The hybrid model: Gemma3ForCausalLM (text), hidden 128, 3 layers — sliding window
    :data:`HYBRID_WINDOW`, sliding window, full attention — 4 heads / 2 KV heads, head dim 32,
    vocabulary 1024 (the tiny model's tokenizer), float32, untied embeddings.

    vLLM's hybrid KV-cache manager makes three KV-cache groups of it (two sliding-window
    groups, one full-attention group; one layer each, all three over the same memory). The
    initialisation is chosen so that the output depends on the whole prompt: Gemma's norms
    scale by ``1 + weight`` (weights 0), the query/key norms by 4 (sharp attention), small
    embeddings (the token's own embedding does not drown the attention in the residual) and an
    untied head (tied, a random Gemma repeats its input token). Changing the prompt's 6th token
    of 200 — only the full-attention layer still sees it — changes the greedy output.
    """
    return {
        "builder_version": _BUILDER_VERSION,
        "seed": seed,
        "kind": "hybrid",
        "init": {"norm": 0.0, "qk_norm": 3.0, "embed": 0.05},
        "config": {
            "architectures": ["Gemma3ForCausalLM"],
            "model_type": "gemma3_text",
            "vocab_size": VOCAB_SIZE,
            "hidden_size": 128,
            "intermediate_size": 512,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "query_pre_attn_scalar": 32,
            "max_position_embeddings": 4096,
            "sliding_window": HYBRID_WINDOW,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
            "bos_token_id": BOS_ID,
            "eos_token_id": EOS_ID,
            "pad_token_id": PAD_ID,
            "dtype": "float32",
        },
    }


def build_tiny_hybrid_model(path: str | Path | None = None, seed: int = 0) -> Path:
    """Build (or reuse) the hybrid model (:func:`tiny_hybrid_model_spec`) at *path*; same
    machinery and guarantees as :func:`build_tiny_model`. *path* defaults to
    ``default_cache_dir() / f"tiny-gemma3-hybrid-s{seed}"``."""
    target = (Path(path) if path is not None
              else default_cache_dir() / f"tiny-gemma3-hybrid-s{seed}")
    return _build(target, tiny_hybrid_model_spec(seed), "tiny hybrid model")


# -- the bench model -----------------------------------------------------------------------------

#: vocabulary of the bench model (ids below :data:`VOCAB_SIZE` are the tiny model's tokens)
BENCH_VOCAB_SIZE = 32768
#: the bench model must have at least this many parameters (checked by :func:`build_bench_model`)
BENCH_MIN_PARAMS = 100_000_000


def bench_model_spec(seed: int = 0) -> dict[str, Any]:
    """The specification of the bench model: the tiny model's recipe at ~100 M parameters.

    Qwen3ForCausalLM, hidden 768, 12 layers, 12 attention heads / 4 KV heads, head dim 64,
    intermediate 2048, vocabulary 32768, tied embeddings, float32, 8192 positions
    (:func:`spec_param_count`: about 100.7 M parameters, 403 MB). KV per token: 12 layers × K/V
    × 4 heads × 64 × 4 bytes = 24 KiB.
    """
    spec = tiny_model_spec(seed)
    spec["kind"] = "bench"
    spec["config"].update({
        "vocab_size": BENCH_VOCAB_SIZE,
        "hidden_size": 768,
        "intermediate_size": 2048,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "max_position_embeddings": 8192,
    })
    return spec


def spec_param_count(spec: dict[str, Any]) -> int:
    """Parameters of the Qwen3 model *spec* describes, computed from its shape (builds nothing)."""
    c = spec["config"]
    h, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    q = c["num_attention_heads"] * c["head_dim"]
    kv = c["num_key_value_heads"] * c["head_dim"]
    bias = q + 2 * kv + h if c.get("attention_bias") else 0
    attn = h * q + 2 * h * kv + q * h + bias + 2 * c["head_dim"]  # q/k/v/o + q_norm, k_norm
    mlp = 3 * h * inter
    per_layer = attn + mlp + 2 * h  # input and post-attention RMSNorm
    embed = c["vocab_size"] * h
    head = 0 if c.get("tie_word_embeddings", True) else c["vocab_size"] * h
    return int(embed + layers * per_layer + h + head)  # + the final norm


def build_bench_model(path: str | Path | None = None, seed: int = 0) -> Path:
    """Build (or reuse) the ~100 M-parameter bench model (:func:`bench_model_spec`) at *path*.

    *path* defaults to ``default_cache_dir() / f"bench-qwen3-s{seed}"``. Same machinery and
    guarantees as :func:`build_tiny_model` (offline, deterministic, stamped, locked); a fresh
    build takes about 15–30 s and writes ~400 MB. Raises ``ValueError`` if the specification
    has fewer than :data:`BENCH_MIN_PARAMS` parameters.
    """
    spec = bench_model_spec(seed)
    n = spec_param_count(spec)
    if n < BENCH_MIN_PARAMS:
        raise ValueError(f"bench model has {n} parameters, fewer than {BENCH_MIN_PARAMS}")
    target = Path(path) if path is not None else default_cache_dir() / f"bench-qwen3-s{seed}"
    return _build(target, spec, "bench model")


def bench_prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    """Like :func:`random_prompts` over the bench model's whole vocabulary."""
    if n < 0 or length < 1:
        raise ValueError(f"need n >= 0 and length >= 1, got n={n} length={length}")
    rng = random.Random(seed)
    return [
        [rng.randrange(NUM_SPECIAL_TOKENS, BENCH_VOCAB_SIZE) for _ in range(length)]
        for _ in range(n)
    ]


def random_prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    """*n* prompts of *length* token ids each, drawn from the non-special ids; deterministic."""
    if n < 0 or length < 1:
        raise ValueError(f"need n >= 0 and length >= 1, got n={n} length={length}")
    rng = random.Random(seed)
    return [
        [rng.randrange(NUM_SPECIAL_TOKENS, VOCAB_SIZE) for _ in range(length)] for _ in range(n)
    ]
