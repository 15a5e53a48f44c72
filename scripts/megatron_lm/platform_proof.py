#!/usr/bin/env python
"""The CPU platform's proof: Megatron-LM's unchanged ``pretrain_gpt.py`` on 8 gloo ranks,
tensor-parallel 2 x pipeline-parallel 2 x data-parallel 2, with the fixes switched on by the
environment (``MEGATRON_CKPT_FIXES=1``).

    python scripts/megatron_lm/platform_proof.py [--out DIR] [--nproc 8]

Two runs of ``gpt3_mcore_te_tp2_pp2_resume_torch_dist`` (CI's ``ckpt-resume`` flow, 20
iterations, a save every 10):

1. as the case is adapted for CPU (non-distributed optimizer): the resume from iteration 10
   equals the uninterrupted run bitwise;
2. with ``--use-distributed-optimizer``: it trains and saves (the 1F1B pipeline schedule,
   DP all-reduce / reduce-scatter, its parameter all-gather, all on gloo); its resume stops
   where megatron-core needs Transformer Engine's or Apex's Adam (the error is printed).

Prints every CUDA call site the platform mapped (by count, summed over all processes of
both runs), and fails if one of them is in ``megatron_ckpt_fixes``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import upstream_snapshots  # noqa: E402
from run_case import Mode, run_case  # noqa: E402

CASE = "gpt3_mcore_te_tp2_pp2_resume_torch_dist"
FLAGS = (("--train-iters", 20), ("--save-interval", 10))
#: What megatron-core raises when the distributed optimizer's checkpoint is loaded with
#: torch's Adam (DistributedOptimizer.state_dict on a fresh, empty optimizer state).
DISTRIBUTED_OPTIMIZER_LOAD_ERROR = "AssertionError"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path,
                        default=Path(tempfile.gettempdir()) / "megatron_lm_platform_proof")
    parser.add_argument("--nproc", type=int, default=8)
    args = parser.parse_args(argv)
    ref = upstream_snapshots.ref_for_installed()
    tree = upstream_snapshots.training_tree(ref)
    out = args.out.resolve()
    plain = run_case(tree, ref, CASE, Mode(True, False, FLAGS), out, args.nproc)
    distributed = run_case(tree, ref, CASE, Mode(True, False, (
        *FLAGS, ("--use-distributed-optimizer", True))), out / "distributed-optimizer",
        args.nproc)
    sites: Counter[str] = Counter()
    for result in (plain, distributed):
        sites.update(result.cuda_sites)
    print(f"\nCUDA call sites mapped to the CPU ({sum(sites.values())} calls, "
          f"{len(sites)} sites):")
    for site, count in sites.most_common():
        print(f"  {count:6d}  {site.split('-training/')[-1]}")
    ours = [site for site in sites if "megatron_ckpt_fixes" in site]
    trained = distributed.exit_codes.get("run1") == [0]
    load_error = distributed.errors.get("run2", "")
    print(f"\nresume bitwise (non-distributed optimizer): {plain.passed}; distributed "
          f"optimizer trains and saves: {trained}; its resume: {load_error or 'loaded'}; "
          f"CUDA requests from megatron_ckpt_fixes: {len(ours)}")
    ok = plain.passed and trained and load_error.startswith(DISTRIBUTED_OPTIMIZER_LOAD_ERROR) \
        and not ours
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
