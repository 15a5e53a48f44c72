"""``megatron_lm.rng_state`` without ranks: which of upstream's RNG objects it changes, and how
a per-rank template meets each layout a checkpoint can hold (the 4-rank twin through
Megatron-LM's own functions: tests/functional/test_megatron_lm_rng_state.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedObject

from megatron_ckpt_fixes.integrations.megatron_lm.rng_state import (
    Layout,
    _per_rank_get_rng_state,
    adapted,
    folded,
    folds_data_parallel,
    per_rank,
    saved_layout,
)

pytestmark = pytest.mark.varies_with()

STATE = [{"rng_tracker_states": {}}]


def _object(shape: tuple, offset: tuple, replica_id: int) -> ShardedObject:
    return ShardedObject("rng_state", STATE, shape, offset, replica_id=replica_id)


def test_the_folded_object_of_0_17_to_main_is_changed_on_every_rank():
    """core_v0.17.0 .. main: ``(pp, tp)``, replica id = the data-parallel rank."""
    assert all(folds_data_parallel(_object((1, 1), (0, 0), dp), dp) for dp in range(4))


def test_objects_that_shard_by_data_parallel_rank_are_left_alone():
    """core_v0.16.1 under expert parallelism (and the fixed layout): ``(pp, tp, dp)``,
    replica id 0; the ``fsdp_dtensor`` dict is no ShardedObject."""
    assert not any(folds_data_parallel(_object((1, 1, 4), (0, 0, dp), 0), dp) for dp in range(4))
    assert not folds_data_parallel({"(0, 0)": STATE}, 0)


def test_per_rank_claims_no_replica_and_folds_back():
    template = per_rank(_object((2, 1), (1, 0), 3), 3, 4)
    assert (template.global_shape, template.global_offset, template.replica_id) == (
        (2, 1, 4), (1, 0, 3), 0)
    assert folded(template) == _object((2, 1), (1, 0), 3)


@pytest.mark.parametrize("saved, layout", [
    ({(2, 1, 4)}, Layout.SAME),
    ({(2, 1)}, Layout.FOLDED),
    ({(2, 1, 2)}, Layout.OTHER_DP),
    ({(2, 1, 8)}, Layout.OTHER_DP),
    ({(4, 1, 4)}, Layout.ABSENT),  # another pipeline size: upstream does not load RNG then
    (set(), Layout.ABSENT),
])
def test_the_saved_layout_decides_what_the_load_asks_for(saved, layout):
    template = per_rank(_object((2, 1), (1, 0), 3), 3, 4)
    assert saved_layout(template, saved) is layout
    asked = adapted(template, layout)
    if layout is Layout.FOLDED:
        assert asked == folded(template)
    elif layout is Layout.OTHER_DP:  # every rank keeps its fresh state
        assert isinstance(asked, LocalNonpersistentObject) and asked.unwrap() is STATE
    else:
        assert asked is template


def _upstream(returned):
    """A stand-in of upstream's ``get_rng_state`` (0.19's signature) returning ``returned``."""

    def get_rng_state(ckpt_format, tp_group, pp_group, dp_cp_group=None, dp_group=None,
                      key_prefix=""):
        return returned

    return get_rng_state


def test_the_patched_get_rng_state_shards_by_the_group_it_is_given():
    group = SimpleNamespace(rank=lambda: 2, size=lambda: 4)
    patched = _per_rank_get_rng_state(_upstream(_object((1, 1), (0, 0), 2)))
    got = patched("torch_dist", None, None, dp_cp_group=group)
    assert (got.global_shape, got.global_offset, got.replica_id) == ((1, 1, 4), (0, 0, 2), 0)


def test_the_patched_get_rng_state_passes_other_formats_through_untouched():
    """No data-parallel group is asked for (none may exist for these formats)."""
    for returned in ({"(0, 0)": STATE}, STATE):
        assert _per_rank_get_rng_state(_upstream(returned))("fsdp_dtensor", None, None) \
            is returned
