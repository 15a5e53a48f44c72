"""Will this checkpoint load into this model? Answered on every rank before any tensor data.

The case of issue 31: a checkpoint that lacks one parameter's optimizer state (the unfrozen
embedding's Adam moments, lost by a save; ``verify`` calls it OK, it has nothing to compare
with). Upstream's load fails with ``KeyError ... not in state dict`` (in DCP's
``CheckpointException``) after it has read the common state; under
``--ckpt-verify-checksums`` the trainer has by then read and hashed every byte. The
pre-flight fails first, on every rank, naming the key, reading metadata only: no data file is
opened (a pre-flight that tries the load, or runs the byte check, fails that).

Twins in one run of 2 ranks: the key missing on rank 1's template only (every rank must
refuse: a check of rank 0's template alone passes it); a lossy dtype on rank 1 only (the
load's own class); a checkpoint without a record, refused as ``--ckpt-verify-checksums``
refuses it and passed when the record is not required; a checkpoint of what the template
asks, which passes and then loads exactly.
"""

from __future__ import annotations

import builtins
import contextlib
import io
import os
import re
import shutil
import tempfile
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from megatron_ckpt_fixes._dev.testing import run_ranks

pytestmark = pytest.mark.varies_with("megatron-core", "torch")

MISSING = "optimizer.exp_avg.embedding.weight"


def _values(name: str, rank: int) -> torch.Tensor:
    return torch.arange(6.0).reshape(2, 3) * (rank + 1) + len(name) / 7


def _template(rank: int, ws: int, emb_state: bool = True, dtype=torch.float32,
              zeros: bool = True) -> dict:
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    names = ["model.w", "model.embedding.weight", "optimizer.exp_avg.w"]
    if emb_state:
        names.append(MISSING)
    sd: dict = {name: ShardedTensor.from_rank_offsets(
        name, (torch.zeros(2, 3) if zeros else _values(name, rank)).to(dtype), (0, rank, ws))
        for name in names}
    sd["rng"] = ShardedObject("rng", {"rank": rank}, (ws,), (rank,))
    return sd


@contextlib.contextmanager
def _opened() -> Iterator[list[str]]:
    """The files opened meanwhile (builtins.open: torch.load; io.open: pathlib, torch DCP)."""
    seen: list[str] = []
    originals = builtins.open, io.open

    def recording(file, *args, **kwargs):
        seen.append(os.fspath(file) if not isinstance(file, int) else f"fd {file}")
        return originals[0](file, *args, **kwargs)

    builtins.open = io.open = recording
    try:
        yield seen
    finally:
        builtins.open, io.open = originals


def _outcome(fn) -> tuple[list[str], str] | None:
    try:
        fn()
        return None
    except BaseException as exc:  # noqa: BLE001 - CheckpointException is a BaseException
        return [c.__name__ for c in type(exc).__mro__], str(exc)


def _worker(rank: int, ws: int) -> dict:
    import megatron_ckpt_fixes
    from megatron.core import dist_checkpointing as dc

    from megatron_ckpt_fixes.fixes.checksums import SIDECAR
    from megatron_ckpt_fixes.tools.preflight import check_loadable

    root = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(root, src=0)
    full, lacking, norecord = (f"{root[0]}/{n}" for n in ("full", "lacking", "norecord"))
    if rank == 0:
        for path in (full, lacking):
            os.makedirs(path)
    dist.barrier()
    megatron_ckpt_fixes.install()
    dc.save(_template(rank, ws, zeros=False), full)
    dc.save(_template(rank, ws, emb_state=False, zeros=False), lacking)
    if rank == 0:  # the same save without its record: saved without the checksums feature
        shutil.copytree(full, norecord, ignore=shutil.ignore_patterns(SIDECAR))
    dist.barrier()
    out: dict = {}

    megatron_ckpt_fixes.uninstall()
    megatron_ckpt_fixes.install(["compat.cpu"])
    with _opened() as seen:
        out["upstream"] = _outcome(lambda: dc.load(_template(rank, ws), lacking))
    out["upstream_opened"] = seen
    dist.barrier()

    megatron_ckpt_fixes.uninstall()
    megatron_ckpt_fixes.install()
    with _opened() as seen:
        out["fixed"] = _outcome(lambda: check_loadable(_template(rank, ws), lacking))
        out["passed"] = str(check_loadable(_template(rank, ws), full, checksums_required=True))
    out["preflight_opened"] = seen
    out["one_rank"] = _outcome(lambda: check_loadable(_template(rank, ws, rank == 1), lacking))
    out["lossy_one_rank"] = _outcome(lambda: check_loadable(
        _template(rank, ws, dtype=torch.bfloat16 if rank == 1 else torch.float32), full))
    out["no_record_required"] = _outcome(
        lambda: check_loadable(_template(rank, ws), norecord, checksums_required=True))
    out["no_record"] = str(check_loadable(_template(rank, ws), norecord))
    loaded = dc.load(_template(rank, ws), full)
    out["max_delta"] = max((loaded[name] - _values(name, rank)).abs().max().item()
                           for name in loaded if name != "rng")
    out["rng"] = loaded["rng"]
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return [r.value for r in run_ranks(_worker, 2, timeout_s=180, collective_timeout_s=30)]


def _data_files(paths: list[str]) -> list[str]:
    return [p for p in paths if p.endswith(".distcp")]


def test_upstream_fails_late_with_a_key_error(ranks):
    for out in ranks:
        names, text = out["upstream"]
        assert "CheckpointException" in names and "KeyError" in text and MISSING in text, text
    # it read the common state first: megatron-core 0.16 its common.pt, 0.19 on its item in a
    # data file (__0_0.distcp)
    for out in ranks:
        assert any(p.endswith(("common.pt", ".distcp")) for p in out["upstream_opened"]), \
            out["upstream_opened"]


def test_the_preflight_names_the_key_on_every_rank_first(ranks):
    errors = [out["fixed"] for out in ranks]
    assert errors[0] == errors[1], errors
    names, text = errors[0]
    # the class the load raises for it: DCP's CheckpointException (and the package's root)
    assert names[0] == "CheckpointLoadError" and "CheckpointException" in names
    assert "MegatronCkptFixesError" in names, names
    for r in (0, 1):
        assert (f"rank {r}: pre-flight: '{MISSING}': not in the checkpoint (it was saved "
                "without this key)") in text, text
    assert len(text.splitlines()) == 3, text  # the summary and one line per rank


def test_the_preflight_reads_no_tensor_data(ranks):
    for out in ranks:
        opened = out["preflight_opened"]
        assert not _data_files(opened), opened
        assert any(p.endswith(".metadata") for p in opened), opened


def test_a_key_only_rank_1_asks_for_stops_every_rank(ranks):
    errors = [out["one_rank"] for out in ranks]
    assert errors[0] == errors[1], errors
    text = errors[0][1]
    assert f"rank 1: pre-flight: '{MISSING}'" in text and "rank 0:" not in text, text


def test_a_lossy_dtype_on_one_rank_is_the_loads_own_refusal(ranks):
    errors = [out["lossy_one_rank"] for out in ranks]
    assert errors[0] == errors[1], errors
    names, text = errors[0]
    assert "CheckpointingException" in names and "CheckpointException" not in names, names
    assert "rank 1: pre-flight: LossyCastError: 'model.w' saved as torch.float32, the " \
           "template is torch.bfloat16" in text and "rank 0:" not in text, text


def test_a_checkpoint_without_record_is_refused_when_checksums_are_required(ranks):
    errors = [out["no_record_required"] for out in ranks]
    assert errors[0] == errors[1], errors
    names, text = errors[0]
    assert names[0] == "ChecksumError" and "CheckpointingException" in names, names
    assert ("rank 0: checksum record: absent (.checksums.json missing: saved without the "
            "checksums feature); the check was asked for") in text, text
    assert all(out["no_record"].endswith("checksum record: absent (not required)")
               for out in ranks)


def test_a_checkpoint_of_what_is_asked_passes_and_loads_exactly(ranks):
    for rank, out in enumerate(ranks):
        # 3 whole files with megatron-core 0.16's common.pt, 2 from 0.19 on
        assert re.fullmatch(r"will load: 10 requested entries on 2 rank\(s\) are in the "
                            r"checkpoint with their shapes, chunks and dtypes; the checksum "
                            r"record is this save's \([23] whole file\(s\) match it\)",
                            out["passed"]), out["passed"]
        assert out["max_delta"] == 0.0 and out["rng"] == {"rank": rank}
