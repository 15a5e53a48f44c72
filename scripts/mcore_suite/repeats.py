#!/usr/bin/env python
"""Compare repeated runs of the suite, setting aside the runs of a test that hit the suite's
own shared-directory race.

    python scripts/mcore_suite/repeats.py OUT1 OUT2 ... [--features F1 --features all]

Each OUT is a ``run.py --out`` directory holding one run per feature set. The suite's
``TempNamedDir(..., sync=False)`` (``tests/unit_tests/dist_checkpointing/__init__.py``) lets
rank 0 create and empty a directory that every rank shares while a rank that has already
failed the test deletes it (its ``TempNamedDir`` is finalized as the exception leaves the
test); rank 0 then fails with ``FileExistsError``/``FileNotFoundError`` on it before building
megatron-core's groups, skips the suite's teardown barrier, and the other ranks' teardown
times out: the test turns from failed to error, in either mode, on different tests from run to
run (0.16.1's ``test_optimizer.py`` at 4 ranks on 2 vCPUs). No harness can order that: it
happens inside one test. This script shows what is left when those runs of a test are set
aside: for each test, the (outcome, exception class) it had in the other runs, per feature
set. Exit code 1 if a test's outcomes differ between feature sets outside the race, or a
test hit it in every run of a feature set (nothing left to compare).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path

import compare
from run import UPSTREAM

#: a rank failed on the suite's shared checkpoint directory, created or emptied by rank 0
#: while another rank's finalizer deleted it
RACE = re.compile(r"(FileExistsError|FileNotFoundError)\b.*tmp_dist_ckpt")

Run = dict[str, dict[int, compare.Outcome]]


def hit_race(per_rank: dict[int, compare.Outcome]) -> bool:
    return any(RACE.search(outcome.message) for outcome in per_rank.values())


def clean_outcomes(runs: list[Run]) -> tuple[dict[str, set[tuple[str, str]]], int]:
    """test -> every (outcome, exception class) it had in ``runs`` outside the race, and how
    many runs of a test the race hit."""
    seen: dict[str, set[tuple[str, str]]] = defaultdict(set)
    hits = 0
    for run in runs:
        for test, per_rank in run.items():
            if hit_race(per_rank):
                hits += 1
                continue
            status, deciding = compare.verdict(per_rank)
            seen[test].add((status, deciding.exception if status in ("failed", "error") else ""))
    return seen, hits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("outs", nargs="+", type=Path)
    parser.add_argument("--features", action="append",
                        help=f"feature sets to compare (default: {UPSTREAM}, all)")
    args = parser.parse_args(argv)
    names = [f.replace(",", "+") for f in args.features or [UPSTREAM, "all"]]
    per_set = {}
    for name in names:
        runs = [compare.load_run(out / name) for out in args.outs]
        per_set[name], hits = clean_outcomes(runs)
        errors = [compare.counts(run)["error"] for run in runs]
        print(f"{name}: {len(runs)} runs, {len(per_set[name])} tests; runs of a test that hit "
              f"the race: {hits}; errors per run: {errors}")
    tests = sorted(set().union(*per_set.values()))
    bad = False
    for test in tests:
        outcomes = {name: per_set[name].get(test, set()) for name in names}
        if any(not o for o in outcomes.values()) or len(set(map(frozenset, outcomes.values()))) > 1:
            bad = True
            print(f"- {test}: " + "; ".join(f"{n}: {sorted(o)}" for n, o in outcomes.items()))
        elif len(next(iter(outcomes.values()))) > 1:
            print(f"- {test} varies from run to run alike in every set: {sorted(outcomes[names[0]])}")
    print(f"tests whose outcomes outside the race differ between feature sets: "
          f"{'some (above)' if bad else 0}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
