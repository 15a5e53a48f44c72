"""What the case runner adds to every interpreter of a Megatron-LM job (via ``sitecustomize``).

- The CPU platform (:mod:`training_platform`), opened at start-up in every process of the
  job: the ranks and megatron-core's spawned workers alike, whatever ``MEGATRON_CKPT_FIXES``
  says, so that a difference between a run with and without the fixes comes from the fixes.
  The fixes' own activation (the package's ``.pth`` file) runs before this, and installs
  them when megatron-core is first imported: before the CUDA mappings, so they detect the
  real process (no CUDA) as on any gloo job.
- In the ranks, a record of every iteration's losses at full precision: Megatron-LM prints
  ``lm loss: 1.234567E+00`` (7 significant digits), too few to tell two runs apart bitwise.
  ``megatron.training.training.training_log`` (called once per iteration with that
  iteration's reduced losses) is wrapped to append ``{"iteration", "skipped", "lm loss",
  ...}`` with each loss as ``float.hex`` to ``MCF_MLM_LOSS_LOG`` (one JSON line per
  iteration, written by the ranks that hold the losses: the last pipeline stage;
  ``skipped``: the step did not change the parameters, an fp16 overflow).
- At exit, each process writes the CUDA call sites it mapped to
  ``MCF_MLM_SITES_DIR/cuda_sites-<role>-<pid>.json``.
- In the ranks, the interpreters multiprocessing spawns (megatron-core's write-results
  Manager, its persistent checkpoint worker) start without running the rank's script as
  ``__mp_main__`` (:func:`_spawns_without_main`).
- With ``MCF_MLM_CKPT_HELD_SAVE=N``, megatron-core's checkpoint workers hold every write
  into the checkpoint of iteration ``N`` (torch's ``_write_item`` as ``filesystem_async``
  calls it) until an optimizer step after the save has changed the parameters on every
  rank (:func:`_step_landed`). On a tiny CPU model the writer would otherwise finish before
  the next step; on a large model it is still writing. An order of events, not a pause: a
  loaded machine cannot outrun it.

Environment: ``MCF_MLM_TREE`` (the Megatron-LM training tree; its presence switches all of
this on), ``MCF_MLM_LOSS_LOG``, ``MCF_MLM_SITES_DIR``, ``MCF_MLM_CKPT_HELD_SAVE``.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import json
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

TREE_ENV = "MCF_MLM_TREE"
LOSS_LOG_ENV = "MCF_MLM_LOSS_LOG"
SITES_DIR_ENV = "MCF_MLM_SITES_DIR"
HELD_SAVE_ENV = "MCF_MLM_CKPT_HELD_SAVE"
#: A bound on holding a write (a run that stops logging becomes a failed save, not a hang).
HOLD_TIMEOUT_S = 300.0
#: The module whose ``_write_item`` is held (in the checkpoint workers).
WRITER_MODULE = "megatron.core.dist_checkpointing.strategies.filesystem_async"
#: The module whose ``training_log`` is wrapped.
TRAINING_MODULE = "megatron.training.training"

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from after_import import after_import  # noqa: E402


#: How multiprocessing starts the interpreters a rank spawns (``sys.orig_argv``'s ``-c``
#: code): megatron-core's checkpoint workers use spawn (0.16) or a forkserver (Megatron-LM
#: 0.19 asks for one), and their processes must get the platform too.
WORKER_STARTS = ("from multiprocessing.spawn import", "from multiprocessing.forkserver import")


def _role() -> str | None:
    """``rank<N>`` for a rank (an interpreter running a script of the tree),
    ``worker-of-rank<N>`` for an interpreter a rank started with multiprocessing's spawn or
    forkserver (megatron-core's checkpoint workers; a forkserver's children are forks of
    it), None for anything else: the launcher, and helpers such as multiprocessing's
    resource tracker, which must stay plain (a tracker that imported megatron-core here
    would start another tracker, and so on)."""
    rank = os.environ.get("RANK")
    if rank is None:
        return None
    code = sys.orig_argv[sys.orig_argv.index("-c") + 1] if "-c" in sys.orig_argv[:-1] else ""
    if code.startswith(WORKER_STARTS):
        return f"worker-of-rank{rank}"
    script = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    tree = os.path.abspath(os.environ[TREE_ENV]) + os.sep
    return f"rank{rank}" if script.startswith(tree) else None


def _float_hex(value: Any) -> str:
    if hasattr(value, "item"):
        value = value.item()
    return float(value).hex()


def _recording(training_log: Callable[..., Any], path: Path) -> Callable[..., Any]:
    signature = inspect.signature(training_log)

    @functools.wraps(training_log)
    def call(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs).arguments
        if bound["loss_dict"]:
            record = {"iteration": bound["iteration"],
                      "rank": int(os.environ.get("RANK", "0")),
                      "skipped": bool(bound["skipped_iter"]),
                      **{key: _float_hex(value) for key, value in bound["loss_dict"].items()}}
            with open(path, "a") as f:
                f.write(json.dumps(record) + "\n")
        return training_log(*args, **kwargs)

    return call


def _record_losses(module: ModuleType) -> None:
    module.training_log = _recording(module.training_log, Path(os.environ[LOSS_LOG_ENV]))


def _step_landed(records: list[dict], saved: int) -> bool:
    """Whether the loss record shows an optimizer step after iteration ``saved`` that changed
    the parameters everywhere: the first iteration ``k > saved`` not skipped (the skip is
    agreed by every rank), and then iteration ``k + 1`` logged, which the last stage logs
    only after the first stages, their step ``k`` done, fed it."""
    stepped = [r["iteration"] for r in records if r["iteration"] > saved and not r["skipped"]]
    return bool(stepped) and any(r["iteration"] > min(stepped) for r in records)


def _records(path: Path) -> list[dict]:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines if line.endswith("}")]


def _hold_until_a_step_landed(saved: int, path: Path) -> None:
    import time

    deadline = time.monotonic() + HOLD_TIMEOUT_S
    while not _step_landed(_records(path), saved):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{HELD_SAVE_ENV}: no optimizer step after iteration {saved} "
                               f"was logged to {path} within {HOLD_TIMEOUT_S:.0f} s")
        time.sleep(0.05)


def _held_writes(module: ModuleType) -> None:
    held = int(os.environ[HELD_SAVE_ENV])
    directory, log = f"iter_{held:07d}", Path(os.environ[LOSS_LOG_ENV])
    write_item = module._write_item
    signature = inspect.signature(write_item)

    @functools.wraps(write_item)  # the writer reads its signature
    def held_write_item(*args: Any, **kwargs: Any) -> Any:
        stream = signature.bind(*args, **kwargs).arguments["stream"]
        if directory in Path(getattr(stream, "name", "")).parts:
            _hold_until_a_step_landed(held, log)
        return write_item(*args, **kwargs)

    module._write_item = held_write_item


def _plain(get_preparation_data: Callable[..., dict]) -> Callable[..., dict]:
    @functools.wraps(get_preparation_data)
    def call(name: str) -> dict:
        data = get_preparation_data(name)
        data.pop("init_main_from_path", None)
        data.pop("init_main_from_name", None)
        return data

    return call


def _spawns_without_main() -> None:
    """The interpreters a rank spawns do not run the rank's main script.

    A spawned child first runs its parent's ``__main__`` as ``__mp_main__``, so that the
    functions it is sent can be found: for ``pretrain_gpt.py`` that is every import of the
    training package, 8-10 s of CPU. What a rank spawns (megatron-core's write-results
    Manager, a Manager per save process, and its persistent checkpoint worker) runs and
    receives megatron-core's and torch's functions only, never one of ``__main__``: a
    function that did live there would fail to unpickle, loudly."""
    import multiprocessing.spawn as spawn

    spawn.get_preparation_data = _plain(spawn.get_preparation_data)


def start() -> None:
    """Open the platform (ranks and their workers), arm the loss record (ranks), dump the
    CUDA call sites at exit."""
    role = _role()
    if role is None:
        return
    import training_platform

    spawned = role.startswith("worker")
    training_platform.TrainingCpuPlatform(os.environ[TREE_ENV]).open(spawned=spawned)
    if os.environ.get(SITES_DIR_ENV):
        out = Path(os.environ[SITES_DIR_ENV]) / f"cuda_sites-{role}-{os.getpid()}.json"
        atexit.register(training_platform.write_sites, out)
    if not spawned and os.environ.get(LOSS_LOG_ENV):
        after_import(TRAINING_MODULE, _record_losses)
    if not spawned:
        _spawns_without_main()
    if spawned and os.environ.get(HELD_SAVE_ENV):
        after_import(WRITER_MODULE, _held_writes)
