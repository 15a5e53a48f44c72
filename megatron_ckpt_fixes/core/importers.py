"""Which modules of a package bind a function by name when they are imported (used by the
features that patch a function some modules imported by name: megatron-core's checkpoint
helpers, NeMo Automodel's expert split).

A module that did ``from megatron.core.utils import make_tp_sharded_tensor_for_checkpoint``
holds its own reference to the function: patching ``megatron.core.utils`` alone would miss
every caller in that module. Which modules do so changes between megatron-core releases
(0.19 added ``multi_latent_attention`` and ``ssm.mamba_mixer``), so the list is read from the
installed package's source (module-level ``from ... import`` statements, relative ones
included), not written down for one release. Imports inside functions look the name up when
they run and need no alias. Reading ~500 files with a substring filter, then parsing the
few hits, takes a few tenths of a second, once per process (at the feature's import).
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Iterator
from pathlib import Path


def _module_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Statements that run at import time: not inside functions or classes."""
    for node in body:
        yield node
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            for block in (getattr(node, f, ()) for f in ("body", "orelse", "finalbody")):
                yield from _module_level(list(block))
            for handler in getattr(node, "handlers", ()):
                yield from _module_level(handler.body)


def _source_of(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    package = module if is_package else module.rpartition(".")[0]
    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
    return f"{base}.{node.module}" if node.module else base


def bound_imports(package: str, source: str, names: tuple[str, ...]
                  ) -> dict[str, tuple[tuple[str, str], ...]]:
    """For each of ``names``: ``(module, bound name)`` of every module of ``package`` whose
    import-time code does ``from <source> import <name>`` (``as`` another name included),
    sorted by module. One pass over the package's files for all names."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"{package!r} is not an installed package")
    found: dict[str, set[tuple[str, str]]] = {name: set() for name in names}
    for root in map(Path, spec.submodule_search_locations):
        for path in root.rglob("*.py"):
            text = path.read_text(encoding="utf-8", errors="replace")
            if not any(name in text for name in names):
                continue
            parts = path.relative_to(root).with_suffix("").parts
            is_package = parts[-1] == "__init__"
            module = ".".join((package, *(parts[:-1] if is_package else parts)))
            for node in _module_level(ast.parse(text, str(path)).body):
                if isinstance(node, ast.ImportFrom) and \
                        _source_of(node, module, is_package) == source:
                    for alias in node.names:
                        if alias.name in found:
                            found[alias.name].add((module, alias.asname or alias.name))
    return {name: tuple(sorted(hits)) for name, hits in found.items()}


def name_aliases(imports: tuple[tuple[str, str], ...], name: str) -> tuple[str, ...]:
    """The modules in ``imports`` (of ``name``, from :func:`bound_imports`) that bind it
    under its own name: the aliases a patch of the attribute ``name`` must patch too."""
    return tuple(module for module, bound in imports if bound == name)


def renamed_imports(imports: tuple[tuple[str, str], ...], source: str, name: str) -> list[str]:
    """Problems: modules that bind ``name`` under another name, which a patch of the
    attribute ``name`` cannot reach."""
    return [f"{module} imports {source}.{name} as {bound!r}; the patch would miss its callers"
            for module, bound in imports if bound != name]
