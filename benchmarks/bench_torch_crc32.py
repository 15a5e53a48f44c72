"""What keeping torch's zip CRC-32 in the data files costs (``MEGATRON_CKPT_FIXES_KEEP_CRC32``).

With the checksums feature, the records megatron-core's writer checksums are written without
torch's CRC-32 (torch's own ``set_crc32_options(False)`` format: zip tools report bad CRCs,
torch and megatron-core load them). ``MEGATRON_CKPT_FIXES_KEEP_CRC32=1`` at ``install()``
keeps the CRC-32 for tooling that checks it. One gloo rank saves the GPT-like sharded state
dict of ``bench_realistic_save.py`` (``--layers`` 2, ``--hidden`` 1024: 0.28 GiB) with
``dist_checkpointing.save`` and every fix, once per setup per round, in an order that
alternates from round to round, to ``--dir``; each save after a ``gc.collect()``:

- CRC-32 off (default):  ``install()``;
- CRC-32 kept:           ``install()`` with ``MEGATRON_CKPT_FIXES_KEEP_CRC32=1``.

A save's CPU time is the rank's own plus its writer processes' (``getrusage``: megatron-core
0.16 writes in forked processes, later releases in threads); CPU time, unlike wall time, is
not inflated by other processes waiting for the same cores or disk. Each setup's first save
is checked: one of its data-file records passes ``zipfile``'s CRC test exactly when the
CRC-32 is kept.

Printed: per setup the median CPU seconds and wall seconds of a save; the paired per-round
differences and ratios, kept / off (median, min-max).

    python benchmarks/bench_torch_crc32.py [--layers 2] [--hidden 1024] [--rounds 5] [--dir DIR]
"""

from __future__ import annotations

import argparse
import gc
import io
import os
import resource
import shutil
import statistics
import tempfile
import time
import zipfile

from bench_cached_save import Spread
from bench_realistic_save import GIB, state_dict

from megatron_ckpt_fixes.fixes.checksums.writer import KEEP_CRC32_ENV
from megatron_ckpt_fixes._dev.testing import run_ranks

SETUPS = {"CRC-32 off (default)": None, "CRC-32 kept": "1"}  # name: KEEP_CRC32_ENV's value


def _cpu_seconds() -> float:
    """User and system CPU of this process and of its children that have been waited for."""
    own, children = (resource.getrusage(who) for who in (resource.RUSAGE_SELF,
                                                          resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _crc_ok(path: str) -> bool:
    """Whether the first tensor record of the checkpoint's first data file has valid zip CRCs
    (objects, such as 0.19's common state, are serialized before the writer: they keep it)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from megatron_ckpt_fixes.tools.cli.checks import read_metadata

    metadata = read_metadata(path)
    info = min((info for index, info in metadata.storage_data.items()
                if isinstance(metadata.state_dict_metadata[index.fqn], TensorStorageMetadata)),
               key=lambda i: (i.relative_path, i.offset))
    with open(os.path.join(path, info.relative_path), "rb") as f:
        f.seek(info.offset)
        record = f.read(info.length)
    return zipfile.ZipFile(io.BytesIO(record)).testzip() is None


def _bench(rank: int, ws: int, layers: int, hidden: int, rounds: int, root: str) -> dict:
    import megatron_ckpt_fixes
    from megatron.core import dist_checkpointing as dc
    from tqdm import tqdm

    sd = state_dict(rank, ws, layers, hidden)
    counter = iter(range(10**9))

    def save(name: str) -> tuple[float, float, bool | None]:
        value = SETUPS[name]
        if value is None:
            os.environ.pop(KEEP_CRC32_ENV, None)
        else:
            os.environ[KEEP_CRC32_ENV] = value
        megatron_ckpt_fixes.uninstall()
        megatron_ckpt_fixes.install()  # reads the switch
        path = os.path.join(root, f"c{next(counter)}")
        os.makedirs(path)
        gc.collect()
        cpu, wall = _cpu_seconds(), time.perf_counter()
        dc.save(sd, path, validate_access_integrity=False)
        cpu, wall = _cpu_seconds() - cpu, time.perf_counter() - wall
        crc_ok = _crc_ok(path)
        shutil.rmtree(path)
        return cpu, wall, crc_ok

    cpu: dict[str, list[float]] = {name: [] for name in SETUPS}
    wall: dict[str, list[float]] = {name: [] for name in SETUPS}
    crc: dict[str, set[bool]] = {name: set() for name in SETUPS}
    order = list(SETUPS)
    save(order[0])  # warm-up: imports, the writer's first fork
    for _ in tqdm(range(rounds), desc="rounds"):
        for name in order:
            c, w, ok = save(name)
            cpu[name].append(c)
            wall[name].append(w)
            crc[name].add(ok)
        order.reverse()
    megatron_ckpt_fixes.uninstall()
    os.environ.pop(KEEP_CRC32_ENV, None)
    off, kept = SETUPS
    assert crc == {off: {False}, kept: {True}}, f"zip CRC test per setup: {crc}"
    return {"bytes": sum(sh.data.numel() * sh.data.element_size() for sh in sd.values()),
            "tensors": len(sd), "rounds": rounds,
            "cpu": {n: statistics.median(v) for n, v in cpu.items()},
            "wall": {n: statistics.median(v) for n, v in wall.items()},
            "cpu extra": Spread.of([k - o for k, o in zip(cpu[kept], cpu[off])]),
            "cpu ratio": Spread.of([k / o for k, o in zip(cpu[kept], cpu[off])]),
            "wall ratio": Spread.of([k / o for k, o in zip(wall[kept], wall[off])])}


def _print(r: dict, args: argparse.Namespace) -> None:
    from importlib.metadata import version

    import torch

    print(f"\n1 gloo rank, {args.layers} layers, hidden {args.hidden}: {r['tensors']} tensors, "
          f"{r['bytes'] / GIB:.3f} GiB per save, {r['rounds']} rounds, megatron-core "
          f"{version('megatron-core')}, torch {torch.__version__}, in {args.dir}")
    print("  save with every fix: CPU seconds (rank + writer processes), median; wall seconds")
    for name in SETUPS:
        print(f"    {name:22s} {r['cpu'][name]:.3f} s CPU;  {r['wall'][name]:.3f} s wall")
    print(f"  CRC-32 kept - off, CPU seconds per save, paired per round: {r['cpu extra']}")
    print(f"  CRC-32 kept / off, paired per round: CPU {r['cpu ratio']}; wall "
          f"{r['wall ratio']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=os.environ.get("MCF_BENCH_DIR", "/var/tmp"),
                        help="a directory on the disk to measure (not a tmpfs)")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="mcf-bench-", dir=args.dir)
    try:
        result = run_ranks(_bench, 1, args.layers, args.hidden, args.rounds, root,
                           timeout_s=3600, collective_timeout_s=600)[0].value
    finally:
        shutil.rmtree(root, ignore_errors=True)
    _print(result, args)


if __name__ == "__main__":
    main()
