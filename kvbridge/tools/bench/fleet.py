"""The engines the benches start: the configurations and their (P, D) or xPyD ``VllmServer`` specs.

Contract: :func:`engine_specs` and :func:`fleet_specs` build :class:`~kvbridge.tools.engines.
VllmServer` objects and start nothing (the caller starts and always stops them); every
configuration runs the tiny model on CPU with ``--block-size 32``. ``vllm-nixl-*`` are vLLM's
own NIXL connectors as shipped (each engine its own NIXL side-channel port); ``kvbridge-*`` are
``KVBridgeConnector`` on one backend, with ``KVBRIDGE_ENGINE_SPIN_MS`` unless told otherwise.
Shared by ``kvbridge bench e2e``, ``handoff``, ``serve``, the simulator's calibration and
``benchmarks/``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from kvbridge.errors import ConfigError
from kvbridge.host.placement import fleet_cores
from kvbridge.tools.engines import VllmServer, free_port

__all__ = ["BENCH_BACKENDS", "CONFIG_NAMES", "MAX_FLEET", "PIN_HELP", "VLLM_PUSH_D_ENGINE",
           "VLLM_PUSH_P_ENGINE", "engine_specs", "fleet_specs", "side_channel_port"]

#: the transports a bench can run kvbridge's engines on (configuration ``kvbridge-<backend>``)
BENCH_BACKENDS: tuple[str, ...] = ("shm", "nixl", "mooncake")
#: what ``kvbridge bench e2e`` compares by default (every ``kvbridge-<backend>`` is accepted)
CONFIG_NAMES: tuple[str, ...] = ("vllm-nixl-pull", "vllm-nixl-push", "kvbridge-shm",
                                 "kvbridge-nixl")
BASELINE = "vllm-nixl-pull"
VLLM_PUSH_P_ENGINE = "prefill-engine-001"
VLLM_PUSH_D_ENGINE = "decode-engine-001"

PIN_HELP = ("restrict every process and thread of each engine to its core (P 0, D 1), not only "
            "vLLM's OpenMP threads, so one engine's API server and threads do not run on the "
            "other's core")


def _kvbridge_backend(config: str) -> str | None:
    """The backend of a ``kvbridge-<backend>`` configuration, else None."""
    kind, _, backend = config.partition("-")
    return backend if kind == "kvbridge" and backend in BENCH_BACKENDS else None


def _kvbridge_connector(role: str, engine_id: str, backend: str) -> dict[str, Any]:
    return {"kv_connector": "KVBridgeConnector", "kv_role": role, "engine_id": engine_id,
            "kv_connector_extra_config": {"backend": backend}}


def engine_specs(config: str, model: Path, log_dir: Path, engine_spin_ms: float = 2.0,
                 pin: bool = False) -> tuple[VllmServer, VllmServer]:
    """The (P, D) engines of *config*, not started: P on core 0, D on core 1 (vLLM's OpenMP
    threads; with *pin* every process and thread of each engine).

    kvbridge's engines get ``KVBRIDGE_ENGINE_SPIN_MS`` (its recommended setting on small hosts)
    unless *engine_spin_ms* is negative; vLLM's own connectors run as shipped.
    """
    env_p = {"VLLM_TARGET_DEVICE": "cpu"}
    env_d = {"VLLM_TARGET_DEVICE": "cpu"}
    if config in ("vllm-nixl-pull", "vllm-nixl-push"):
        connector = "NixlConnector" if config == "vllm-nixl-pull" else "NixlPushConnector"
        kv_p: dict[str, Any] = {"kv_connector": connector, "kv_role": "kv_producer",
                                "kv_buffer_device": "cpu"}
        kv_d: dict[str, Any] = {"kv_connector": connector, "kv_role": "kv_consumer",
                                "kv_buffer_device": "cpu"}
        if config == "vllm-nixl-push":
            kv_p["engine_id"] = VLLM_PUSH_P_ENGINE
            kv_d["engine_id"] = VLLM_PUSH_D_ENGINE
        p_port = free_port()
        d_port = free_port()
        while d_port == p_port:
            d_port = free_port()
        env_p["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(p_port)
        env_d["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(d_port)
    elif (backend := _kvbridge_backend(config)) is not None:
        kv_p = _kvbridge_connector("kv_producer", f"bench-{backend}-P", backend)
        kv_d = _kvbridge_connector("kv_consumer", f"bench-{backend}-D", backend)
        if engine_spin_ms >= 0:
            spin = str(engine_spin_ms)
            env_p["KVBRIDGE_ENGINE_SPIN_MS"] = env_d["KVBRIDGE_ENGINE_SPIN_MS"] = spin
    else:
        raise ConfigError(f"unknown configuration {config!r}")
    args = ["--block-size", "32"]
    p = VllmServer(model, name=f"{config}-P", kv_transfer_config=kv_p, cpu_bind="0", env=env_p,
                   extra_args=args, log_path=log_dir / f"{config}-prefill.log", pin_cpus=pin)
    d = VllmServer(model, name=f"{config}-D", kv_transfer_config=kv_d, cpu_bind="1", env=env_d,
                   extra_args=args, log_path=log_dir / f"{config}-decode.log", pin_cpus=pin)
    return p, d


MAX_FLEET = 8
"""Most engines of one role :func:`fleet_specs` builds."""


def fleet_specs(config: str, model: Path, log_dir: Path, engine_spin_ms: float = 2.0,
                prefill: int = 1, decode: int = 1, pin: bool = False
                ) -> tuple[list[VllmServer], list[VllmServer]]:
    """The ``prefill`` P and ``decode`` D engines of a kvbridge *config*, not started.

    1P1D is :func:`engine_specs` unchanged (any config). A larger fleet (xPyD) is kvbridge's
    only, since vLLM's connectors are benchmarked behind a one-P-one-D stock proxy. P and D
    engines get disjoint cores of those this process may use (:func:`fleet_cores`: on two cores
    every P on the first, every D on the second; a P and a D confined to one core livelock in
    UCX's connection set-up), with engine ids and logs numbered per role. *pin*: each engine's
    whole process tree too (:func:`engine_specs`).
    """
    if not (1 <= prefill <= MAX_FLEET and 1 <= decode <= MAX_FLEET):
        raise ConfigError(f"a fleet has 1..{MAX_FLEET} engines per role, not {prefill}P{decode}D")
    if (prefill, decode) == (1, 1):
        p, d = engine_specs(config, model, log_dir, engine_spin_ms, pin)
        return [p], [d]
    backend = _kvbridge_backend(config)
    if backend is None:
        raise ConfigError(f"{config} runs 1P1D only (its stock proxy has one P and one D); "
                          f"{prefill}P{decode}D needs a kvbridge configuration")
    env = {"VLLM_TARGET_DEVICE": "cpu"}
    if engine_spin_ms >= 0:
        env["KVBRIDGE_ENGINE_SPIN_MS"] = str(engine_spin_ms)
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0, 1]
    cores = dict(zip("PD", fleet_cores(cpus, prefill, decode), strict=True))
    out: dict[str, list[VllmServer]] = {"P": [], "D": []}
    roles = [("P", "kv_producer", "prefill", i) for i in range(prefill)]
    roles += [("D", "kv_consumer", "decode", i) for i in range(decode)]
    for tag, kv_role, word, i in roles:
        kv = _kvbridge_connector(kv_role, f"bench-{backend}-{tag}{i}", backend)
        out[tag].append(VllmServer(
            model, name=f"{config}-{tag}{i}", kv_transfer_config=kv,
            cpu_bind=str(cores[tag][i]), env=dict(env), extra_args=["--block-size", "32"],
            log_path=log_dir / f"{config}-{word}{i}.log", pin_cpus=pin))  # fmt: skip
    return out["P"], out["D"]


def side_channel_port(server: VllmServer) -> int:
    """The NIXL side-channel port :func:`engine_specs` gave a vLLM-connector engine."""
    return int(server.env["VLLM_NIXL_SIDE_CHANNEL_PORT"])

