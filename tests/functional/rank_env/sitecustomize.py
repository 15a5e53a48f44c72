"""Put on the ranks' PYTHONPATH by the functional tests: installs test-only hooks into the
training script's ranks (:mod:`mcf_test_hooks`), only in processes launched as ranks.

The interpreters a rank starts through multiprocessing (megatron-core's results-queue
Manager, the resource tracker) inherit ``RANK`` but run none of the hooked code: they stay
plain, so they do not import torch for nothing (2-3 s of CPU each, a dozen per job)."""

import os
import sys

#: How multiprocessing starts its interpreters (the ``-c`` code of ``sys.orig_argv``).
_MULTIPROCESSING_STARTS = "from multiprocessing."


def _started_by_multiprocessing() -> bool:
    argv = sys.orig_argv
    return "-c" in argv[:-1] and argv[argv.index("-c") + 1].startswith(_MULTIPROCESSING_STARTS)


if "RANK" in os.environ and not _started_by_multiprocessing():
    import mcf_test_hooks

    mcf_test_hooks.install()
