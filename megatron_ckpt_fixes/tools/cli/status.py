"""``megatron-ckpt-fixes status``: what ``install()`` applies here, per feature, and why not.

A fresh process has nothing installed, so the command installs, in its own process only, the
features a job would get: ``--features``, else those ``MEGATRON_CKPT_FIXES`` names, else the
default ones; then it prints :func:`megatron_ckpt_fixes.tools.status.report` (``--all``: each patch
with its reason). Detection is by behaviour, as in a job, so the answer is the job's. Upstream's
import-time warnings are hidden (:mod:`megatron_ckpt_fixes.core.verbosity`).
"""

from __future__ import annotations

import os
import sys

from megatron_ckpt_fixes.activation import ENV, ActivationError, disarm, parse_features, switched_on
from megatron_ckpt_fixes.core.errors import UnsupportedVersionError
from megatron_ckpt_fixes.core.verbosity import quiet_unless

PROG = "megatron-ckpt-fixes status"


def chosen(features: str | None) -> tuple[str, str]:
    """(switch value, where it came from): ``--features``, the environment, or the default."""
    if features is not None:
        return features, "--features"
    value = os.environ.get(ENV)
    if switched_on(value):
        return value or "", ENV
    return "1", "default"


def main(features: str | None = None, every_patch: bool = False, verbose: bool = False) -> int:
    """Print the status; exit code 0, 2 for a bad feature list, 1 if ``install()`` refuses."""
    value, source = chosen(features)
    try:
        names = parse_features(value)
    except ActivationError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    if names is None:
        print(f"{PROG}: {source} {value!r} turns every feature off: nothing to install")
        return 0
    quiet_unless(verbose)
    disarm()  # this process installs once, here, rather than also through the switch's hook
    import megatron_ckpt_fixes
    from megatron_ckpt_fixes.tools.status import report

    try:
        megatron_ckpt_fixes.install(names)
    except UnsupportedVersionError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    label = "default" if source == "default" else f"{value} ({source})"
    print("\n".join(report(megatron_ckpt_fixes.installed(), label, every_patch)))
    return 0
