"""No silent lossy cast at load: fp32 saved, a bf16 template refused on every rank.

Upstream (megatron-core, torch DCP under it) copies the saved fp32 values into the bf16
template and returns rounded values without a word. With install() the load fails on every
rank before any tensor data is read, naming the key, both dtypes and the switch that allows
an intended cast; a lossless widening (bf16 saved, fp32 template) loads exactly. The twin
cases: the lossy template on one rank only (every rank must still refuse: a check of rank 0
alone passes it), a widening (a check that refuses every cast fails it), and the switch.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from megatron_ckpt_fixes._dev.testing import run_ranks

pytestmark = pytest.mark.varies_with("megatron-core", "torch")

#: Values fp32 holds and bf16 does not (each rounds).
SAVED = torch.tensor([1.0 + 2 ** -10, 3.14159, -2.71828, 1e-3 + 1e-7], dtype=torch.float32)


def _outcome(fn) -> tuple[str, str] | None:
    try:
        fn()
        return None
    except BaseException as exc:  # noqa: BLE001 - CheckpointException is a BaseException
        return type(exc).__name__, str(exc)


def _worker(rank: int, ws: int) -> dict:
    import megatron_ckpt_fixes
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.core import CheckpointingException

    root = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(root, src=0)
    fp32, bf16 = f"{root[0]}/fp32", f"{root[0]}/bf16"
    if rank == 0:
        os.makedirs(fp32)
        os.makedirs(bf16)
    dist.barrier()

    def sharded(values: torch.Tensor) -> dict:
        return {"w": ShardedTensor.from_rank_offsets("w", values, (0, rank, ws))}

    megatron_ckpt_fixes.install(["compat.cpu"])
    dc.save(sharded(SAVED * (rank + 1)), fp32)
    dc.save(sharded((SAVED * (rank + 1)).to(torch.bfloat16)), bf16)
    out: dict = {}

    def load(ckpt: str, dtype: torch.dtype, key: str) -> None:
        loaded = dc.load(sharded(torch.zeros(len(SAVED), dtype=dtype)), ckpt)["w"]
        out[key] = loaded.float()

    megatron_ckpt_fixes.uninstall()
    megatron_ckpt_fixes.install(["compat.cpu"])
    out["upstream"] = _outcome(lambda: load(fp32, torch.bfloat16, "upstream_values"))
    dist.barrier()
    megatron_ckpt_fixes.uninstall()
    megatron_ckpt_fixes.install()
    out["fixed"] = _outcome(lambda: load(fp32, torch.bfloat16, "fixed_values"))
    out["fixed_is_checkpointing_exception"] = isinstance(
        _raised(lambda: load(fp32, torch.bfloat16, "_")), CheckpointingException)
    one_rank = torch.bfloat16 if rank == 1 else torch.float32
    out["one_rank"] = _outcome(lambda: load(fp32, one_rank, "one_rank_values"))
    out["widening"] = _outcome(lambda: load(bf16, torch.float32, "widening_values"))
    os.environ["MEGATRON_CKPT_FIXES_ALLOW_LOSSY_CAST"] = "1"
    try:
        out["allowed"] = _outcome(lambda: load(fp32, torch.bfloat16, "allowed_values"))
    finally:
        del os.environ["MEGATRON_CKPT_FIXES_ALLOW_LOSSY_CAST"]
    out["expected"] = SAVED * (rank + 1)
    dist.barrier()
    return out


def _raised(fn) -> BaseException | None:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001
        return exc
    return None


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return [r.value for r in run_ranks(_worker, 2, timeout_s=180, collective_timeout_s=30)]


def test_upstream_still_rounds_silently(ranks):
    for out in ranks:
        assert out["upstream"] is None
        delta = (out["upstream_values"] - out["expected"]).abs().max().item()
        assert delta > 0, "upstream no longer casts silently: the twin is out of date"


def test_a_lossy_template_fails_on_every_rank_naming_key_and_dtypes(ranks):
    errors = [out["fixed"] for out in ranks]
    assert all(errors) and errors[0] == errors[1], errors
    text = errors[0][1]
    for part in ("rank 0: LossyCastError: 'w' saved as torch.float32, the template is "
                 "torch.bfloat16", "rank 1: LossyCastError",
                 "MEGATRON_CKPT_FIXES_ALLOW_LOSSY_CAST=1"):
        assert part in text, text
    assert all(out["fixed_is_checkpointing_exception"] for out in ranks)
    assert all("fixed_values" not in out for out in ranks)


def test_one_lossy_rank_stops_every_rank(ranks):
    errors = [out["one_rank"] for out in ranks]
    assert all(errors) and errors[0] == errors[1], errors
    assert "rank 1: LossyCastError" in errors[0][1] and "rank 0:" not in errors[0][1]


def test_a_widening_loads_exactly(ranks):
    for out in ranks:
        assert out["widening"] is None, out["widening"]
        exact = out["expected"].to(torch.bfloat16).float()
        assert (out["widening_values"] - exact).abs().max().item() == 0.0


def test_the_switch_allows_an_intended_cast(ranks):
    for out in ranks:
        assert out["allowed"] is None, out["allowed"]
        rounded = out["expected"].to(torch.bfloat16).float()
        assert (out["allowed_values"] - rounded).abs().max().item() == 0.0
