"""Cached-plan saves (``--ckpt-assume-constant-structure``) after every kind of structure change.

Each scenario warms megatron-core's plan cache with three saves, changes the structure (on
all ranks, or on one rank only), saves again and loads: with ``install()`` every value,
dtype and shape loads back exactly and the checkpoint's metadata is right. The upstream twin
(``install(["compat.cpu"])``: plain megatron-core made runnable on gloo) shows each failure as
upstream has it today; if upstream fixes one, its twin fails and the fix can go.

The scenarios run batched in as few process groups as possible (each spawn imports
megatron-core on every rank, which dominates the run time).
"""

from __future__ import annotations

import pytest
from structure_scenarios import CHANGES, Outcome, scenarios_worker

from megatron_ckpt_fixes._dev.testing import run_ranks

WS = 2
UPSTREAM = ["compat.cpu"]

PATCHED_RUNS = [(change, "plain", False) for change in CHANGES] + [
    ("swap_slices", "fully_parallel", False),
    ("add_tensor_all", "fully_parallel", False),
    ("add_object_all", "plain", True),
    ("swap_slices", "plain", True),
]

#: How upstream fails for each scenario: at load, with wrong values, with wrong metadata, or
#: at save. Save failures leave ranks out of step, so those run in their own process group.
UPSTREAM_FAILS_AT: dict[tuple[str, str, bool], str] = {
    ("add_object_all", "plain", False): "load",
    ("add_object_one_rank", "plain", False): "load",
    ("add_tensor_all", "plain", False): "load",
    ("add_tensor_one_rank", "plain", False): "load",
    ("shape_all", "plain", False): "load",
    ("shape_one_rank", "plain", False): "load",
    ("swap_slices", "plain", False): "values",
    ("dtype_all", "plain", False): "metadata",
    ("dtype_one_rank", "plain", False): "metadata",
    ("add_object_all", "plain", True): "load",
    ("swap_slices", "plain", True): "values",
    ("remove_all", "plain", False): "save",
    ("remove_one_rank", "plain", False): "save",
    ("swap_slices", "fully_parallel", False): "save",
}
_IN_STEP = [run for run, stage in UPSTREAM_FAILS_AT.items() if stage != "save"]

#: change -> {failing rank: the start of its load error's cause}, as upstream raises it today
#: (0.16 gathers every rank's failure to every rank; 0.19 plans rank-locally, so only the
#: failing rank raises, with its own cause).
UPSTREAM_LOAD_CAUSES: dict[str, dict[int, str]] = {
    "add_object_all": {r: "RuntimeError: Missing key in checkpoint state_dict: "
                          f"rerun_state_machine_state/shard_{r}_2." for r in range(WS)},
    "add_object_one_rank": {1: "RuntimeError: Missing key in checkpoint state_dict: "
                               "late_obj/shard_0_1."},
    "add_tensor_all": {r: 'KeyError: "new from model not in state dict: [' for r in range(WS)},
    "add_tensor_one_rank": {1: 'KeyError: "new_solo from model not in state dict: ['},
    "shape_all": {r: "CheckpointingException: Global shape mismatch for loaded "
                     "(torch.Size([8, 4])) and expected ((8, 6)) tensor for key w"
                  for r in range(WS)},
    "shape_one_rank": {1: "CheckpointingException: Global shape mismatch for loaded "
                          "(torch.Size([2, 2])) and expected ((3, 2)) tensor for key solo"},
}
UPSTREAM_WRONG_VALUES = ["w: dtype torch.float32/torch.float32 max delta 16.0"]
UPSTREAM_WRONG_METADATA = {
    "dtype_all": ["w: .metadata says (8, 4) torch.float32, saved (8, 4) torch.float64"] * WS,
    "dtype_one_rank": ["solo: .metadata says (2, 2) torch.float32, saved (2, 2) torch.bfloat16"],
}
#: change -> (rank, the error its cached save raises upstream)
UPSTREAM_SAVE_ERRORS = {
    "remove_all": {0: "ValueError: Could not find FQN: 'b'"},
    "remove_one_rank": {1: "ValueError: Could not find FQN: 'solo'"},
    "swap_slices": {0: "ValueError: Could not find FQN: 'w'", 1: "ValueError: Could not find FQN: 'w'"},
}


def _name(run: tuple[str, str, bool]) -> str:
    change, strategy, resume = run
    return f"{change}-{strategy}-{'resume' if resume else 'fresh'}"


def _per_rank(results) -> list[dict[str, Outcome]]:
    return [r.value for r in results]


def _causes(error: str | None) -> set[str]:
    """The per-rank causes in one load error (see structure_scenarios._err)."""
    return {part.split(": ", 1)[1] for part in (error or "").split("; ") if ": " in part}


def expected_plan_reuse(run: tuple[str, str, bool]) -> list[bool]:
    """Whether each save leaves megatron-core's cached plan validated for reuse.

    Warm-up: the first save plans, the second validates the cache, from the third on no
    planning collective runs. A resume's first save (new strategy) plans again. A changed
    structure costs exactly one replan, then the cache is reused again. A fix that
    disables the cache (always replans) fails this.
    """
    change, _strategy, resume = run
    warm = [False, True, True] + ([False] if resume else [])
    after = [True, True, True] if change == "unchanged" else [False, True, True]
    return warm + after


@pytest.fixture(scope="module")
def patched() -> list[dict[str, Outcome]]:
    return _per_rank(run_ranks(scenarios_worker, WS, None, PATCHED_RUNS, timeout_s=400))


@pytest.fixture(scope="module")
def upstream_in_step() -> list[dict[str, Outcome]]:
    return _per_rank(run_ranks(scenarios_worker, WS, UPSTREAM, _IN_STEP, timeout_s=400))


@pytest.mark.parametrize("run", PATCHED_RUNS, ids=_name)
def test_patched_change_loads_exactly(patched, run):
    for rank, outcomes in enumerate(patched):
        outcome = outcomes[_name(run)]
        assert outcome.exact, f"rank {rank}: {outcome}"


@pytest.mark.parametrize("run", PATCHED_RUNS, ids=_name)
def test_patched_saves_keep_the_cached_fast_path(patched, run):
    for rank, outcomes in enumerate(patched):
        assert outcomes[_name(run)].plan_reuse == expected_plan_reuse(run), f"rank {rank}"


@pytest.mark.parametrize("run", _IN_STEP, ids=_name)
def test_upstream_still_fails(upstream_in_step, run):
    outcomes = [per_rank[_name(run)] for per_rank in upstream_in_step]
    change = run[0]
    stage = UPSTREAM_FAILS_AT[run]
    # Upstream reuses its stale cache on every save after the change: that is the bug.
    assert all(o.plan_reuse[-3:] == [True, True, True] for o in outcomes), outcomes
    if stage == "load":
        assert all(o.save_error is None for o in outcomes), outcomes
        expected = UPSTREAM_LOAD_CAUSES[change]
        for rank, cause in expected.items():
            assert any(c.startswith(cause) for c in _causes(outcomes[rank].load_error)), \
                (rank, outcomes[rank].load_error)
        seen = set().union(*(_causes(o.load_error) for o in outcomes))
        assert all(any(c.startswith(e) for e in expected.values()) for c in seen), seen
    elif stage == "values":
        assert all(o.load_error is None and o.wrong_values == UPSTREAM_WRONG_VALUES
                   for o in outcomes), outcomes
    else:
        assert outcomes[0].wrong_metadata == UPSTREAM_WRONG_METADATA[change], outcomes[0]
        assert all(o.load_error is None and not o.wrong_values for o in outcomes), outcomes


#: What a rank that upstream leaves behind ends with: the peer's crash (gloo reads an orderly
#: close or, when the peer's process ended with bytes unread on its socket, a reset), or a hang.
PEER_LEFT_BEHIND = ("Connection closed by peer", "Connection reset by peer", "timed out",
                    "Timed out")


@pytest.mark.parametrize("run", [r for r, s in UPSTREAM_FAILS_AT.items() if s == "save"], ids=_name)
def test_upstream_still_fails_at_save(run):
    """A removed key (or a fully-parallel re-distribution) breaks upstream's cached save on
    the rank that held the key; the other rank is left to crash on the closed connection or
    to hang."""
    from structure_scenarios import scenario_worker

    change, strategy, resume = run
    results = run_ranks(scenario_worker, WS, UPSTREAM, change, strategy, resume, check=False,
                        timeout_s=120, collective_timeout_s=20)
    errors = [None if r is None else r.value.save_error if r.ok else f"{r.error_type}: {r.error}"
              for r in results]
    expected = UPSTREAM_SAVE_ERRORS[change]
    for rank, error in enumerate(errors):
        if rank in expected:
            assert error == expected[rank], errors
        else:
            assert error is None or any(p in error for p in PEER_LEFT_BEHIND), errors


def test_a_save_that_failed_on_one_rank_makes_every_rank_replan():
    """After a save failed on one rank only, nothing that rank cached can be trusted; the
    next save replans on every rank together (agreed), never on that rank alone (the other
    ranks would take the fast path, which has no planning collective: a hang)."""
    from structure_scenarios import failed_save_worker

    results = run_ranks(failed_save_worker, WS, None, timeout_s=180, collective_timeout_s=30)
    outcomes = [r.value["outcome"] for r in results]
    assert [r.value["failed"] for r in results] == [False, True]
    for rank, outcome in enumerate(outcomes):
        # warm-up; the failed save; the agreed replan; the cache validated again
        assert outcome.plan_reuse == [False, True, True, True, False, True], (rank, outcome)
        assert outcome.wrong_values == [], (rank, outcome)
