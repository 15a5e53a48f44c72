"""``torch.compile`` as it behaves with dynamo disabled, without importing dynamo.

With ``TORCHDYNAMO_DISABLE=1`` a compiled function runs the function itself. The CPU jobs of
the tests set it (on CPU ranks inductor would build C++ for kernels meant for GPUs), yet
megatron-core still decorates its fusions with ``torch.compile`` at import, and each
decoration imports dynamo to build a wrapper that would only call the function: 2-3 s of CPU
in every process of every job. The test platforms (Megatron-LM's ranks and the training
script's ranks) put :func:`eager_compile` in its place where dynamo is disabled.
"""

from __future__ import annotations

import os
from typing import Any

DISABLED_ENV = "TORCHDYNAMO_DISABLE"


def dynamo_disabled() -> bool:
    return os.environ.get(DISABLED_ENV) == "1"


def install() -> None:
    """Put :func:`eager_compile` in ``torch.compile``'s place where dynamo is disabled (before
    megatron-core is imported: it decorates at import)."""
    if dynamo_disabled():
        import torch

        torch.compile = eager_compile


def eager_compile(model: Any = None, **_options: Any) -> Any:
    """``torch.compile(fn, ...)`` -> ``fn``; ``torch.compile(**options)`` -> a decorator
    returning its function."""
    return (lambda fn: fn) if model is None else model
