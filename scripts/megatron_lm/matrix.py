#!/usr/bin/env python
"""Run the whole matrix of Megatron-LM's functional cases for the installed megatron-core.

    python scripts/megatron_lm/matrix.py [--out DIR] [--modes fixes+cs,upstream+cs,...]
        [--cases NAME ...] [--nproc N]
    python scripts/megatron_lm/matrix.py --table DIR/matrix-0.16.1.json DIR/matrix-0.19.2.json

Every ``gpt3_mcore_reruns_*`` case and :data:`RESUME_CASES` of the snapshot matching the
installed megatron-core, in each mode (``fixes``: ``MEGATRON_CKPT_FIXES=1``; ``upstream``:
plain megatron-core on the same CPU platform; ``+cs``: ``--ckpt-assume-constant-structure``
added; default: both with it), then every structure scenario (``scenarios.py``) fixed and
upstream. Writes ``OUT/matrix-<megatron-core version>.md`` and ``.json``. One release per
invocation: run it once in each environment; ``--table`` puts the releases' results side by
side, compactly (the table in docs/megatron_lm.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
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


def short(result: dict) -> str:
    """A compact cell from a result's JSON: verdict, first job's exit codes, checks, bitwise
    iterations."""
    parts = [",".join(map(str, next(iter(result["exit_codes"].values()), [])))]
    if result["checks"]:
        statuses = [c["status"] for c in result["checks"]["checks"]]
        stale = statuses.count("stale")
        parts.append(f"checks {statuses.count('ok')}/{len(statuses)}"
                     + (f" + {stale} stale (corrected ok)" if stale else ""))
    compared = [c for c in result["comparisons"] if c["iterations"]]
    if compared:
        same = all(not c["differing"] for c in compared)
        its = sum(len(c["iterations"]) for c in compared)
        parts.append(f"{its} its {'bitwise' if same else 'DIFFER'}")
    parts += [f"{part}: not run" for part in result.get("not_run", {})]
    return f"{'pass' if result['passed'] else '**FAIL**'} ({'; '.join(parts)})"


def table(paths: list[Path]) -> str:
    """The releases' matrices side by side: one column per release and mode, then the
    structure scenarios, fixed and upstream, per release."""
    runs = {path.stem.removeprefix("matrix-"): json.loads(path.read_text()) for path in paths}
    keys = [k for results in runs.values() for k in results]
    cases = list(dict.fromkeys(k.split("/")[0] for k in keys if not k.startswith("scenario:")))
    modes = list(dict.fromkeys(k.split("/")[1] for k in keys if not k.startswith("scenario:")))
    header = [f"{release} {mode}" for release in runs for mode in modes]
    lines = ["| case | " + " | ".join(header) + " |", "|---|" + "---|" * len(header)]
    for name in cases:
        cells = [short(runs[r][f"{name}/{m}"]) if f"{name}/{m}" in runs[r] else "not run"
                 for r in runs for m in modes]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    scenarios = list(dict.fromkeys(k.split("/")[0] for k in keys if k.startswith("scenario:")))
    header = [f"{release} {side}" for release in runs for side in ("fixes", "upstream")]
    lines += ["", "| structure change | " + " | ".join(header) + " |",
              "|---|" + "---|" * len(header)]
    for name in scenarios:
        cells = []
        for release in runs:
            for side in ("fixes", "upstream"):
                result = runs[release].get(f"{name}/{side}")
                cells.append("not run" if result is None else
                             f"{'kept' if result['kept'] else '**lost**'}: {result['why']}")
        lines.append(f"| {name.removeprefix('scenario:')} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path,
                        default=Path(tempfile.gettempdir()) / "megatron_lm_matrix")
    parser.add_argument("--modes", default="fixes+cs,upstream+cs",
                        help=f"comma-separated, of {list(MODES)}")
    parser.add_argument("--cases", nargs="*", default=None,
                        help="cases to run (default: all; none: only the scenarios)")
    parser.add_argument("--nproc", type=int, default=None)
    parser.add_argument("--no-scenarios", action="store_true")
    parser.add_argument("--table", nargs="+", type=Path, metavar="JSON",
                        help="print the given matrices side by side and exit")
    args = parser.parse_args(argv)
    if args.table:
        print(table(args.table))
        return 0
    ref = upstream_snapshots.ref_for_installed()
    tree = upstream_snapshots.training_tree(ref)
    release = version("megatron-core")
    out = (args.out / release).resolve()
    modes = [m.strip() for m in args.modes.split(",")]
    names = (args.cases if args.cases is not None
             else [*case_names(tree, "gpt3_mcore_reruns_*"), *RESUME_CASES])
    start = time.monotonic()
    results_path = out.parent / f"matrix-{release}.json"
    rows, unexpected = [], []
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
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
            if not result.passed:  # every case passes in every mode, fixed or upstream
                unexpected.append(f"{name} ({label}) failed")
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
                kept, why = scenario.kept(result)
                results[f"scenario:{scenario.name}/{'fixes' if fixes else 'upstream'}"] = {
                    **result.to_json(), "kept": kept, "why": why}
                row.append(f"**{'kept' if kept else 'LOST'}**: {why}")
                if kept != (fixes or not scenario.upstream_fails()):
                    unexpected.append(f"{scenario.name} ({'fixes' if fixes else 'upstream'}): "
                                      f"{'kept' if kept else 'lost'}, not as expected")
            expected = "loses it" if scenario.upstream_fails() else "keeps it"
            lines.append(f"| {scenario.name}: {scenario.case} {flags} | {row[0]} | {row[1]} "
                         f"| {expected} |")
    lines += ["", f"{time.monotonic() - start:.0f} s in all; "
              + ("every outcome as expected." if not unexpected
                 else "UNEXPECTED: " + "; ".join(unexpected))]
    out.mkdir(parents=True, exist_ok=True)
    (out.parent / f"matrix-{release}.md").write_text("\n".join(lines) + "\n")
    results_path.write_text(json.dumps(results, indent=1))
    print("\n".join(lines), flush=True)
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
