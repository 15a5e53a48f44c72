"""What ``install()`` put in place, readably: one line for a job's log, a page for a person.

``installed()`` stays a dict (patch -> why it is there, or why not), which code reads; printed,
it is one line of about 8,000 characters. This module turns it into what a person reads: the
zero-code activation's one line (:func:`activation_line`: the release it patched, how many
patches, which were not applied and why in a word), and ``megatron-ckpt-fixes status`` /
``python -m megatron_ckpt_fixes`` (:func:`report`: per feature, with the reasons). Pure
functions of the dict, so what they say is what ``installed()`` says.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
from collections.abc import Mapping

from megatron_ckpt_fixes import FEATURES, MEGATRON_CORE, OPTIONAL_FEATURES, __version__

#: A line of :func:`report` keeps at most this many characters (details: ``--all``).
WIDTH = 120

_WAITING = re.compile(r"waiting: applied when (\S+) is first imported")
_ABSENT = re.compile(r"not applied: (\S+) is not installed")


def feature_of(patch: str) -> str:
    """The feature that declares ``patch`` (patch names start with their feature's path)."""
    known = [f for f in FEATURES + OPTIONAL_FEATURES if patch.startswith(f"{f}.")]
    return max(known, key=len) if known else patch.rsplit(".", 1)[0]


def is_applied(reason: str) -> bool:
    return not reason.startswith(("not applied:", "waiting:"))


def short_reason(reason: str) -> str:
    """Why a patch is not applied, in a few words (``installed()`` holds the whole reason)."""
    if match := _WAITING.match(reason):
        return f"waiting for {match.group(1)}"
    if _ABSENT.match(reason):
        return "system not installed"
    text = reason.removeprefix("not applied: ")
    if text.startswith("not needed"):
        return "not needed here"
    if text.startswith("optional"):
        return "upstream lacks what it reads"
    return text.split(":", 1)[0].split(" (", 1)[0]


def _grouped(names: list[str], installed: Mapping[str, str]) -> list[str]:
    """``names`` with every feature whose chosen patches are all in ``names`` written once."""
    out: list[str] = []
    for name in names:
        feature = feature_of(name)
        whole = all(p in names for p in installed if feature_of(p) == feature)
        item = feature if whole else name
        if item not in out:
            out.append(item)
    return out


def not_applied(installed: Mapping[str, str]) -> dict[str, list[str]]:
    """Short reason -> the features (or single patches) not applied for it."""
    by_reason: dict[str, list[str]] = {}
    for name, reason in installed.items():
        if not is_applied(reason):
            by_reason.setdefault(short_reason(reason), []).append(name)
    return {reason: _grouped(names, installed) for reason, names in by_reason.items()}


def release(system: str) -> str:
    """``system`` and its installed version (``megatron-core 0.16.1``), as far as known."""
    name = "megatron-core" if system == MEGATRON_CORE else system
    try:
        return f"{name} {importlib.metadata.version(name)}"
    except importlib.metadata.PackageNotFoundError:
        found = getattr(sys.modules.get(system), "__version__", None)
        return f"{name} {found}" if found else name


def activation_line(installed: Mapping[str, str], system: str, switch: str) -> str:
    """The one line the zero-code activation prints once it installed on ``system``'s import,
    e.g. ``megatron_ckpt_fixes: activated on megatron-core 0.16.1 (MEGATRON_CKPT_FIXES=1): 44
    patches (not applied: writer_failures.threads.collection: not needed here)``."""
    count = sum(is_applied(reason) for reason in installed.values())
    line = f"megatron_ckpt_fixes: activated on {release(system)} ({switch}): {count} patches"
    missing = not_applied(installed)
    if missing:
        line += " (not applied: " + "; ".join(f"{', '.join(names)}: {reason}"
                                              for reason, names in missing.items()) + ")"
    return line


def _by_feature(others: Mapping[str, str],
                installed: Mapping[str, str]) -> list[tuple[str, str]]:
    """(label, reason) per feature whose chosen patches all share one reason (``"dtensor.mlite
    (3)"``), else per patch."""
    rows: list[tuple[str, str]] = []
    done: set[str] = set()
    for name, reason in others.items():
        feature = feature_of(name)
        if feature in done:
            continue
        mates = [p for p in installed if feature_of(p) == feature]
        if all(others.get(p) == reason for p in mates):
            rows.append((f"{feature} ({len(mates)})", reason))
            done.add(feature)
        else:
            rows.append((name, reason))
    return rows


def _cut(line: str) -> str:
    return line if len(line) <= WIDTH else line[:WIDTH - 3] + "..."


def report(installed: Mapping[str, str], features: str, every_patch: bool = False) -> list[str]:
    """The lines of ``megatron-ckpt-fixes status``: versions, then each feature applied (its
    patches), not applied or waiting (why); ``every_patch``: each patch with its whole why."""
    applied = [name for name, reason in installed.items() if is_applied(reason)]
    lines = [f"megatron-ckpt-fixes {__version__} on {release(MEGATRON_CORE)}, {release('torch')}"
             f"; features: {features}",
             f"applied: {len(applied)} patches"]
    per_feature: dict[str, list[str]] = {}
    for name in applied:
        per_feature.setdefault(feature_of(name), []).append(name)
    for feature, names in per_feature.items():
        parts = ", ".join(n.removeprefix(f"{feature}.") for n in names)
        lines.append(_cut(f"  {feature} ({len(names)}): {parts}"))
    others = {name: reason for name, reason in installed.items() if not is_applied(reason)}
    if others:
        lines.append(f"not applied: {len(others)} patches")
        lines += [_cut(f"  {label}: {reason.removeprefix('not applied: ')}")
                  for label, reason in _by_feature(others, installed)]
    if every_patch:
        lines += ["every patch:", *(f"  {name}: {why}" for name, why in installed.items())]
    else:
        lines.append("each patch and why: megatron-ckpt-fixes status --all")
    return lines
