"""Reversible monkey patches, declared as data and checked before anything is touched.

A fix that has to live inside megatron-core (or torch) is declared as a :class:`Patch` next to
the code it fixes. A patch says what it replaces and everything it reads from upstream: the
symbols its replacement calls, the modules that imported the original by name, and probes
of instance attributes (e.g. the cache attributes of a freshly built caching strategy). A
renamed upstream symbol must never turn a fix into a silent no-op, so
:meth:`PatchSet.install` checks every requirement of every chosen patch first and raises
:class:`~.errors.UnsupportedVersionError` naming each missing one; only then does it apply
the patches, all or nothing. Whether upstream already has a fix is detected from its
behaviour (``not_needed``), never from a version number.

Keeping the original object (taken from the owner's ``__dict__``, so staticmethods,
classmethods and inherited attributes are restored exactly) is what makes ``uninstall()``
exact.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

from .errors import UnsupportedVersionError

logger = logging.getLogger(__name__)

_MISSING = object()

#: A check of something a patch relies on that is not a plain symbol (an attribute of a
#: freshly built upstream object, say); returns the problems found, empty when all is there.
Probe = Callable[[], list[str]]


@dataclass(frozen=True)
class Patch:
    """One attribute to replace, and everything the replacement needs from upstream.

    Attributes:
        name: stable id shown by ``installed()``: ``<feature>.<what>``.
        target: ``"package.module"`` or ``"package.module:Class"``.
        attr: attribute of the target to replace. Unless ``adds``, upstream must define it
            on the target itself, or on one of ``inherits_from``: a replacement written for
            one method must not land on another one that the MRO now finds (an override
            deleted, a parent's method that behaves differently).
        build: ``original -> replacement``; the replacement usually wraps the original
            (``original`` is None when ``adds``).
        why: one line for logs and ``installed()``.
        reads: upstream symbols (``"module:Qual.name"``) the replacement uses.
        probes: checks of what the replacement reads that is not a symbol.
        aliases: modules that imported the same object by name (``from x import f``);
            each must still hold the original, and is patched with it.
        adds: the patch gives the target an attribute it lacks (it must not exist yet).
        not_needed: detects, from upstream's behaviour, that the fix is not needed here;
            returns why (then the patch is not applied) or None.
        optional: a missing requirement skips this patch (``installed()`` says so) instead
            of failing ``install()``.
        inherits_from: base classes (``"package.module:Class"``) that define ``attr`` for
            ``target`` to inherit in some releases (the patch then gives ``target`` its own
            override); a base that a release lacks is simply not a candidate there.
    """

    name: str
    target: str
    attr: str
    build: Callable[[Any], Any]
    why: str
    reads: tuple[str, ...] = ()
    probes: tuple[Probe, ...] = ()
    aliases: tuple[str, ...] = ()
    adds: bool = False
    not_needed: Callable[[], str | None] | None = None
    optional: bool = False
    inherits_from: tuple[str, ...] = ()


def resolve(target: str) -> Any:
    """Import ``module`` or ``module:Class.Inner.attr`` and return the object."""
    module_name, _, qualname = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in filter(None, qualname.split(".")):
        obj = getattr(obj, part)
    return obj


def _raw(owner: Any, attr: str) -> Any:
    """The attribute as stored on ``owner`` itself (``_MISSING`` when inherited)."""
    return vars(owner).get(attr, _MISSING)


def _resolved(symbol: str) -> tuple[Any, str | None]:
    try:
        return resolve(symbol), None
    except (ImportError, AttributeError) as exc:
        return None, f"{symbol} not found ({type(exc).__name__}: {exc})"


def definer(owner: Any, attr: str) -> Any:
    """The object that holds ``attr`` itself: the first class of ``owner``'s MRO whose
    ``__dict__`` has it (``owner`` itself for a module or an instance), or None."""
    for holder in owner.__mro__ if isinstance(owner, type) else (owner,):
        if attr in vars(holder):
            return holder
    return None


def _name(obj: Any) -> str:
    return getattr(obj, "__name__", None) or repr(obj)


def read_problem(symbol: str) -> str | None:
    """A symbol ``module:Class.attr`` must be defined on ``Class`` itself, not inherited."""
    found, problem = _resolved(symbol)
    module_name, _, qualname = symbol.partition(":")
    owner_name, _, attr = qualname.rpartition(".")
    if problem or not owner_name:
        return problem
    owner = resolve(f"{module_name}:{owner_name}")
    holder = definer(owner, attr)
    if isinstance(owner, type) and holder is not owner:
        return (f"{symbol} is no longer defined on {_name(owner)} (found on {_name(holder)} "
                f"through the MRO): the patch was written for {_name(owner)}'s own")
    return None


def requirement_problems(patch: Patch) -> list[str]:
    """Everything ``patch`` needs from upstream that is missing (empty: it can be applied)."""
    owner, problem = _resolved(patch.target)
    if problem:
        return [problem]
    problems: list[str] = []
    where = f"{patch.target}.{patch.attr}"
    holder = definer(owner, patch.attr)
    if patch.adds and holder is not None:
        problems.append(f"{where} already exists; this patch would replace upstream's")
    if not patch.adds:
        problems += _definer_problems(patch, owner, holder, where)
    original = getattr(owner, patch.attr, None)
    for alias in patch.aliases:
        alias_owner, problem = _resolved(alias)
        if problem:
            problems.append(problem)
        elif not patch.adds and _raw(alias_owner, patch.attr) is not original:
            problems.append(f"{alias}.{patch.attr} is no longer the object {where}: the patch "
                            "would miss the callers that use it")
    problems += [p for p in map(read_problem, patch.reads) if p]
    for probe in patch.probes:
        try:
            problems += probe()
        except Exception as exc:  # noqa: BLE001 - a probe that cannot run is a problem too
            problems.append(f"{getattr(probe, '__name__', probe)} failed: "
                            f"{type(exc).__name__}: {exc}")
    return problems


def _definer_problems(patch: Patch, owner: Any, holder: Any, where: str) -> list[str]:
    """The replaced attribute must be defined where the patch says upstream defines it."""
    if holder is None:
        return [f"{where} not found (it is what this patch replaces)"]
    if holder is owner:
        return []
    bases = [resolve(b) for b in patch.inherits_from if _resolved(b)[1] is None]
    if any(holder is base for base in bases):
        return []
    allowed = " or ".join([_name(owner), *patch.inherits_from])
    return [f"{where} is no longer defined on {allowed} (found on {_name(holder)} through "
            f"the MRO): the patch replaces the method of {allowed}"]


def upstream_releases() -> str:
    """``megatron-core 0.19.2, torch 2.15.0``: the releases whose behaviour a refusal is
    about (a patch reads torch's internals as well as megatron-core's)."""
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for name in ("megatron-core", "torch"):
        try:
            found.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            found.append(f"no {name}")
    return ", ".join(found)


def not_needed_reason(patch: Patch) -> str | None:
    """Why upstream does not need ``patch`` here (detected), or None."""
    return patch.not_needed() if patch.not_needed is not None else None


@dataclass
class _Applied:
    patch: Patch
    originals: list[tuple[Any, Any]] = field(default_factory=list)  # (owner, raw original)


class PatchSet:
    """Applies and restores patches: all-or-nothing, idempotent in both directions."""

    def __init__(self) -> None:
        self._applied: dict[str, _Applied] = {}
        self._skipped: dict[str, str] = {}

    def names(self) -> list[str]:
        return list(self._applied)

    def describe(self) -> dict[str, str]:
        """Applied patches with why they exist, then chosen patches that were not applied."""
        return {**{name: a.patch.why for name, a in self._applied.items()},
                **{name: f"not applied: {reason}" for name, reason in self._skipped.items()}}

    def install(self, patches: Sequence[Patch]) -> list[str]:
        """Check every requirement of ``patches``, then apply them all, or none.

        Raises :class:`UnsupportedVersionError` listing every missing requirement of every
        non-optional patch before anything is touched; if applying fails midway, what this
        call applied is restored before the error propagates. Returns the names applied now.
        """
        plan: list[Patch] = []
        skipped: dict[str, str] = {}
        missing: list[str] = []
        for patch in patches:
            if patch.name in self._applied or patch.name in skipped:
                continue
            problems: list[str] = []
            try:
                reason = not_needed_reason(patch)
            except Exception as exc:  # noqa: BLE001 - cannot tell: refuse rather than guess
                reason = None
                problems.append("cannot detect whether upstream already has this fix "
                                f"({type(exc).__name__}: {exc})")
            if reason is not None:
                skipped[patch.name] = f"not needed: {reason}"
                continue
            problems += requirement_problems(patch)
            if problems and patch.optional:
                skipped[patch.name] = "optional, upstream lacks: " + "; ".join(problems)
            elif problems:
                missing += [f"{patch.name}: {p}" for p in problems]
            else:
                plan.append(patch)
        if missing:
            raise UnsupportedVersionError(
                f"megatron_ckpt_fixes cannot install on {upstream_releases()}: the installed "
                f"upstream lacks what {len(missing)} requirement(s) need; nothing was "
                "patched:\n  "
                + "\n  ".join(missing))
        done: list[str] = []
        try:
            for patch in plan:
                done.append(patch.name)
                self._apply(patch)
        except BaseException:
            self._restore(reversed(done))
            raise
        self._skipped.update(skipped)
        return done

    def _apply(self, patch: Patch) -> None:
        owner = resolve(patch.target)
        raw = _raw(owner, patch.attr)
        original = getattr(owner, patch.attr, None)
        applied = _Applied(patch, [(owner, raw)])
        replacement = patch.build(original)
        self._applied[patch.name] = applied  # recorded first: a failure below is restored
        setattr(owner, patch.attr, replacement)
        for alias in patch.aliases:
            alias_owner = resolve(alias)
            applied.originals.append((alias_owner, _raw(alias_owner, patch.attr)))
            setattr(alias_owner, patch.attr, replacement)
        logger.debug("patched %s.%s (%s)", patch.target, patch.attr, patch.name)

    def _restore(self, names: Iterable[str]) -> None:
        for name in names:
            applied = self._applied.pop(name, None)
            if applied is None:  # its build failed before anything was set
                continue
            for owner, raw in reversed(applied.originals):
                if raw is _MISSING:
                    delattr(owner, applied.patch.attr)
                else:
                    setattr(owner, applied.patch.attr, raw)
            logger.debug("restored %s", name)

    def restore_all(self) -> None:
        """Restore every original, newest patch first (patches may stack on one attribute)."""
        self._restore(reversed(list(self._applied)))
        self._skipped.clear()
