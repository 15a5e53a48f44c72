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

Every upstream attribute is replaced by exactly one :class:`Patch`. Where several features
must wrap the same attribute, it is declared once as an :class:`EntryPoint` that names their
:class:`Layer` s in the order they run; its one patch calls the enabled layers in that order,
so the order is data that ``install()`` checks, not the order features happened to be
installed in.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

from megatron_ckpt_fixes.core.errors import UnsupportedVersionError

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


@dataclass(frozen=True)
class EntryPoint:
    """An upstream attribute that more than one feature wraps, patched once.

    Attributes:
        name: the name of its one patch (``entry.<what>``).
        target, attr, aliases, inherits_from: as for :class:`Patch`.
        layers: the names of the :class:`Layer` s that may wrap it, outermost first; a layer
            it does not name is a declaration error.
        probes: checks of what every layer relies on (that upstream calls it, say), run
            for each layer.
    """

    name: str
    target: str
    attr: str
    layers: tuple[str, ...]
    aliases: tuple[str, ...] = ()
    inherits_from: tuple[str, ...] = ()
    probes: tuple[Probe, ...] = ()


@dataclass(frozen=True)
class Layer:
    """One feature's wrapper of an :class:`EntryPoint`: ``build(inner) -> wrapper``, where
    ``inner`` is the next layer inward (or upstream's original). The other fields are those
    of :class:`Patch`; what it replaces is its entry point's."""

    name: str
    entry: EntryPoint
    build: Callable[[Any], Any]
    why: str
    reads: tuple[str, ...] = ()
    probes: tuple[Probe, ...] = ()
    not_needed: Callable[[], str | None] | None = None
    optional: bool = False
    adds = False

    @property
    def target(self) -> str:
        return self.entry.target

    @property
    def attr(self) -> str:
        return self.entry.attr

    @property
    def aliases(self) -> tuple[str, ...]:
        return self.entry.aliases

    @property
    def inherits_from(self) -> tuple[str, ...]:
        return self.entry.inherits_from


#: What a feature declares: an attribute of its own, or a layer of a shared entry point.
Declared = Patch | Layer


class _Chain:
    """The enabled layers of one entry point, composed over upstream's original."""

    def __init__(self, entry: EntryPoint) -> None:
        self.entry = entry
        self.layers: dict[str, Layer] = {}
        self.original: Any = None
        self.call: Callable[..., Any] | None = None

    def bind(self, original: Any) -> Any:
        """The entry point's one replacement: calls the composed layers. Layers wrap plain
        functions; a static method stays one."""
        self.original = original
        self.compose()

        @functools.wraps(original)
        def entry_point(*args: Any, **kwargs: Any) -> Any:
            return self.call(*args, **kwargs)

        raw = _raw(resolve(self.entry.target), self.entry.attr)
        return staticmethod(entry_point) if isinstance(raw, staticmethod) else entry_point

    def compose(self) -> None:
        call = self.original
        for name in reversed(self.entry.layers):
            if name in self.layers:
                call = self.layers[name].build(call)
        self.call = call


def check_order(layer: Layer) -> None:
    """A layer must be named by its entry point's declared order."""
    if layer.name not in layer.entry.layers:
        raise ValueError(f"layer {layer.name!r} is not in the declared order of entry point "
                         f"{layer.entry.name!r}: {list(layer.entry.layers)}")


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
    entry = getattr(patch, "entry", None)
    for probe in (*(entry.probes if entry is not None else ()), *patch.probes):
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
    """Applies and restores patches and layers: all-or-nothing, idempotent both ways."""

    def __init__(self) -> None:
        self._applied: dict[str, _Applied] = {}
        self._layers: dict[str, Layer] = {}  # enabled, in the order they were applied
        self._chains: dict[str, _Chain] = {}  # entry point name -> its enabled layers
        self._skipped: dict[str, str] = {}

    def names(self) -> list[str]:
        """What features declared and is applied (an entry point's own patch is not a
        feature's: its layers are listed)."""
        return [n for n in self._applied if n not in self._chains] + list(self._layers)

    def describe(self) -> dict[str, str]:
        """Applied patches with why they exist, then chosen patches that were not applied."""
        applied = {name: a.patch.why for name, a in self._applied.items()
                   if name not in self._chains}
        return {**applied, **{name: layer.why for name, layer in self._layers.items()},
                **{name: f"not applied: {reason}" for name, reason in self._skipped.items()}}

    def patched(self) -> list[tuple[str, str]]:
        """``(target, attr)`` of every applied patch, entry points' included: each upstream
        attribute appears once."""
        return [(a.patch.target, a.patch.attr) for a in self._applied.values()]

    def install(self, patches: Sequence[Declared]) -> list[str]:
        """Check every requirement of ``patches``, then apply them all, or none.

        Raises :class:`UnsupportedVersionError` listing every missing requirement of every
        non-optional patch before anything is touched; if applying fails midway, what this
        call applied is restored before the error propagates. Returns the names applied now.
        """
        plan: list[Declared] = []
        skipped: dict[str, str] = {}
        missing: list[str] = []
        for patch in patches:
            if isinstance(patch, Layer):
                check_order(patch)
            if patch.name in self._applied or patch.name in self._layers \
                    or patch.name in skipped or any(p.name == patch.name for p in plan):
                continue  # two features may declare one shared patch
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
                if isinstance(patch, Layer):
                    self._enable(patch)
                else:
                    self._apply(patch)
        except BaseException:
            self._restore(reversed(done))
            raise
        self._skipped.update(skipped)
        return done

    def _enable(self, layer: Layer) -> None:
        """Add ``layer`` to its entry point, patching the entry point on its first layer."""
        entry = layer.entry
        chain = self._chains.get(entry.name)
        if chain is None:
            chain = _Chain(entry)
            try:
                self._apply(Patch(name=entry.name, target=entry.target, attr=entry.attr,
                                  build=chain.bind, why=f"runs the layers of {entry.name}",
                                  aliases=entry.aliases, inherits_from=entry.inherits_from))
            except BaseException:
                self._restore([entry.name])
                raise
            self._chains[entry.name] = chain
        self._layers[layer.name] = layer
        chain.layers[layer.name] = layer
        chain.compose()

    def _disable(self, layer: Layer) -> None:
        """Take ``layer`` out of its entry point; the last one out restores the attribute."""
        del self._layers[layer.name]
        chain = self._chains[layer.entry.name]
        del chain.layers[layer.name]
        if chain.layers:
            chain.compose()
        else:
            del self._chains[layer.entry.name]
            self._restore([layer.entry.name])

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
            layer = self._layers.get(name)
            if layer is not None:
                self._disable(layer)
                continue
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
        """Restore every original, newest first."""
        self._restore(reversed([*self._applied, *self._layers]))
        self._skipped.clear()
