"""How ``verify``'s problems are printed: one line per damaged file, then a few of its items.

A cut-short or missing data file of a real model breaks thousands of items; a line for each
would bury everything else. So every problem that lies in a data file is counted under it:
one ``PROBLEM`` line says what is wrong with the file and how many of its items it breaks,
and at most ``shown`` indented lines name the first of them (``--items N`` shows more).
A problem outside the data files (a chunk that does not fit its shape, ``metadata.json``,
the common state, a record that cannot be read) keeps a line of its own. ``grep PROBLEM``
gives one line per thing to repair.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_ckpt_fixes.tools.cli.checks import Problem

#: Item lines per damaged file, unless ``--items`` says otherwise.
SHOWN = 10


@dataclass
class DamagedFile:
    """A data file and the problems of the items it breaks, in the order found."""

    name: str
    items: int  # all the items .metadata puts into the file
    problems: list[Problem] = field(default_factory=list)

    def lines(self, shown: int) -> list[str]:
        damage = "; ".join(dict.fromkeys(p.damage for p in self.problems if p.damage))
        lines = [f"PROBLEM {self.name}: {damage}: breaks {len(self.problems)} of its "
                 f"{self.items} item(s)"]
        lines += [f"  {problem}" for problem in self.problems[:shown]]
        rest = len(self.problems) - shown
        if rest > 0:
            lines.append(f"  ... and {rest} more (--items {len(self.problems)} lists them all)")
        return lines


def group(problems: Sequence[Problem],
          file_items: dict[str, int]) -> list[DamagedFile | Problem]:
    """The problems with those of each data file gathered under it, where its first was."""
    out: list[DamagedFile | Problem] = []
    files: dict[str, DamagedFile] = {}
    for problem in problems:
        if problem.file is None:
            out.append(problem)
            continue
        if problem.file not in files:
            files[problem.file] = DamagedFile(problem.file, file_items.get(problem.file, 0))
            out.append(files[problem.file])
        files[problem.file].problems.append(problem)
    return out


def problem_lines(grouped: Sequence[DamagedFile | Problem], shown: int = SHOWN) -> list[str]:
    """The report's problem lines."""
    lines: list[str] = []
    for entry in grouped:
        lines += entry.lines(shown) if isinstance(entry, DamagedFile) else [f"PROBLEM {entry}"]
    return lines


def verdict(grouped: Sequence[DamagedFile | Problem]) -> str:
    """``OK``, or what is wrong in counts: damaged files with the items they break, and the
    other problems."""
    files = [entry for entry in grouped if isinstance(entry, DamagedFile)]
    others = len(grouped) - len(files)
    parts = []
    if files:
        items = sum(len(f.problems) for f in files)
        parts.append(f"{len(files)} damaged file(s) breaking {items} item(s)")
    if others:
        parts.append(f"{others} other problem(s)" if files else f"{others} problem(s)")
    return ", ".join(parts) or "OK"
