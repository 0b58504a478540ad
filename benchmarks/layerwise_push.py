"""Layer-wise push vs whole-request push, alternating on one engine pair.

    .venv/bin/python benchmarks/layerwise_push.py [shm|nixl|mooncake]

Starts one P and one D (tiny model, 800-token prompts = 25 blocks of 32), sends 2 x 12 push
requests alternating ``kvbridge_layerwise`` off/on, and prints the medians of P-KV-ready →
D-recv-done (from the engines' control-channel timings) and of the client's TTFT for each.
"""

from __future__ import annotations

import concurrent.futures as cf
import statistics
import sys
import time

from kvbridge.config import TransferMode
from kvbridge.params import prefill_request, push_decode_request
from kvbridge.tools.client import complete, probe, stats_reply, stream_complete
from kvbridge.tools.engines import VllmServer, start_servers
from kvbridge.tools.tiny_model import build_tiny_model, random_prompts

N = 12


def main(backend: str) -> None:
    model = build_tiny_model()
    env = {"VLLM_TARGET_DEVICE": "cpu", "KVBRIDGE_ENGINE_SPIN_MS": "2"}
    servers = [
        VllmServer(model, name=name, cpu_bind=core, env=env, extra_args=["--block-size", "32"],
                   kv_transfer_config={"kv_connector": "KVBridgeConnector", "kv_role": role,
                                       "engine_id": f"lw-{name}",
                                       "kv_connector_extra_config": {"backend": backend}})
        for name, core, role in (("P", "0", "kv_producer"), ("D", "1", "kv_consumer"))
    ]
    p, d = servers
    try:
        start_servers(servers, timeout=600)
        probes = {s.name: probe(s.url) for s in servers}
        address = {k: v.peer(0).address for k, v in probes.items()}
        handoff: dict[bool, list[float]] = {False: [], True: []}
        ttft: dict[bool, list[float]] = {False: [], True: []}
        for i, prompt in enumerate(random_prompts(2 * N + 2, 800, seed=7)):
            layerwise, tid = bool(i % 2), f"lw-{i}"
            d_params = push_decode_request(probes["P"], tid)
            p_params = prefill_request(tid, TransferMode.PUSH, layerwise)
            with cf.ThreadPoolExecutor(2) as ex:
                fd = ex.submit(stream_complete, d.url, prompt, 8, d_params, {"ignore_eos": True})
                time.sleep(0.05)  # D registers first, so P can write layer by layer
                fp = ex.submit(complete, p.url, prompt, 1, p_params)
                result = fd.result(timeout=120)
                fp.result(timeout=120)
            if i < 2:
                continue  # warm-up, one of each
            replies = {k: stats_reply(a) for k, a in address.items()}
            pt = replies["P"].timings[tid]
            dt = replies["D"].timings[tid]
            handoff[layerwise].append((dt["recv_done"] - pt["kv_ready"]) * 1000)
            ttft[layerwise].append((result.ttft or float("nan")) * 1000)
        for layerwise in (False, True):
            h = sorted(handoff[layerwise])
            print(f"{backend} layerwise={layerwise}: kv_ready->recv_done p50 "
                  f"{statistics.median(h):.2f} ms (min {h[0]:.2f}, max {h[-1]:.2f}); "
                  f"TTFT p50 {statistics.median(ttft[layerwise]):.1f} ms, n={len(h)}")
    finally:
        for s in servers:
            s.stop()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "shm")
