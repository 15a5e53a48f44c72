"""The structure signature changes exactly when the save plan would."""

from __future__ import annotations

import pytest
import torch
from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

from megatron_ckpt_fixes.fixes.structure import compute_signature


def _sd(**over):
    spec = dict(key="w", dtype=torch.float32, local=(4, 4), glob=(8, 4), off=(0, 0), frag=(2, 1),
                replica=0, values=0.0)
    spec.update(over)
    data = torch.full(spec["local"], spec["values"], dtype=spec["dtype"])
    return {
        "w": ShardedTensor(spec["key"], data, spec["dtype"], spec["local"], spec["glob"],
                           spec["off"], spec["frag"], replica_id=spec["replica"]),
        "nested": {"obj": ShardedObject("obj", {"a": 1}, (2,), (0,))},
    }


def test_values_do_not_matter():
    assert compute_signature(_sd(values=0.0)).digest == compute_signature(_sd(values=7.0)).digest


def test_dict_order_does_not_matter():
    sd = _sd()
    reordered = {"nested": sd["nested"], "w": sd["w"]}
    assert compute_signature(sd).digest == compute_signature(reordered).digest


@pytest.mark.parametrize("change", [
    dict(dtype=torch.bfloat16),
    dict(local=(2, 4), frag=(4, 1)),
    dict(glob=(12, 4), frag=(3, 1)),
    dict(off=(4, 0)),
    dict(replica=1),
    dict(key="w2"),
])
def test_every_plan_field_changes_the_digest(change):
    before, after = compute_signature(_sd()), compute_signature(_sd(**change))
    assert before.digest != after.digest
    assert before.diff(after)


def test_diff_names_the_keys():
    before = compute_signature(_sd())
    sd = _sd(dtype=torch.float64)
    sd["extra"] = ShardedObject("rerun_state_machine_state", {}, (2,), (1,))
    del sd["nested"]
    diff = before.diff(compute_signature(sd))
    assert diff.changed == ("w",)
    assert diff.added == ("rerun_state_machine_state/shard_1_2",)
    assert diff.removed == ("obj/shard_0_2",)
    assert "rerun_state_machine_state/shard_1_2" in diff.summary()


def test_object_replica_and_shard_count_matter():
    one = {"o": ShardedObject("o", 1, (2,), (0,))}
    other_replica = {"o": ShardedObject("o", 1, (2,), (0,), replica_id=1)}
    assert compute_signature(one).digest != compute_signature(other_replica).digest
    t = torch.zeros(2)
    a = ShardedTensor.from_rank_offsets("t", t, (0, 0, 4))
    b = ShardedTensor.from_rank_offsets("t", t.clone(), (0, 1, 4))
    assert compute_signature({"x": [a]}).digest != compute_signature({"x": [a, b]}).digest


def test_validation_keys_are_split_across_ranks_stably():
    from megatron_ckpt_fixes.fixes.structure.integrity import key_owner

    keys = [f"layer{i}.weight" for i in range(1000)]
    owners = [key_owner(k, 4) for k in keys]
    assert owners == [key_owner(k, 4) for k in keys] and set(owners) == {0, 1, 2, 3}
    assert min(owners.count(r) for r in range(4)) > 150
