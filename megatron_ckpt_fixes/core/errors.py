"""The package's one exception root.

Every error this package raises is a :class:`MegatronCkptFixesError`, so one ``except``
catches all of them. The root derives from ``BaseException`` only, on purpose: each concrete
error *also* derives from the class users already catch for that failure (``ValueError``,
``RuntimeError``, megatron-core's ``CheckpointingException``, torch DCP's
``CheckpointException``). The root therefore never widens what an existing handler catches:
an error that upstream raised as a ``BaseException``-only ``CheckpointException`` does not
suddenly become an ``Exception``.
"""

from __future__ import annotations


class MegatronCkptFixesError(BaseException):
    """Root of every error raised by megatron_ckpt_fixes (see the module docstring)."""


class UnsupportedVersionError(MegatronCkptFixesError, RuntimeError):
    """The installed megatron-core lacks what a chosen fix needs (or is outside the range the
    fixes are tested with); raised by ``install()`` before anything is patched."""
