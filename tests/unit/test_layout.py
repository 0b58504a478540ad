"""kvbridge.layout: layouts from real arrays, coalesced descriptors, fingerprints, compatibility."""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge.errors import KVBridgeError, LayoutError, LayoutMismatch
from kvbridge.layout import KVLayout, KVPlane, check_block_ids, descriptor_pair

NUM_BLOCKS = 10
BLOCK_SIZE = 4
HEADS = 2
HEAD_DIM = 8


def cpu_caches(layers: int = 3, dtype: str = "float32") -> dict[str, np.ndarray]:
    """vLLM CPU layout: (num_blocks, 2, block_size, heads*head_dim), K/V inside each block."""
    return {
        f"model.layers.{i}.self_attn": np.zeros(
            (NUM_BLOCKS, 2, BLOCK_SIZE, HEADS * HEAD_DIM), dtype=dtype
        )
        for i in range(layers)
    }


def gpu_caches(layers: int = 3, dtype: str = "float16") -> dict[str, np.ndarray]:
    """vLLM GPU (flash-attn) layout: (2, num_blocks, block_size, heads, head_dim)."""
    return {
        f"model.layers.{i}.self_attn": np.zeros(
            (2, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM), dtype=dtype
        )
        for i in range(layers)
    }


def fake_layout(base: int, planes: int = 4, num_blocks: int = 64, block_bytes: int = 256,
                stride: int | None = None, dtype: str = "bfloat16",
                block_size: int = 16) -> KVLayout:
    stride = block_bytes if stride is None else stride
    return KVLayout(
        tuple(
            KVPlane(f"p{i}", base + i * num_blocks * stride, stride, block_bytes)
            for i in range(planes)
        ),
        num_blocks,
        block_size,
        dtype,
    )


def expand(descs: np.ndarray, unit: int) -> list[int]:
    """Split descriptors into ``unit``-byte pieces, returning their start addresses in order."""
    out: list[int] = []
    for addr, length, _dev in descs.tolist():
        assert length % unit == 0
        out.extend(addr + k * unit for k in range(length // unit))
    return out


def reference(layout: KVLayout, ids: list[int]) -> list[int]:
    """Block start addresses plane-major, one per block, computed the slow obvious way."""
    return [p.base + b * p.block_stride for p in layout.planes for b in ids]


# -- from_tensors ---------------------------------------------------------------------------------


def test_from_tensors_cpu_layout_one_plane_per_layer() -> None:
    caches = cpu_caches()
    layout = KVLayout.from_tensors(caches, NUM_BLOCKS, BLOCK_SIZE)
    block_bytes = 2 * BLOCK_SIZE * HEADS * HEAD_DIM * 4
    assert len(layout.planes) == 3
    assert layout.dtype == "float32" and layout.block_size == BLOCK_SIZE
    for plane, arr in zip(layout.planes, caches.values(), strict=True):
        assert plane.base == arr.ctypes.data
        assert plane.block_bytes == block_bytes == plane.block_stride
        assert plane.dense
    assert layout.bytes_per_block == 3 * block_bytes
    assert sum(length for _, length in layout.regions()) == sum(a.nbytes for a in caches.values())


def test_from_tensors_gpu_layout_k_and_v_planes() -> None:
    caches = gpu_caches()
    layout = KVLayout.from_tensors(caches, NUM_BLOCKS, BLOCK_SIZE)
    block_bytes = BLOCK_SIZE * HEADS * HEAD_DIM * 2
    assert len(layout.planes) == 6
    assert layout.dtype == "float16"
    for i, arr in enumerate(caches.values()):
        k, v = layout.planes[2 * i], layout.planes[2 * i + 1]
        assert k.base == arr.ctypes.data
        assert v.base == arr.ctypes.data + NUM_BLOCKS * block_bytes
        assert k.block_bytes == v.block_bytes == block_bytes
        assert k.layer.endswith("#0") and v.layer.endswith("#1")
    # K and V of one layer touch, so each layer is one registration region
    assert len(layout.regions()) <= 3
    assert sum(length for _, length in layout.regions()) == sum(a.nbytes for a in caches.values())


def test_from_tensors_descriptors_hit_the_right_bytes() -> None:
    caches = gpu_caches(layers=2)
    layout = KVLayout.from_tensors(caches, NUM_BLOCKS, BLOCK_SIZE)
    arr = next(iter(caches.values()))
    desc = layout.descriptors([7])
    assert desc.shape == (4, 3)
    assert desc[0, 0] == arr[0, 7].ctypes.data and desc[0, 1] == arr[0, 7].nbytes
    assert desc[1, 0] == arr[1, 7].ctypes.data


def test_from_tensors_explicit_block_dim() -> None:
    caches = {"l0": np.zeros((2, NUM_BLOCKS, BLOCK_SIZE, 16), dtype=np.float32)}
    layout = KVLayout.from_tensors(caches, NUM_BLOCKS, BLOCK_SIZE, block_dim=1)
    assert len(layout.planes) == 2
    with pytest.raises(LayoutError, match="dimension 0"):
        KVLayout.from_tensors(caches, NUM_BLOCKS, BLOCK_SIZE, block_dim=0)


def test_from_tensors_torch_bfloat16() -> None:
    torch = pytest.importorskip("torch")
    caches = {"l0": torch.zeros((2, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM), dtype=torch.bfloat16)}
    layout = KVLayout.from_tensors(caches, NUM_BLOCKS, BLOCK_SIZE)
    assert layout.dtype == "bfloat16"
    assert layout.planes[0].base == caches["l0"].data_ptr()
    assert layout.planes[0].block_bytes == BLOCK_SIZE * HEADS * HEAD_DIM * 2


@pytest.mark.parametrize(
    ("caches", "match"),
    [
        ({}, "no KV-cache tensors"),
        ({"l0": np.zeros((3, 4))}, r"'l0'.*no dimension of size num_blocks"),
        ({"l0": np.zeros((NUM_BLOCKS, 2, 4, 8)).transpose(0, 2, 1, 3)}, r"'l0'.*not contiguous"),
        ({"l0": np.zeros((NUM_BLOCKS, 8), np.float32), "l1": np.zeros((NUM_BLOCKS, 8), np.float16)},
         "disagree on dtype"),
        ({"l0": [1, 2, 3]}, "not a tensor"),
    ],
    ids=["empty", "no-block-dim", "permuted", "mixed-dtype", "not-a-tensor"],
)
def test_from_tensors_rejects(caches: dict[str, object], match: str) -> None:
    with pytest.raises(LayoutError, match=match):
        KVLayout.from_tensors(caches, NUM_BLOCKS, BLOCK_SIZE)


def test_layout_rejects_empty_and_nonpositive() -> None:
    with pytest.raises(LayoutError, match="at least one plane"):
        KVLayout((), 4, 16, "bfloat16")
    with pytest.raises(LayoutError, match="num_blocks"):
        KVLayout((KVPlane("p", 4096, 64, 64),), 0, 16, "bfloat16")


# -- descriptors and coalescing -------------------------------------------------------------------


def test_contiguous_run_gives_one_descriptor_per_plane() -> None:
    local, remote = fake_layout(1 << 30), fake_layout(1 << 32)
    ldesc, rdesc = descriptor_pair(local, [3, 4, 5, 6], remote, [10, 11, 12, 13])
    assert ldesc.shape == rdesc.shape == (4, 3)
    assert ldesc.dtype == np.int64
    assert (ldesc[:, 1] == 4 * 256).all() and (rdesc[:, 1] == 4 * 256).all()
    assert ldesc[:, 0].tolist() == [p.base + 3 * 256 for p in local.planes]
    assert rdesc[:, 0].tolist() == [p.base + 10 * 256 for p in remote.planes]


def test_scattered_ids_give_one_descriptor_per_block() -> None:
    local, remote = fake_layout(1 << 30), fake_layout(1 << 32)
    lids, rids = [5, 1, 40, 7], [0, 9, 2, 63]
    ldesc, rdesc = descriptor_pair(local, lids, remote, rids)
    assert ldesc.shape == (4 * 4, 3)
    assert ldesc[:, 0].tolist() == reference(local, lids)
    assert rdesc[:, 0].tolist() == reference(remote, rids)
    assert (ldesc[:, 1] == 256).all()


def test_reversed_ids_do_not_merge() -> None:
    local, remote = fake_layout(1 << 30), fake_layout(1 << 32)
    ldesc, rdesc = descriptor_pair(local, [6, 5, 4, 3], remote, [6, 5, 4, 3])
    assert ldesc.shape == (16, 3)
    assert ldesc[:, 0].tolist() == reference(local, [6, 5, 4, 3])


def test_runs_break_when_either_side_jumps() -> None:
    local, remote = fake_layout(1 << 30, planes=2), fake_layout(1 << 32, planes=2)
    ldesc, rdesc = descriptor_pair(local, [1, 2, 3], remote, [5, 6, 9])
    assert ldesc[:, 1].tolist() == [512, 256, 512, 256]
    r0, r1 = remote.planes[0].base, remote.planes[1].base
    assert rdesc[:, 0].tolist() == [r0 + 5 * 256, r0 + 9 * 256, r1 + 5 * 256, r1 + 9 * 256]


def test_sparse_planes_never_merge() -> None:
    local = fake_layout(1 << 30, planes=2, stride=512)
    remote = fake_layout(1 << 32, planes=2, stride=512)
    ldesc, _ = descriptor_pair(local, [1, 2, 3], remote, [1, 2, 3])
    assert ldesc.shape == (6, 3)
    assert (ldesc[:, 1] == 256).all()


@pytest.mark.parametrize("seed", range(5))
def test_coalesced_matches_block_by_block_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    local, remote = fake_layout(1 << 30), fake_layout(1 << 32)
    n = int(rng.integers(1, 40))
    # mix of runs and jumps
    lids = np.concatenate([np.arange(s, s + 3) for s in rng.choice(20, 3, replace=False) * 3])[:n]
    half = lids.size // 2
    rids = np.concatenate([np.arange(40, 40 + half), rng.permutation(40)[: lids.size - half]])
    ldesc, rdesc = descriptor_pair(local, lids, remote, rids)
    assert (ldesc[:, 1] == rdesc[:, 1]).all()
    assert expand(ldesc, 256) == reference(local, lids.tolist())
    assert expand(rdesc, 256) == reference(remote, rids.tolist())


def test_empty_ids_give_empty_arrays() -> None:
    local = fake_layout(1 << 30)
    ldesc, rdesc = descriptor_pair(local, [], local, [])
    assert ldesc.shape == rdesc.shape == (0, 3)


def test_device_column() -> None:
    a = KVLayout((KVPlane("p", 1 << 30, 64, 64),), 8, 16, "bfloat16", device=3)
    b = KVLayout((KVPlane("p", 1 << 31, 64, 64),), 8, 16, "bfloat16", device=5)
    ldesc, rdesc = descriptor_pair(a, [0], b, [0])
    assert ldesc[0, 2] == 3 and rdesc[0, 2] == 5


@pytest.mark.parametrize(
    ("lids", "rids", "match"),
    [
        ([1, 2, 2], [1, 2, 3], "local block ids contain duplicates"),
        ([1, 2, 3], [4, 4, 5], "remote block ids contain duplicates"),
        ([-1, 2], [1, 2], r"local block id out of range \[0, 64\)"),
        ([1, 64], [1, 2], "local block id out of range"),
        ([1, 2], [0, 99], "remote block id out of range"),
        ([1, 2, 3], [1, 2], "3 local block ids but 2 remote"),
    ],
    ids=["dup-local", "dup-remote", "negative", "too-big", "remote-too-big", "unequal"],
)
def test_bad_block_ids_rejected(lids: list[int], rids: list[int], match: str) -> None:
    local, remote = fake_layout(1 << 30), fake_layout(1 << 32)
    with pytest.raises(LayoutError, match=match) as info:
        descriptor_pair(local, lids, remote, rids)
    assert isinstance(info.value, KVBridgeError)


def test_check_block_ids_flattens_and_accepts_numpy() -> None:
    ids = check_block_ids(np.array([[1, 2], [3, 4]], dtype=np.int32), 8)
    assert ids.dtype == np.int64 and ids.tolist() == [1, 2, 3, 4]


# -- identity -------------------------------------------------------------------------------------


def test_fingerprint_equal_for_equal_geometry() -> None:
    ca, cb = gpu_caches(), gpu_caches()  # both alive: different addresses
    a = KVLayout.from_tensors(ca, NUM_BLOCKS, BLOCK_SIZE)
    b = KVLayout.from_tensors(cb, NUM_BLOCKS, BLOCK_SIZE)
    assert a.planes[0].base != b.planes[0].base
    assert a.fingerprint() == b.fingerprint()
    # the block count is capacity, not geometry
    small, large = fake_layout(1, num_blocks=10), fake_layout(2, num_blocks=99)
    assert small.fingerprint() == large.fingerprint()


@pytest.mark.parametrize(
    "other",
    [
        fake_layout(1 << 32, dtype="float16"),
        fake_layout(1 << 32, block_size=32),
        fake_layout(1 << 32, planes=3),
        fake_layout(1 << 32, block_bytes=512),
    ],
    ids=["dtype", "block_size", "planes", "block_bytes"],
)
def test_fingerprint_differs_for_other_geometry(other: KVLayout) -> None:
    assert fake_layout(1 << 30).fingerprint() != other.fingerprint()


@pytest.mark.parametrize(
    ("other", "field"),
    [
        (fake_layout(1 << 32, dtype="float16"), "dtype differs: bfloat16 here, float16"),
        (fake_layout(1 << 32, block_size=32), "block_size differs: 16 here, 32"),
        (fake_layout(1 << 32, planes=3), "number of KV planes differs: 4 here, 3"),
        (fake_layout(1 << 32, block_bytes=512), "bytes per block of 'p0' differ: 256 here, 512"),
    ],
    ids=["dtype", "block_size", "planes", "block_bytes"],
)
def test_check_compatible_names_the_field(other: KVLayout, field: str) -> None:
    mine = fake_layout(1 << 30)
    with pytest.raises(LayoutMismatch, match=field):
        mine.check_compatible(other)
    with pytest.raises(LayoutMismatch):
        descriptor_pair(mine, [0], other, [0])


def test_to_dict_round_trip_and_malformed() -> None:
    layout = KVLayout.from_tensors(gpu_caches(), NUM_BLOCKS, BLOCK_SIZE)
    assert KVLayout.from_dict(layout.to_dict()) == layout
    with pytest.raises(LayoutError, match="malformed layout metadata"):
        KVLayout.from_dict({"planes": [["p", "x", 1, 1]], "num_blocks": 1, "block_size": 1,
                            "dtype": "f"})
    with pytest.raises(LayoutError, match="malformed layout metadata"):
        KVLayout.from_dict({"planes": []})
