"""Each rank resumes on its own RNG streams with expert parallelism (``megatron_lm.rng_state``).

Megatron-LM's own ``get_rng_state`` and ``_load_global_dist_base_checkpoint``, on 4 gloo ranks
with expert parallelism 2 (data-parallel size 4), the tracker seeded as Megatron-LM seeds it
(``tests/functional/rng_state_ranks.py``); one ``run_ranks`` call for every scenario:

- upstream (the twin): ``replica_id=dp_cp_rank`` makes ranks 1-3 replicas of rank 0, only
  rank 0's state is written and every rank loads it: 3 of 4 ranks resume on another rank's
  expert-parallel stream, silently;
- with the fixes every rank's tracker states after the load equal those it saved, exactly,
  and no rank declares itself a replica: each holds its own shard. The trivial wrong fix,
  ``replica_id=0`` on the same ``(pp, tp)`` object, fails the shard check (and megatron-core
  refuses the save on rank 0 alone: the other ranks wait in the save's collectives);
- a checkpoint saved by upstream still loads with the fixes, as upstream loads it (the wrong
  fix that changes only the save's layout fails here: the per-rank keys are not in it).

Runs where Megatron-LM's training package is installed (the megatron-core 0.19.2 wheel ships
it, main's build too); megatron-core 0.16.1's wheel has none, and its training package shards
the RNG state by data-parallel rank under expert parallelism itself (tests/unit/
test_megatron_lm_rng_rules.py).
"""

from __future__ import annotations

import importlib.util

import pytest

from megatron_ckpt_fixes._dev.testing import run_ranks

pytestmark = [
    pytest.mark.varies_with("megatron-core"),
    pytest.mark.skipif(importlib.util.find_spec("megatron.training") is None,
                       reason="megatron-core's wheel ships no megatron.training here (0.16.1)"),
]

WS = 4


@pytest.fixture(scope="module")
def outcome() -> list[dict]:
    from rng_state_ranks import scenarios

    return [r.value for r in run_ranks(scenarios, WS, timeout_s=300)]


def test_every_rank_holds_its_own_state(outcome):
    assert [o["distinct"] for o in outcome] == [WS] * WS


def test_upstream_resumes_most_ranks_on_rank_0s_streams(outcome):
    """The twin: fails once upstream saves every rank's state itself."""
    assert [o["upstream"] for o in outcome] == [[0]] * WS, outcome
    assert [o["upstream.object"][2] for o in outcome] == list(range(WS))  # replica id = dp rank


def test_each_rank_resumes_on_its_own_streams_with_the_fixes(outcome):
    assert [o["fixed"] for o in outcome] == [[rank] for rank in range(WS)], outcome
    assert [o["fixed.object"] for o in outcome] == [
        ((1, 1, WS), (0, 0, rank), 0) for rank in range(WS)]


def test_a_checkpoint_saved_by_upstream_still_loads_as_upstream_loads_it(outcome):
    assert [o["fixed_loads_upstream"] for o in outcome] == [[0]] * WS, outcome
