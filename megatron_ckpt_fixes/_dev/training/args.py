"""Command-line flags, named as in Megatron-LM so users' launch lines carry over.

Checkpoint flags keep Megatron-LM's names and defaults (``--no-ckpt-fully-parallel-save``:
the fully-parallel save is on unless switched off; ``--async-strategy`` defaults to
``nvrx`` where megatron-core has async strategies). A value no job can run with is refused
here with one line (printed by rank 0 only: every rank parses the same command line).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path

from megatron_ckpt_fixes.core.messages import OneLineParser
from megatron_ckpt_fixes._dev.training import layout


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be zero or positive, got {value}")
    return value


#: ``--dist-ckpt-strictness`` values: megatron-core's ``StrictHandling`` (known here before it
#: is imported) that give back the state dict alone (the ``return_*`` ones add the mismatches).
STRICTNESS = ("assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected",
              "raise_all", "ignore_all")

_positive.__name__ = "positive integer"
_non_negative.__name__ = "non-negative integer"


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="train.py",
                      description="Megatron-style training of a tiny GPTModel on synthetic "
                                  "tokens (torchrun; gloo on CPU, NCCL on GPUs)")
    model = p.add_argument_group("model and data")
    model.add_argument("--num-layers", type=_positive, default=2)
    model.add_argument("--hidden-size", type=_positive, default=32)
    model.add_argument("--num-attention-heads", type=_positive, default=4)
    model.add_argument("--vocab-size", type=_positive, default=128)
    model.add_argument("--seq-length", type=_positive, default=16)
    model.add_argument("--global-batch-size", type=_positive, default=4)
    model.add_argument("--lr", type=float, default=1e-3)
    model.add_argument("--clip-grad", type=float, default=0.0,
                       help="megatron-core's clip_grad_by_total_norm_fp32 asserts CUDA tensors: "
                            "keep 0 on CPU")
    model.add_argument("--seed", type=int, default=1234)
    model.add_argument("--tensor-model-parallel-size", type=_positive, default=1)

    train = p.add_argument_group("training")
    train.add_argument("--train-iters", type=_positive, required=True)
    train.add_argument("--exit-interval", type=_positive, default=None,
                       help="save (if --save) and exit 0 when the iteration is a multiple of it")

    ckpt = p.add_argument_group("checkpointing (Megatron-LM's flags and defaults)")
    ckpt.add_argument("--save", type=Path, default=None)
    ckpt.add_argument("--load", type=Path, default=None)
    ckpt.add_argument("--save-interval", type=_positive, default=None)
    ckpt.add_argument("--ckpt-format", choices=["torch_dist"], default="torch_dist")
    ckpt.add_argument("--ckpt-assume-constant-structure", action="store_true")
    ckpt.add_argument("--no-ckpt-fully-parallel-save", dest="ckpt_fully_parallel_save",
                      action="store_false",
                      help="save without FullyParallelSaveStrategyWrapper (on by default)")
    ckpt.add_argument("--ckpt-fully-parallel-save", dest="ckpt_fully_parallel_save_deprecated",
                      action="store_true", help="deprecated, no effect (as in Megatron-LM)")
    ckpt.add_argument("--ckpt-fully-parallel-load", action="store_true",
                      help="load with FullyParallelLoadStrategyWrapper (needs CUDA collectives)")
    ckpt.add_argument("--async-save", action="store_true")
    ckpt.add_argument("--async-strategy", choices=["nvrx", "mcore"], default=None,
                      help="asynchronous save implementation, where megatron-core has several "
                           "(>= 0.17); default nvrx, as in Megatron-LM")
    ckpt.add_argument("--no-load-optim", action="store_true",
                      help="load model weights only (fresh optimizer state)")
    ckpt.add_argument("--no-load-rng", action="store_true",
                      help="keep this run's seeded RNG streams instead of the checkpoint's")
    ckpt.add_argument("--exit-on-missing-checkpoint", action="store_true",
                      help="a --load without a checkpoint (no "
                           f"{layout.TRACKER_FILENAME}: a mistyped path, say) stops the job "
                           "(exit 2) instead of training from scratch; Megatron-LM's flag, "
                           "which there exits 0")
    ckpt.add_argument("--dist-ckpt-strictness", default="assume_ok_unexpected",
                      choices=STRICTNESS,
                      help="how the load treats keys the model and the checkpoint do not share "
                           "(Megatron-LM's flag; log_all: load what matches, log the rest, "
                           "once on every rank)")
    ckpt.add_argument("--ckpt-verify-checksums", action="store_true",
                      help="before loading, check that the checkpoint holds every key this "
                           "model asks for (shape, chunk, dtype) and a checksum record of this "
                           "save, then every item against the checksums recorded when it was "
                           "saved (megatron_ckpt_fixes' checksums feature); a failure stops the "
                           "job on every rank, naming the key and the cause")

    rerun = p.add_argument_group("rerun state machine")
    rerun.add_argument("--rerun-mode", default="disabled",
                       choices=["disabled", "validate_results", "report_determinism_stats"])
    rerun.add_argument("--error-injection-rate", type=_non_negative, default=0)
    rerun.add_argument("--error-injection-type", default="transient_error",
                       choices=["correct_result", "transient_error", "persistent_error"])
    rerun.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                       action="store_false")
    rerun.add_argument("--check-for-spiky-loss", action="store_true")
    rerun.add_argument("--result-rejected-tracker-filename", default=None)

    own = p.add_argument_group("not Megatron-LM flags")
    own.add_argument("--freeze-embedding-until", type=_non_negative, default=None,
                     metavar="ITERATION",
                     help="the embedding gets no updates up to this iteration and trains after "
                          "it: its Adam state appears mid-run (gradual unfreezing)")
    own.add_argument("--log-file", type=Path, default=None,
                     help="rank 0 appends one JSON line per completed step (loss as float.hex)")
    own.add_argument("--verbose", action="store_true",
                     help="print the traceback of an error, not only its one-line cause, and "
                          "megatron-core's warnings (also MEGATRON_CKPT_FIXES_VERBOSE=1)")
    own.add_argument("--upstream-only", action="store_true", help=argparse.SUPPRESS)
    own.add_argument("--no-install", action="store_true",
                     help="never call megatron_ckpt_fixes.install(): the fixes come from "
                          "`megatron-ckpt-fixes run` or MEGATRON_CKPT_FIXES (zero-code "
                          "activation), as for an unchanged Megatron-LM script")
    return p


def layout_problem(args: argparse.Namespace, world_size: int) -> str | None:
    """Why the parallel layout cannot be built on ``world_size`` ranks, or None."""
    tp = args.tensor_model_parallel_size
    if world_size % tp:
        return f"--tensor-model-parallel-size {tp} does not divide the world size {world_size}"
    if args.num_attention_heads % tp:
        return (f"--num-attention-heads {args.num_attention_heads} is not divisible by "
                f"--tensor-model-parallel-size {tp}")
    dp = world_size // tp
    if args.global_batch_size % dp:
        return (f"--global-batch-size {args.global_batch_size} is not divisible by the "
                f"data-parallel size {dp} (world size {world_size} / TP {tp})")
    return None


def missing_checkpoint(load: Path) -> str:
    """The error of ``--exit-on-missing-checkpoint`` when ``load`` has no checkpoint."""
    return (f"{layout.no_checkpoint(load)} and --exit-on-missing-checkpoint is set: check the "
            "path, or drop the flag to start from scratch")


def load_problem(load: Path | None, required: bool = False) -> str | None:
    """Why ``--load`` cannot be what the user meant, or None: it takes the save directory
    (the one ``--save`` wrote, holding the tracker), not one checkpoint inside it. Megatron-LM
    starts from scratch there (no tracker); a user who named the checkpoint wanted it.
    ``required`` (``--exit-on-missing-checkpoint``): a directory without a tracker is one too,
    found here, before megatron-core is imported and the model built."""
    if load is None:
        return "--exit-on-missing-checkpoint needs --load" if required else None
    if load.is_dir() and ((load / ".metadata").exists() or load.name.startswith("iter_")):
        return (f"--load {load} is one checkpoint; --load takes the save directory that holds "
                f"it: --load {load.parent} resumes from the iteration its "
                f"{layout.TRACKER_FILENAME} names")
    if required and not layout.tracker_path(load).is_file():
        return missing_checkpoint(load)
    return None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and check the flags against the launcher's ``WORLD_SIZE``; a problem exits 2
    with one line, before megatron-core is imported."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.async_save and args.save is None:
        parser.error("--async-save needs --save")
    problem = load_problem(args.load, args.exit_on_missing_checkpoint)
    if problem:
        parser.error(problem)
    problem = layout_problem(args, int(os.environ.get("WORLD_SIZE", "1")))
    if problem:
        parser.error(problem)
    return args
