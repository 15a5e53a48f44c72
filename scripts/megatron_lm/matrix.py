#!/usr/bin/env python
"""Run the whole matrix of Megatron-LM's functional cases for the installed megatron-core.

    python scripts/megatron_lm/matrix.py [--out DIR] [--modes fixes,fixes+cs,...]
        [--cases NAME ...] [--nproc N]

Every ``gpt3_mcore_reruns_*`` case and :data:`RESUME_CASES` of the snapshot matching the
installed megatron-core, in each mode (``fixes``: ``MEGATRON_CKPT_FIXES=1``; ``upstream``:
plain megatron-core on the same CPU platform; ``+cs``: ``--ckpt-assume-constant-structure``
added), then every structure scenario (``scenarios.py``) fixed and upstream. Writes
``OUT/matrix-<megatron-core version>.md`` (the tables the README shows) and ``.json``.
One release per invocation: run it once in each environment.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from importlib.metadata import version
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import upstream_snapshots  # noqa: E402
from cases import case_names, load_case  # noqa: E402
from run_case import FLOWS, CaseResult, Mode, run_case  # noqa: E402
from scenarios import SCENARIOS  # noqa: E402

#: Resume cases that run here (no context parallelism, no FSDP, no MoE): both of
#: transformer-impl local and transformer_engine (replaced), 2 to 4 ranks.
RESUME_CASES: tuple[str, ...] = (
    "gpt3_mcore_tp1_pp2_resume_torch_dist",
    "gpt3_mcore_tp1_pp4_resume_torch_dist",
    "gpt3_mcore_tp4_pp1_resume_torch_dist",
    "gpt3_mcore_tp2_pp2_resume_torch_dist_uninstall_te",
    "gpt3_mcore_te_tp2_pp2_resume_torch_dist",
    "gpt3_mcore_te_tp1_pp1_resume_torch_dist_dist_optimizer",
    "gpt3_mcore_te_tp1_pp4_vp1_resume_torch_dist",
)
MODES: dict[str, Mode] = {
    "fixes": Mode(True, False),
    "fixes+cs": Mode(True, True),
    "upstream": Mode(False, False),
    "upstream+cs": Mode(False, True),
}


def cell(result: CaseResult) -> str:
    """One table cell: verdict, exit codes, checks, bitwise comparisons."""
    parts = [" ".join(f"{job} {','.join(map(str, codes))}"
                      for job, codes in result.exit_codes.items())]
    if result.checks is not None:
        stale = sum(c.status == "stale" for c in result.checks.checks)
        ok = sum(c.status == "ok" for c in result.checks.checks)
        parts.append(f"checks {ok}/{len(result.checks.checks)}"
                     + (f" (+{stale} stale, corrected ok)" if stale else ""))
    for comparison in result.comparisons:
        parts.append(f"{len(comparison.iterations)} its bitwise" if comparison.equal
                     else f"{len(comparison.differing)}/{len(comparison.iterations)} its differ")
    parts += [f"error: {error[:80]}" for error in result.errors.values()]
    parts += [f"{part} not run ({why})" for part, why in result.not_run.items()]
    return f"**{'pass' if result.passed else 'FAIL'}** " + "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("mlm-matrix"))
    parser.add_argument("--modes", default="fixes+cs,upstream+cs",
                        help=f"comma-separated, of {list(MODES)}")
    parser.add_argument("--cases", nargs="*", default=None)
    parser.add_argument("--nproc", type=int, default=None)
    parser.add_argument("--no-scenarios", action="store_true")
    args = parser.parse_args(argv)
    ref = upstream_snapshots.ref_for_installed()
    tree = upstream_snapshots.training_tree(ref)
    release = version("megatron-core")
    out = (args.out / release).resolve()
    modes = [m.strip() for m in args.modes.split(",")]
    names = args.cases or [*case_names(tree, "gpt3_mcore_reruns_*"), *RESUME_CASES]
    start = time.monotonic()
    rows, results = [], {}
    for name in names:
        case = load_case(tree, name)
        if case.test_type not in FLOWS:
            rows.append(f"| {name} | {case.test_type} | not run: this TEST_TYPE compares "
                        "gradients across parallelisms from a recorded 4B checkpoint |"
                        + " |" * (len(modes) - 1))
            continue
        cells = []
        for i, label in enumerate(modes):
            result = run_case(tree, ref, name, MODES[label], out, args.nproc,
                              print_changes=i == 0)
            results[f"{name}/{label}"] = result.to_json()
            cells.append(cell(result))
        rows.append(f"| {name} | {case.test_type} | " + " | ".join(cells) + " |")
    lines = [f"megatron-core {release}, Megatron-LM {ref}, torch on CPU/gloo; "
             f"{time.strftime('%Y-%m-%d')}", "",
             "| case | type | " + " | ".join(modes) + " |",
             "|---|---|" + "---|" * len(modes), *rows]
    if not args.no_scenarios:
        lines += ["", "| structure change (case + flags, all with "
                      "--ckpt-assume-constant-structure) | fixes | upstream | upstream "
                      "expected |", "|---|---|---|---|"]
        for scenario in SCENARIOS:
            flags = " ".join(f"{f} {v}" for f, v in scenario.flags)
            row = []
            for fixes in (True, False):
                result = run_case(tree, ref, scenario.case, Mode(fixes, True, scenario.flags),
                                  out / "scenarios" / scenario.name, args.nproc)
                results[f"scenario:{scenario.name}/{'fixes' if fixes else 'upstream'}"] = \
                    result.to_json()
                kept, why = scenario.kept(result)
                row.append(f"**{'kept' if kept else 'LOST'}**: {why}")
            expected = "loses it" if scenario.upstream_fails(release) else "keeps it"
            lines.append(f"| {scenario.name}: {scenario.case} {flags} | {row[0]} | {row[1]} "
                         f"| {expected} |")
    lines += ["", f"{time.monotonic() - start:.0f} s in all."]
    out.mkdir(parents=True, exist_ok=True)
    (out.parent / f"matrix-{release}.md").write_text("\n".join(lines) + "\n")
    (out.parent / f"matrix-{release}.json").write_text(json.dumps(results, indent=1))
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
