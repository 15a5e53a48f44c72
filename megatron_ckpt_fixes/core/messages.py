"""Error lines a person can read: never longer than a screen.

Upstream messages can carry every key of a checkpoint: torch DCP's ``KeyError: "X from model
not in state dict: [...]"`` lists all of them (7,000 characters for a tiny GPT). A line that
names the failing key is enough; :func:`shorten` keeps each quoted list's first items and
counts the rest, and cuts what is still longer than :data:`LIMIT`, saying how much it cut.
The full text stays where it came from (the exception; ``--verbose`` prints tracebacks).

:class:`OneLineParser`: the tools' bad command lines get one line too, by rank 0 only, since
every rank of a job parses the same command line.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import NoReturn

#: At most this many characters per line (a 100-column terminal, about 8 rows).
LIMIT = 800
#: Items of a long quoted list that a line keeps.
SHOWN = 3

_QUOTED = r"'[^'\n]*'|\"[^\"\n]*\""
_LIST = re.compile(rf"([\[{{(])\s*((?:{_QUOTED})(?:\s*,\s*(?:{_QUOTED}))*)\s*,?\s*([\]}})])")
_ITEM = re.compile(_QUOTED)


def _short_list(match: re.Match[str]) -> str:
    items = _ITEM.findall(match.group(2))
    if len(items) <= SHOWN + 1:
        return match.group(0)
    return (f"{match.group(1)}{', '.join(items[:SHOWN])}, ... {len(items) - SHOWN} more "
            f"({len(items)} in all){match.group(3)}")


def shorten_line(line: str) -> str:
    """One line with long quoted lists cut to their first items and a count, then cut to
    :data:`LIMIT` characters if still longer."""
    line = _LIST.sub(_short_list, line)
    if len(line) <= LIMIT:
        return line
    cut = f" ... [{len(line) - LIMIT} more characters]"
    return line[:LIMIT - len(cut)] + cut


def shorten(text: str) -> str:
    """:func:`shorten_line` for every line of ``text``."""
    return "\n".join(shorten_line(line) for line in text.splitlines())


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad command line is one line, printed by rank 0 only (``RANK`` unset
    or 0; the other ranks exit quietly), and exit code 2 as argparse gives."""

    def error(self, message: str) -> NoReturn:
        if os.environ.get("RANK", "0") == "0":
            print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr, flush=True)
        sys.exit(2)
