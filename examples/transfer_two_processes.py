"""Move KV-shaped blocks between two processes with kvbridge's transport API.

    .venv/bin/python examples/transfer_two_processes.py [--backend shm|nixl|mooncake]
    .venv/bin/python examples/transfer_two_processes.py --backend compose --members memory,shm,nixl

The parent registers a "prefill" cache, a spawned child registers a "decode" cache; they swap
metadata over a pipe (in kvbridge proper, the control channel does this) with a proof each side
attested (``invite``: a transport loads only a peer whose data plane shows one), the parent WRITEs
scattered blocks into the child with a notification, and the child checks every byte. With
``compose`` the first member that reaches the child carries the WRITE (``memory`` cannot: the
child is another process) and the output names it.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
from typing import Any

import numpy as np

from kvbridge import registry
from kvbridge.layout import KVLayout, descriptor_pair
from kvbridge.transport import MemoryRegion, Op

SHAPE = (64, 2, 16, 64)  # vLLM's CPU layout per layer: (num_blocks, K/V, block_size, heads*dim)


def _cache(seed: int) -> tuple[dict[str, np.ndarray], KVLayout]:
    rng = np.random.default_rng(seed)
    caches = {f"layer.{i}": rng.standard_normal(SHAPE, dtype=np.float32) for i in range(2)}
    return caches, KVLayout.from_tensors(caches, num_blocks=SHAPE[0], block_size=SHAPE[2])


def decode_side(conn: Any, backend: str, options: dict[str, Any]) -> None:
    caches, layout = _cache(seed=2)
    transport = registry.create(backend, "decode", options)
    meta = transport.register_memory([MemoryRegion(a, n) for a, n in layout.regions()])
    conn.send((meta, layout.to_dict(), transport.invite()))
    peer_meta, proof = conn.recv()
    transport.add_peer(peer_meta, proof)
    dst = conn.recv()
    while not transport.get_notifications():  # the WRITE's notification: the bytes are here
        if conn.poll(0.01):
            break
    conn.send(np.stack([c[dst] for c in caches.values()]))
    transport.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="shm")
    parser.add_argument("--members", default="memory,shm",
                        help="compose: comma-separated member transports, in order")
    args = parser.parse_args()
    options = {"members": args.members.split(",")} if args.backend == "compose" else {}
    caches, layout = _cache(seed=1)
    transport = registry.create(args.backend, "prefill", options)
    mine = transport.register_memory([MemoryRegion(a, n) for a, n in layout.regions()])
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=decode_side, args=(child_conn, args.backend, options))
    child.start()
    try:
        peer_meta, peer_layout, proof = conn.recv()
        peer = transport.add_peer(peer_meta, proof)
        conn.send((mine, transport.invite(peer_meta)))
        src, dst = [3, 4, 5, 10, 11], [40, 41, 42, 7, 8]  # two runs -> 2 descriptors per plane
        conn.send(dst)
        local, remote = descriptor_pair(layout, src, KVLayout.from_dict(peer_layout), dst)
        transport.transfer(Op.WRITE, peer, local, remote, notification=b"done")
        got = conn.recv()
        expected = np.stack([c[src] for c in caches.values()])
        ok = np.array_equal(got, expected)
        member_for = getattr(transport, "member_for", None)
        via = f" through member {member_for(peer)}" if member_for else ""
        print(f"{args.backend}{via}: wrote {len(src)} blocks as {len(local)} descriptors "
              f"({int(local[:, 1].sum())} bytes): {'every byte arrived' if ok else 'MISMATCH'}")
        return 0 if ok else 1
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
        transport.close()


if __name__ == "__main__":
    sys.exit(main())
