"""Helpers for asking upstream what it does, by running it.

``install()`` decides whether a fix is needed from upstream's behaviour (never from a
version number). Some behaviours can only be observed with a process group (megatron-core
asks ``torch.distributed`` for the rank and world size while building sharded objects);
``install()`` often runs before ``init_process_group``, so a probe may borrow a private
one-rank gloo world for its duration.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch.distributed as dist


@contextlib.contextmanager
def probe_world() -> Iterator[None]:
    """The existing process group, or a one-rank gloo group (in-memory store) for the probe."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def quiet(logger_name: str) -> Iterator[None]:
    """Silence a logger while a probe builds upstream objects that log on construction."""
    target = logging.getLogger(logger_name)
    level = target.level
    target.setLevel(logging.ERROR)
    try:
        yield
    finally:
        target.setLevel(level)
