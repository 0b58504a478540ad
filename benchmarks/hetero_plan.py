"""What heterogeneous TP and block size cost to plan: descriptors and CPU time per part.

    PYTHONPATH=. .venv/bin/python benchmarks/hetero_plan.py [--tokens 16384] [--reps 5]

A Qwen3-32B-shaped KV cache (64 layers, 8 KV heads, head dim 128, bf16) in vLLM's CPU block
format (one plane per layer, per head K as ``[head_dim, N]`` then V as ``[N, head_dim]``), on
synthetic addresses (no memory is touched: only the plan and the descriptor arrays are built).
For each shape one decode rank's part from one prefill rank is planned (``mapping.pair``, views
cached after the first call as on a live engine) and turned into descriptors
(``mapping.descriptors``); equal TP and block size through the same path is the baseline.
Block ids are a random permutation (no run coalesces: the worst case). Shapes are interleaved,
``--reps`` rounds; the table prints the median CPU time (``time.process_time``) and the ratio
to the baseline.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from kvbridge.heads import HeadSplit
from kvbridge.layout import KVLayout, KVPlane
from kvbridge.scheduling import mapping
from kvbridge.tools.report import print_table

LAYERS, HEADS, HEAD_DIM, ITEM = 64, 8, 128, 2


def rank(tp: int, r: int, block: int, num_blocks: int) -> tuple[KVLayout, mapping.Shape]:
    split = HeadSplit.for_rank(HEADS, tp, r, HEAD_DIM, order="dt", interior="bench")
    per_block = split.heads * 2 * block * HEAD_DIM * ITEM
    stride = per_block
    planes = tuple(KVPlane(f"layer.{i}", (1 << 40) + i * (num_blocks + 1) * stride, stride,
                           per_block) for i in range(LAYERS))
    return (KVLayout(planes, num_blocks, block, "bfloat16"),
            mapping.Shape(tp, r, block, split))


def case(p_tp: int, d_tp: int, pb: int, db: int, tokens: int
         ) -> tuple[float, int, int, mapping.Share]:
    rng = np.random.default_rng(0)
    n_p, n_d = -(-tokens // pb), -(-tokens // db)
    p_ids = rng.permutation(n_p * 2)[:n_p]
    d_ids = rng.permutation(n_d * 2)[:n_d]
    d_layout, d_shape = rank(d_tp, 0, db, n_d * 2)
    share = mapping.sources(HEADS, p_tp, d_tp, 0)[0]
    p_layout, p_shape = rank(p_tp, share.rank, pb, n_p * 2)
    start = time.process_time()
    subs = mapping.pair(d_layout, d_shape, d_ids, 0, p_layout, p_shape, p_ids, 0, share,
                        mapping.Span(0, tokens))
    local, _ = mapping.descriptors(subs)
    took = time.process_time() - start
    return took, int(local.shape[0]), int(local[:, 1].sum()), share


HEAD = ["P tp/block -> D tp/block", "heads", "descriptors", "MiB", "ms (median)", "x baseline"]

Shape4 = tuple[int, int, int, int]


def table_rows(shapes: list[Shape4], times: dict[Shape4, list[float]],
               info: dict[Shape4, tuple[int, int, mapping.Share]]) -> list[list[str]]:
    """One row per shape under :data:`HEAD`; the first shape is the baseline."""
    base = statistics.median(times[shapes[0]])
    rows = []
    for s in shapes:
        count, nbytes, share = info[s]
        med = statistics.median(times[s])
        rows.append([f"{s[0]}/{s[2]} -> {s[1]}/{s[3]}", str(share.heads), str(count),
                     f"{nbytes / 2**20:.1f}", f"{med * 1000:.1f}", f"{med / base:.2f}"])
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    shapes: list[Shape4] = [(1, 1, 32, 32), (1, 2, 32, 32), (2, 1, 32, 32), (1, 8, 32, 32),
                            (8, 1, 32, 32), (1, 1, 32, 64), (1, 1, 64, 32), (2, 1, 32, 64)]
    times: dict[Shape4, list[float]] = {s: [] for s in shapes}
    info: dict[Shape4, tuple[int, int, mapping.Share]] = {}
    for s in shapes:  # warm the view cache, as a live engine's first transfer does
        case(*s, args.tokens)
    for _ in range(args.reps):
        for s in shapes:
            took, count, nbytes, share = case(*s, args.tokens)
            times[s].append(took)
            info[s] = (count, nbytes, share)
    print(f"{args.tokens} tokens, {LAYERS} layers x {HEADS} KV heads x head dim {HEAD_DIM}, bf16, "
          f"CPU block format; one decode rank's part from one prefill rank")
    print_table(HEAD, table_rows(shapes, times, info), ["l"] + ["r"] * (len(HEAD) - 1))


if __name__ == "__main__":
    main()
