"""Upstream's warnings and tracebacks only when asked, so an error is the last line printed.

Importing megatron-core prints, through Python's ``warnings``, that Transformer Engine and
Apex are absent, and building its configs prints deprecations: 12 to 34 lines per rank before
a job's own one-line error, which then lands at the bottom of a screen of other text. The
project's tools (``scripts/train.py`` and so the ranks of ``run_with_restarts.py`` and of the
demo, ``megatron-ckpt-fixes status``) call :func:`quiet_unless` once, before they import
megatron-core. It filters the warnings that upstream's own modules issue (:data:`UPSTREAM`)
and the one deprecation torch repeats on every rank of every resume because megatron-core's
load path reaches it (:data:`UPSTREAM_DEPRECATIONS`) and the log line a CUDA build of torch
writes on a machine without a GPU (:data:`UPSTREAM_LOG_NOISE`), nothing else: the package's
errors, log lines and warnings, and every other warning, stay.
``--verbose``, or :data:`VERBOSE_ENV` set for processes a flag cannot reach (a launcher's
ranks), keeps them, and the tools' tracebacks.

A script started by ``megatron-ckpt-fixes run`` prints what it prints under plain ``python``:
the filter is the tools' own choice, never the activation's.
"""

from __future__ import annotations

import logging
import os
import re
import warnings

from megatron_ckpt_fixes.activation import switched_on

#: ``1`` (or ``on``, ``yes``): every tool of the project prints upstream's warnings and the
#: tracebacks of errors, as ``--verbose`` does; read by every rank of a job.
VERBOSE_ENV = "MEGATRON_CKPT_FIXES_VERBOSE"
#: The modules whose warnings are hidden: megatron-core (Megatron-FSDP also as its own package),
#: Transformer Engine and Apex. Matched against the module a warning is issued from.
UPSTREAM = r"(megatron\.core|megatron_fsdp|transformer_engine|apex)(\.|$)"
#: Deprecations of torch that megatron-core's code triggers (issued from torch's modules, so
#: :data:`UPSTREAM` does not match them); users of the tools cannot act on them.
UPSTREAM_DEPRECATIONS = (
    "Please use DTensor instead and we are deprecating ShardedTensor",  # torch DCP, each load
)
#: Log records (logger name, message start) that a CUDA build of torch writes when
#: megatron-core imports ``torch.utils.cpp_extension`` on a machine without a GPU but with a
#: CUDA toolkit: a warning on every rank that a CPU user cannot act on.
UPSTREAM_LOG_NOISE = (("torch.utils.cpp_extension", "No CUDA runtime is found"),)


class _DropMessage(logging.Filter):
    """Drops the records of one logger whose message starts with ``start``."""

    def __init__(self, start: str) -> None:
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.start)


def verbose_requested(flag: bool = False) -> bool:
    """Whether to show upstream's warnings and tracebacks: ``flag`` (a tool's ``--verbose``)
    or :data:`VERBOSE_ENV` set."""
    return flag or switched_on(os.environ.get(VERBOSE_ENV))


def hide_upstream_warnings() -> None:
    """Ignore the Python warnings issued by upstream's modules from now on in this process."""
    warnings.filterwarnings("ignore", module=UPSTREAM)
    for message in UPSTREAM_DEPRECATIONS:
        warnings.filterwarnings("ignore", message=re.escape(message), category=FutureWarning)
    for name, start in UPSTREAM_LOG_NOISE:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessage) and f.start == start for f in logger.filters):
            logger.addFilter(_DropMessage(start))


def quiet_unless(flag: bool = False) -> bool:
    """Hide upstream's warnings unless verbose (:func:`verbose_requested`); returns whether
    verbose. Call it before megatron-core is imported: most of its warnings are import-time."""
    verbose = verbose_requested(flag)
    if not verbose:
        hide_upstream_warnings()
    return verbose
