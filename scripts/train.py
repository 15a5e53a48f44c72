#!/usr/bin/env python
"""Megatron-style training with the rerun state machine and fault checkpoints.

    torchrun --nproc-per-node 2 scripts/train.py --tensor-model-parallel-size 2 \
        --train-iters 20 --save ckpt --load ckpt --save-interval 2 \
        --ckpt-format torch_dist --ckpt-assume-constant-structure \
        --rerun-mode validate_results --error-injection-rate 8 \
        --error-injection-type persistent_error

Exit codes: 0 done (or --exit-interval), 16 resume from the fault checkpoint to disambiguate,
17 failed result validation, 1 an error (one line per error; --verbose for tracebacks),
2 bad flags. megatron-core's import-time warnings are hidden unless --verbose (or
MEGATRON_CKPT_FIXES_VERBOSE=1), so an error is the last line. See docs/training.md.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Flags are checked before megatron-core is imported: a bad one costs a second, not a
# model build, and every rank exits while rank 0 says why.
from megatron_ckpt_fixes._dev.training.args import parse_args  # noqa: E402
from megatron_ckpt_fixes.core.verbosity import quiet_unless  # noqa: E402

if __name__ == "__main__":
    arguments = parse_args()
    quiet_unless(arguments.verbose)  # before the loop's imports load megatron-core
    from megatron_ckpt_fixes._dev.training.loop import main

    sys.exit(main(arguments))
