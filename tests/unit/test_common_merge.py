"""Where the common state holds rank 0's per-rank lists, each rank merges its own lists there;
everything else merges as upstream's ``dict_utils.merge`` does, conflicts outside lists
included (the twin of each case runs upstream's own merge).

The dp_reshardable resume through megatron-core's distributed optimizer:
tests/functional/test_dp_reshardable.py.
"""

from __future__ import annotations

import copy

import pytest

from megatron_ckpt_fixes.fixes.common_merge import own_lists_win, reconcile, upstream_merges_own_lists

pytestmark = pytest.mark.varies_with("megatron-core")


def _merges():
    from megatron.core.dist_checkpointing.dict_utils import merge

    return merge, own_lists_win(merge)


def _bucket(*entries):
    """The shape of a dp_reshardable state: param_state / gbuf / dtype / bucket / entries."""
    return {"optimizer": {"param_state": {0: {"fp32": [list(entries)]}}}}


# rank 0's common state as a writer with a plain step leaves it: one entry per slice it held
SAVED = {"iteration": 8, **_bucket({"step": 2.0}, {"step": 2.0})}
SAVED["optimizer"]["param_state_sharding_type"] = "dp_reshardable"


def test_a_list_of_another_length_is_this_ranks():
    upstream, fixed = _merges()
    own = _bucket({"padding": False, "step": 1.0}, {"padding": True, "step": 1.0},
                  {"padding": False, "step": 1.0})
    with pytest.raises(ValueError, match="Cannot merge two lists with different lengths"):
        upstream(copy.deepcopy(SAVED), copy.deepcopy(own))
    merged = fixed(copy.deepcopy(SAVED), copy.deepcopy(own))
    # this rank's entries, and the common values beside the list kept
    assert merged["optimizer"]["param_state"] == own["optimizer"]["param_state"]
    assert merged["iteration"] == 8
    assert merged["optimizer"]["param_state_sharding_type"] == "dp_reshardable"


def test_a_list_of_the_same_length_with_rank_0s_values_is_this_ranks():
    """Rank 0 itself, or a rank holding as many slices: the values collide, position by
    position. The fork's fix (truncate, then merge by position) still collides here."""
    upstream, fixed = _merges()
    own = _bucket({"padding": False, "step": 1.0}, {"padding": False, "step": 1.0})
    with pytest.raises(ValueError, match="Duplicate non-dict and non-list values"):
        upstream(copy.deepcopy(SAVED), copy.deepcopy(own))
    merged = fixed(copy.deepcopy(SAVED), copy.deepcopy(own))
    assert merged["optimizer"]["param_state"] == own["optimizer"]["param_state"]


def test_only_the_list_that_differs_is_replaced():
    upstream, fixed = _merges()
    common = {"buckets": [[{"a": 0}], [{"b": 0}, {"b": 1}]], "kept": [{"x": 1}]}
    own = {"buckets": [[{"a2": 0}], [{"b": 5}]], "kept": [{"y": 2}]}
    merged = fixed(copy.deepcopy(common), copy.deepcopy(own))
    assert merged == {"buckets": [[{"a": 0, "a2": 0}], [{"b": 5}]], "kept": [{"x": 1, "y": 2}]}
    assert reconcile(copy.deepcopy(common), own) == [("buckets", 1)]


def test_a_conflict_outside_any_list_still_raises_upstreams_error():
    """The trivial wrong fix, catching the merge's ValueError and skipping the key, would
    load a checkpoint whose common value collides with this rank's silently."""
    upstream, fixed = _merges()
    for merge in (upstream, fixed):
        with pytest.raises(ValueError, match="Duplicate non-dict and non-list values"):
            merge({"iteration": 8, "opt": {"lr": 0.1}}, {"opt": {"lr": 0.2}})


@pytest.mark.parametrize("common, own", [([1, 2], [3]), ([1, 2], [3, 4])])
def test_lists_of_plain_values_too(common, own):
    upstream, fixed = _merges()
    with pytest.raises(ValueError):
        upstream({"l": list(common), "k": 1}, {"l": list(own)})
    assert fixed({"l": list(common), "k": 1}, {"l": list(own)}) == {"l": own, "k": 1}


def test_mergeable_states_merge_exactly_as_upstream():
    upstream, fixed = _merges()
    common = {"iteration": 8, "opt": [{"a": 1}, {"b": 2}], "empty": []}
    own = {"opt": [{"c": 3}, {"d": 4}], "new": [1, 2]}
    assert fixed(copy.deepcopy(common), copy.deepcopy(own)) == \
        upstream(copy.deepcopy(common), copy.deepcopy(own))


def test_the_release_is_asked():
    assert upstream_merges_own_lists() is None  # no release merges them yet
