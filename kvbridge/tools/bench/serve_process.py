"""One ``vllm bench serve`` run: its command line and its process.

Contract: :func:`bench_serve_command` builds the command (random dataset, streamed
``/v1/completions``, ``--ignore-eos``, the result JSON in ``result_dir/name.json``) and starts
nothing; :func:`run_bench_process` runs it in its own process group, offline (no Hugging Face
hub), and always kills the group on the way out, also on Ctrl-C. Shared by ``kvbridge bench
serve``, the simulator's calibration and ``benchmarks/``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from kvbridge.tools.priority import follow_niceness
from kvbridge.tools.procs import end_group

__all__ = ["bench_serve_command", "run_bench_process"]


def bench_serve_command(url: str, model: Path, result_dir: Path, name: str, *, rate: float,
                        num_prompts: int, input_len: int, output_len: int, seed: int,
                        warmups: int = 0, ready_check_s: int | None = None,
                        request_id_prefix: str | None = None,
                        python: str = sys.executable) -> list[str]:
    """The ``vllm bench serve`` command line of one run (result in ``result_dir/name.json``).

    *ready_check_s* None keeps bench serve's default ready check (a request with the first
    prompt); 0 skips it. *request_id_prefix*: request ``i`` is sent with ``X-Request-Id``
    ``<prefix><i>`` (bench serve's default prefix is random).
    """
    cmd = [
        python, "-m", "kvbridge.integrations.vllm_serve", "bench", "serve",
        "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
        "--model", "tiny", "--tokenizer", str(model),
        "--dataset-name", "random", "--random-input-len", str(input_len),
        "--random-output-len", str(output_len), "--num-prompts", str(num_prompts),
        "--request-rate", f"{rate:g}", "--ignore-eos", "--seed", str(seed),
        "--num-warmups", str(warmups),
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--save-result", "--save-detailed", "--result-dir", str(result_dir),
        "--result-filename", f"{name}.json", "--disable-tqdm",
    ]  # fmt: skip
    if ready_check_s is not None:
        cmd += ["--ready-check-timeout-sec", str(ready_check_s)]
    if request_id_prefix is not None:
        cmd += ["--request-id-prefix", request_id_prefix]
    return cmd


def run_bench_process(cmd: Sequence[str], log_path: Path, timeout: float) -> int:
    """Run ``vllm bench serve`` in its own process group, output to *log_path*; its exit
    status, or -1 after *timeout* seconds. The group is killed on any exit (also Ctrl-C). It
    runs at the caller's niceness, its session too (:mod:`kvbridge.tools.priority`; where that
    is refused, the log's first line says why)."""
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                env={**os.environ, "HF_HUB_OFFLINE": "1",
                                     "TRANSFORMERS_OFFLINE": "1"})
        why = follow_niceness(proc.pid)
        if why is not None:
            out.write(f"kvbridge: vllm bench serve's session keeps niceness 0: {why}\n".encode())
            out.flush()
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return -1
        finally:
            end_group(proc)

