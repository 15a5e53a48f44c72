"""Command-line flags, named as in Megatron-LM so users' launch lines carry over."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Megatron-style training of a tiny GPTModel on "
                                            "synthetic tokens (torchrun; gloo on CPU, NCCL on GPUs)")
    model = p.add_argument_group("model and data")
    model.add_argument("--num-layers", type=int, default=2)
    model.add_argument("--hidden-size", type=int, default=32)
    model.add_argument("--num-attention-heads", type=int, default=4)
    model.add_argument("--vocab-size", type=int, default=128)
    model.add_argument("--seq-length", type=int, default=16)
    model.add_argument("--global-batch-size", type=int, default=4)
    model.add_argument("--lr", type=float, default=1e-3)
    model.add_argument("--clip-grad", type=float, default=0.0,
                       help="megatron-core's clip_grad_by_total_norm_fp32 asserts CUDA tensors: "
                            "keep 0 on CPU")
    model.add_argument("--seed", type=int, default=1234)
    model.add_argument("--tensor-model-parallel-size", type=int, default=1)

    train = p.add_argument_group("training")
    train.add_argument("--train-iters", type=int, required=True)
    train.add_argument("--exit-interval", type=int, default=None,
                       help="save (if --save) and exit 0 when the iteration is a multiple of it")

    ckpt = p.add_argument_group("checkpointing")
    ckpt.add_argument("--save", type=Path, default=None)
    ckpt.add_argument("--load", type=Path, default=None)
    ckpt.add_argument("--save-interval", type=int, default=None)
    ckpt.add_argument("--ckpt-format", choices=["torch_dist"], default="torch_dist")
    ckpt.add_argument("--ckpt-assume-constant-structure", action="store_true")
    ckpt.add_argument("--async-save", action="store_true")
    ckpt.add_argument("--no-load-optim", action="store_true",
                      help="load model weights only (fresh optimizer state)")
    ckpt.add_argument("--no-load-rng", action="store_true",
                      help="keep this run's seeded RNG streams instead of the checkpoint's")
    ckpt.add_argument("--ckpt-verify-checksums", action="store_true",
                      help="before loading, check every item against the checksums recorded "
                           "when it was saved (megatron_ckpt_fixes' checksums feature); a "
                           "mismatch stops the job on every rank, naming the key and the file")

    rerun = p.add_argument_group("rerun state machine")
    rerun.add_argument("--rerun-mode", default="disabled",
                       choices=["disabled", "validate_results", "report_determinism_stats"])
    rerun.add_argument("--error-injection-rate", type=int, default=0)
    rerun.add_argument("--error-injection-type", default="transient_error",
                       choices=["correct_result", "transient_error", "persistent_error"])
    rerun.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                       action="store_false")
    rerun.add_argument("--check-for-spiky-loss", action="store_true")
    rerun.add_argument("--result-rejected-tracker-filename", default=None)

    dev = p.add_argument_group("testing (not Megatron-LM flags)")
    dev.add_argument("--log-file", type=Path, default=None,
                     help="rank 0 appends one JSON line per completed step (loss as float.hex)")
    dev.add_argument("--dump-state", type=Path, default=None,
                     help="rank 0 writes the full (TP-gathered) weights and optimizer state "
                          "when the run ends normally")
    dev.add_argument("--upstream-only", action="store_true", help=argparse.SUPPRESS)
    dev.add_argument("--no-install", action="store_true",
                     help="never call megatron_ckpt_fixes.install(): the fixes come from "
                          "`megatron-ckpt-fixes run` or MEGATRON_CKPT_FIXES (zero-code "
                          "activation), as for an unchanged Megatron-LM script")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.async_save and args.save is None:
        raise SystemExit("--async-save needs --save")
    return args
