"""Expert weights with prepended axes and uneven chunks, through megatron-core's own
``ShardedTensor`` and ``dist_checkpointing`` save/load, at two world sizes.

megatron-core hands a ``ShardedTensor`` without a regular grid to DCP as a
``CheckpointableShardedTensor``, whose ``ChunkStorageMetadata`` takes its offsets from
``global_offset`` (prepended axes + the tensor's dims) and its sizes from ``local_shape``
(the tensor's dims only). For an expert weight (prepended layer and expert axes) whose rows
are split unevenly over the expert-data-parallel ranks, upstream's save fails with an
``IndexError`` and a load of such a layout from a checkpoint of another layout fails too;
``dtensor.mcore.prepended_axes`` (a patch of ``CheckpointableShardedTensor.from_sh_ten``)
gives the chunks their prepended axes. With ``install()`` the ``.metadata`` holds 4-d chunks
and every layout loads exactly, at another world size too.

The expert weight ``[1 layer, 2 experts, 5 rows, 4 cols]``: "uneven" gives each of 2 ranks
rows 0:3 or 3:5 of both experts (two chunks per rank); "ep2" gives rank r expert r whole (a
regular grid: upstream's torch ``ShardedTensor`` path); at world size 1, "rows1" holds rows
0:1 and 1:5 of both experts and "whole" the tensor in one chunk.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from megatron_ckpt_fixes._dev.testing import run_ranks

pytestmark = pytest.mark.varies_with("megatron-core", "torch")

KEY = "decoder.layers.mlp.experts.linear_fc1.weight"
SHAPE = (1, 2, 5, 4)
#: layout -> world size -> rank -> the row ranges it holds of every expert (None: ep2/whole).
ROWS = {"uneven": {2: [(0, 3), (3, 5)]}, "rows1": {1: [(0, 1), (1, 5)]}}


def truth() -> torch.Tensor:
    return torch.arange(float(torch.Size(SHAPE).numel())).reshape(SHAPE)


def state(layout: str, rank: int, world: int, fill: bool = True) -> dict:
    """The layout's ShardedTensors on ``rank`` (zeros when not ``fill``: a load template)."""
    from megatron.core.dist_checkpointing import ShardedTensor

    full = truth() if fill else torch.zeros(SHAPE)
    if layout == "ep2":
        return {"e": ShardedTensor.from_rank_offsets(KEY, full[0, rank].clone(), (0, 0, 1),
                                                     (1, rank, 2), prepend_axis_num=2)}
    if layout == "whole":
        return {"e": ShardedTensor.from_rank_offsets(KEY, full[0].clone(), (0, 0, 1),
                                                     prepend_axis_num=1)}
    ranges = ROWS[layout][world]
    mine = [ranges[rank]] if world > 1 else ranges
    out = {}
    for expert in range(SHAPE[1]):
        for start, stop in mine:
            data = full[0, expert, start:stop].clone()
            out[f"e{expert}.{start}"] = ShardedTensor(  # no regular grid: 3 + 2 rows
                KEY, data, data.dtype, tuple(data.shape), SHAPE, (0, expert, start, 0), None,
                (0, 0, 0), prepend_axis_num=2)
    return out


def _save(layout: str, rank: int, world: int, ckpt: str) -> str | None:
    from megatron.core import dist_checkpointing as dc

    if rank == 0:
        os.makedirs(ckpt)
    dist.barrier()
    try:
        dc.save(state(layout, rank, world), ckpt)
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException too
        return f"{type(exc).__name__}: {exc}"
    return None


def _load(layout: str, rank: int, world: int, ckpt: str) -> dict:
    """The max delta of every loaded chunk, or the load's error."""
    from megatron.core import dist_checkpointing as dc

    try:
        loaded = dc.load(state(layout, rank, world, fill=False), ckpt)
    except BaseException as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}"}
    want = state(layout, rank, world)
    return {"delta": {k: float((loaded[k] - v.data).abs().max()) for k, v in want.items()}}


def _chunks(ckpt: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    from torch.distributed.checkpoint import FileSystemReader

    chunks = FileSystemReader(ckpt).read_metadata().state_dict_metadata[KEY].chunks
    return sorted((tuple(c.offsets), tuple(c.sizes)) for c in chunks)


def two_ranks(rank: int, world: int, root: str) -> dict:
    """Upstream first (its failures leave the group usable), then ``install()``."""
    import megatron_ckpt_fixes

    megatron_ckpt_fixes.install(["compat.cpu"])
    out = {"upstream_ep2": _save("ep2", rank, world, f"{root}/ep2")}
    out["upstream_ep2_into_uneven"] = _load("uneven", rank, world, f"{root}/ep2")
    megatron_ckpt_fixes.uninstall()
    megatron_ckpt_fixes.install()
    out["fixed_uneven"] = _save("uneven", rank, world, f"{root}/uneven")
    out["chunks"] = _chunks(f"{root}/uneven")
    for layout, ckpt in (("uneven", "uneven"), ("ep2", "uneven"), ("uneven", "ep2")):
        out[f"fixed_{ckpt}_into_{layout}"] = _load(layout, rank, world, f"{root}/{ckpt}")
    return out


def one_rank(rank: int, world: int, root: str) -> dict:
    """At world size 1: the 2-rank checkpoint into both layouts; upstream's own save."""
    import megatron_ckpt_fixes

    megatron_ckpt_fixes.install()
    out = {f"fixed_uneven_into_{layout}": _load(layout, rank, world, f"{root}/uneven")
           for layout in ("whole", "rows1")}
    megatron_ckpt_fixes.uninstall()
    megatron_ckpt_fixes.install(["compat.cpu"])
    out["upstream_rows1"] = _save("rows1", rank, world, f"{root}/rows1")
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[list[dict], dict]:
    root = str(tmp_path_factory.mktemp("prepended"))
    two = [r.value for r in run_ranks(two_ranks, 2, root, timeout_s=300)]
    one = run_ranks(one_rank, 1, root, timeout_s=300)[0].value
    return two, one


def _exact(outcome: dict) -> bool:
    return "error" not in outcome and set(outcome["delta"].values()) == {0.0}


def test_upstream_cannot_save_uneven_chunks_with_prepended_axes(runs):
    _, one = runs
    assert (one["upstream_rows1"] or "").startswith("IndexError: tuple index out of range"), one


def test_upstream_cannot_load_them_from_a_checkpoint_of_another_layout(runs):
    two, _ = runs
    for rank, out in enumerate(two):
        assert out["upstream_ep2"] is None, (rank, out)
        assert "IndexError" in out["upstream_ep2_into_uneven"].get("error", ""), (rank, out)


def test_with_install_chunks_keep_their_prepended_axes_and_every_layout_loads_exactly(runs):
    """Already fixed by ``dtensor.mcore.prepended_axes``, plain ShardedTensors included.

    Fails on the trivial wrong fix of cutting the offsets down to the tensor's own dims
    (2-d chunks, both experts at one offset): the ``.metadata`` must hold these 4-d chunks,
    and every load is compared value by value."""
    two, one = runs
    want = sorted(((0, e, start, 0), (1, 1, stop - start, 4))
                  for e in range(2) for start, stop in ROWS["uneven"][2])
    for rank, out in enumerate(two):
        assert out["fixed_uneven"] is None, (rank, out)
        assert out["chunks"] == want, (rank, out)
        for name in ("fixed_uneven_into_uneven", "fixed_uneven_into_ep2",
                     "fixed_ep2_into_uneven"):
            assert _exact(out[name]), (rank, name, out[name])
    for name in ("fixed_uneven_into_whole", "fixed_uneven_into_rows1"):
        assert _exact(one[name]), (name, one[name])
