#!/usr/bin/env python
"""Compare two runs of megatron-core's test suite test by test (junit XML, one file per rank).

    python scripts/mcore_suite/compare.py RUN_A RUN_B [--markdown OUT.md]

A run is a directory of ``rank*.xml`` files. A test's outcome in a run is the worst over its
ranks (error > failed > passed > skipped: one failing rank fails the test; a test is skipped
only if every rank skipped it). Prints the counts per run, every test whose outcome differs,
and every test that fails in both runs with a different exception class. Exit code 1 if any
test differs.
"""

from __future__ import annotations

import argparse
import re
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

SEVERITY = {"skipped": 0, "passed": 1, "failed": 2, "error": 3}


@dataclass(frozen=True)
class Outcome:
    """A test's outcome on one rank: what happened and, if it did not pass, the message."""

    status: str
    message: str = ""

    @property
    def exception(self) -> str:
        """The exception class named by the message (``"RuntimeError"``), or ''."""
        match = re.match(r"\s*([\w.]+(?:Error|Exception|Interrupt|Exit|Failed|Timeout)\b)",
                         self.message)
        return match.group(1) if match else self.message.split(":", 1)[0][:80]


def _outcome(case: ET.Element) -> Outcome:
    for status in ("error", "failure", "skipped"):
        child = case.find(status)
        if child is not None:
            name = "failed" if status == "failure" else status
            return Outcome(name, child.get("message") or (child.text or "")[:500])
    return Outcome("passed")


def load_run(directory: Path) -> dict[str, dict[int, Outcome]]:
    """test id -> {rank: outcome} from every ``rank<N>.xml`` in ``directory``."""
    tests: dict[str, dict[int, Outcome]] = {}
    files = sorted(directory.glob("rank*.xml"))
    if not files:
        raise SystemExit(f"no rank*.xml in {directory}")
    for path in files:
        rank = int(re.findall(r"\d+", path.stem)[-1])
        for case in ET.parse(path).getroot().iter("testcase"):
            test = f"{case.get('classname')}::{case.get('name')}"
            tests.setdefault(test, {})[rank] = _outcome(case)
    return tests


def verdict(per_rank: dict[int, Outcome]) -> tuple[str, Outcome]:
    """The test's outcome over all its ranks, and the lowest rank's outcome that decides it."""
    worst = max(SEVERITY[o.status] for o in per_rank.values())
    status = next(s for s, v in SEVERITY.items() if v == worst)
    deciding = next(per_rank[r] for r in sorted(per_rank) if per_rank[r].status == status)
    return status, deciding


@dataclass(frozen=True)
class Difference:
    test: str
    a: tuple[str, Outcome]
    b: tuple[str, Outcome]


def compare(a: dict[str, dict[int, Outcome]], b: dict[str, dict[int, Outcome]]
            ) -> tuple[list[Difference], list[Difference]]:
    """(tests whose outcome differs, tests failing in both with another exception class)."""
    missing = ("absent", Outcome("absent"))
    outcome_diffs, exception_diffs = [], []
    for test in sorted(set(a) | set(b)):
        va = verdict(a[test]) if test in a else missing
        vb = verdict(b[test]) if test in b else missing
        if va[0] != vb[0]:
            outcome_diffs.append(Difference(test, va, vb))
        elif va[0] in ("failed", "error") and va[1].exception != vb[1].exception:
            exception_diffs.append(Difference(test, va, vb))
    return outcome_diffs, exception_diffs


def counts(run: dict[str, dict[int, Outcome]]) -> Counter[str]:
    return Counter(verdict(per_rank)[0] for per_rank in run.values())


def _line(outcome: tuple[str, Outcome]) -> str:
    status, deciding = outcome
    message = " ".join(deciding.message.split())[:300]
    return f"{status}" + (f" ({message})" if message else "")


def report(name_a: str, name_b: str, a: dict, b: dict) -> tuple[str, bool]:
    outcome_diffs, exception_diffs = compare(a, b)
    lines = [f"| run | tests | {' | '.join(SEVERITY)} |", "|---|---|---|---|---|---|"]
    for name, run in ((name_a, a), (name_b, b)):
        c = counts(run)
        lines.append(f"| {name} | {len(run)} | " + " | ".join(str(c[s]) for s in SEVERITY) + " |")
    lines.append("")
    lines.append(f"Tests whose outcome differs: {len(outcome_diffs)}")
    for d in outcome_diffs:
        lines += [f"- `{d.test}`", f"  - {name_a}: {_line(d.a)}", f"  - {name_b}: {_line(d.b)}"]
    lines.append("")
    lines.append(f"Tests failing in both with another exception class: {len(exception_diffs)}")
    for d in exception_diffs:
        lines += [f"- `{d.test}`", f"  - {name_a}: {_line(d.a)}", f"  - {name_b}: {_line(d.b)}"]
    return "\n".join(lines) + "\n", bool(outcome_diffs or exception_diffs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_a", type=Path)
    parser.add_argument("run_b", type=Path)
    parser.add_argument("--markdown", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    text, differs = report(args.run_a.name, args.run_b.name,
                           load_run(args.run_a), load_run(args.run_b))
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    return 1 if differs else 0


if __name__ == "__main__":
    sys.exit(main())
