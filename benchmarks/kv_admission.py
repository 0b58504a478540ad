"""A decode engine whose KV cache is tiny, under a burst of long prompts with long outputs,
behind the proxy with admission by KV credit off, ``reject`` and ``queue``.

    .venv/bin/python benchmarks/kv_admission.py [--kv-bytes 2097152] [--requests 32]
        [--prompt 600] [--max-tokens 300] [--modes pull,push] [--admission off,queue]

Starts one P and one D (``shm``; D with ``--kv-cache-memory-bytes``), sends the burst through a
proxy per admission setting, and prints per mode and setting: statuses, burst wall time, p50 and
max latency, and how many transfers D still holds afterwards (must be 0). Every process is
stopped at the end, also on failure.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import tempfile
import time
from pathlib import Path

from kvbridge.proxy.credit import KvAdmission
from kvbridge.tools.client import complete, output_token_ids, probe, stats_reply
from kvbridge.tools.engines import EngineError, VllmServer, start_servers
from kvbridge.tools.proxies import ProxyThread
from kvbridge.tools.report import percentile, print_table
from kvbridge.tools.tiny_model import build_tiny_model, random_prompts


def _engine(model: Path, logs: Path, name: str, role: str, core: str,
            extra: list[str]) -> VllmServer:
    kv = {"kv_connector": "KVBridgeConnector", "kv_role": role, "engine_id": f"adm-{name}",
          "kv_connector_extra_config": {"backend": "shm", "lease_s": 30, "push_timeout_s": 120,
                                        "prefill_wait_s": 120}}
    return VllmServer(model, name=name, kv_transfer_config=kv, cpu_bind=core,
                      env={"VLLM_TARGET_DEVICE": "cpu", "KVBRIDGE_ENGINE_SPIN_MS": "2"},
                      extra_args=["--block-size", "32", *extra], log_path=logs / f"{name}.log")


def _one(url: str, prompt: list[int], max_tokens: int) -> tuple[int, float]:
    t0 = time.monotonic()
    try:
        output_token_ids(complete(url, prompt, max_tokens, extra={"ignore_eos": True},
                                  timeout=300))
        return 200, time.monotonic() - t0
    except EngineError as exc:
        return exc.status or 0, time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kv-bytes", default="2097152", help="D's --kv-cache-memory-bytes")
    ap.add_argument("--requests", type=int, default=32, help="requests in the burst")
    ap.add_argument("--prompt", type=int, default=600, help="prompt tokens per request")
    ap.add_argument("--max-tokens", type=int, default=300, help="output tokens per request")
    ap.add_argument("--modes", default="pull,push", help="proxy modes, comma-separated")
    ap.add_argument("--admission", default="off,queue",
                    help="--kv-admission settings to compare, comma-separated")
    args = ap.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="kv-admission-"))
    model = build_tiny_model()
    p = _engine(model, logs, "P", "kv_producer", "0", [])
    d = _engine(model, logs, "D", "kv_consumer", "1", ["--kv-cache-memory-bytes", args.kv_bytes])
    rows = []
    try:
        start_servers([p, d], timeout=600)
        ref = probe(d.url).peer(0)
        prompts = random_prompts(args.requests, args.prompt, seed=7)
        for setting in args.admission.split(","):
            px = ProxyThread([p.url], [d.url], modes=args.modes.split(","), timeout_s=300.0,
                             kv_admission=KvAdmission(setting), kv_queue_s=300.0).start()
            try:
                for mode, url in px.urls.items():
                    with cf.ThreadPoolExecutor(args.requests) as ex:
                        t0 = time.monotonic()
                        res = list(ex.map(lambda pr, u=url: _one(u, pr, args.max_tokens),
                                          prompts))
                        wall = time.monotonic() - t0
                    lat = [t for _, t in res]
                    ok = sum(s == 200 for s, _ in res)
                    held = (stats_reply(str(ref.address)).pending
                            if ref is not None else -1)
                    rows.append([setting, mode, f"{ok}/{len(res)}", f"{wall:.1f}",
                                 f"{percentile(lat, 50) or 0:.1f}", f"{max(lat):.1f}", held])
            finally:
                px.close()
    finally:
        d.stop()
        p.stop()
    print(f"D KV {args.kv_bytes} bytes; {args.requests} x ({args.prompt} prompt + "
          f"{args.max_tokens} output) tokens; logs in {logs}")
    print_table(["admission", "mode", "200", "wall s", "p50 s", "max s", "D pending"], rows)


if __name__ == "__main__":
    main()
