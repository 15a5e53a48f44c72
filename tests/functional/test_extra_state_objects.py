"""Transformer-engine ``_extra_state`` through megatron-core's own ShardedObject handling.

Every TE module's ``sharded_state_dict`` goes through megatron-core's
``make_sharded_tensors_for_checkpoint``, which wraps ``_extra_state`` in a ShardedObject
(``make_sharded_object_for_checkpoint``): a ``BytesIO`` before TE 2.0, a uint8 tensor since.
Both forms save and load exactly on upstream. The reported ``TypeError: object of type
'BytesIO' has no len()`` (in ``_replace_sharded_keys_with_state_dict_keys``) needs a
Megatron-LM fork's load planner, which allows partial loads: a ShardedObject that the
checkpoint lacks is skipped by DCP and keeps megatron-core's serialized stand-in, which that
function takes ``len()`` of. Upstream's strict planner fails such a load naming the key.

Here: 2 gloo ranks (TP 1, DP 2), two layers whose ``linear_fc1._extra_state`` is saved in
the BytesIO form (layer 0) and the tensor form (layer 1); the load template also asks for
``linear_fc2._extra_state``, which the checkpoint lacks (it was written without it: from
Hugging Face weights, or under ``--ckpt-drop-redundant-extra-state``). The fork's planner is
upstream's ``MCoreLoadPlanner`` with ``allow_partial_load=True`` (what the fork passes).
"""

from __future__ import annotations

import io
import os
import pickle

import pytest
import torch
import torch.distributed as dist

from megatron_ckpt_fixes._dev.testing import run_ranks, shared_temp_dir

pytestmark = pytest.mark.varies_with("megatron-core", "torch")

WS = 2
LAYERS = 2
FC1, FC2 = "decoder.layers.mlp.linear_fc1", "decoder.layers.mlp.linear_fc2"


def fp8_state(step: int, layer: int) -> dict:
    """A delayed-scaling FP8 state as TE keeps it (plain lists: equal states, equal bytes)."""
    return {"recipe": "DelayedScaling", "scale_fwd": [1.0 + step + layer] * 3,
            "amax_history_fwd": [[0.5 * step + layer] * 3] * 4}


def extra_state(step: int, layer: int) -> io.BytesIO | torch.Tensor:
    """Layer 0: TE < 2.0's form (``torch.save`` into a BytesIO); layer 1: TE >= 2.0's (a
    uint8 tensor of the pickled state)."""
    if layer == 0:
        buffer = io.BytesIO()
        torch.save(fp8_state(step, layer), buffer)
        return buffer
    return torch.frombuffer(bytearray(pickle.dumps(fp8_state(step, layer))), dtype=torch.uint8)


def module_state(step: int, layer: int, with_fc2: bool) -> dict:
    """What TE modules' ``state_dict()`` hold: a weight and an ``_extra_state`` each (fc2's
    ``_extra_state`` only ``with_fc2``)."""
    state = {f"{FC1}.weight": torch.full((4, 4), float(10 * step + layer)),
             f"{FC1}._extra_state": extra_state(step, layer),
             f"{FC2}.weight": torch.full((4, 4), float(20 * step + layer))}
    if with_fc2:
        state[f"{FC2}._extra_state"] = extra_state(step + 7, layer)
    return state


def sharded(step: int, with_fc2: bool) -> dict:
    """The layers' sharded state dict, built by megatron-core's own helper."""
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    out = {}
    for layer in range(LAYERS):
        per_layer = make_sharded_tensors_for_checkpoint(
            module_state(step, layer, with_fc2), "", sharded_offsets=((0, layer, LAYERS),))
        out.update({f"{key}.{layer}": value for key, value in per_layer.items()})
    return out


def as_bytes(value) -> bytes | None:
    """An ``_extra_state`` as its bytes (either form); None for anything else."""
    if isinstance(value, io.BytesIO):
        return value.getvalue()
    if isinstance(value, torch.Tensor) and value.dtype == torch.uint8:
        return value.numpy().tobytes()
    return None


def compare(loaded: dict, expected: dict) -> dict[str, str]:
    """Each key whose loaded value differs from ``expected`` in form or value (tensors:
    max delta 0.0; extra states: the same form and the same bytes)."""
    wrong = {}
    for key, want in expected.items():
        got = loaded.get(key, "<missing>")
        if type(got) is not type(want):
            wrong[key] = f"{type(got).__name__} instead of {type(want).__name__}"
        elif key.split(".")[-2] == "_extra_state":
            if as_bytes(got) != as_bytes(want):
                wrong[key] = f"{len(as_bytes(got))} other bytes"
        elif float((got - want).abs().max()) != 0.0:
            wrong[key] = "other values"
    return wrong


def fork_planner() -> None:
    """The fork's load planner: upstream's ``MCoreLoadPlanner`` allowing partial loads."""
    from megatron.core.dist_checkpointing.strategies import torch as strategies_torch

    init = strategies_torch.MCoreLoadPlanner.__init__

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_partial_load", True)
        init(self, *args, **kwargs)

    strategies_torch.MCoreLoadPlanner.__init__ = __init__


def _load(ckpt: str, with_fc2: bool) -> dict:
    """One load into a fresh template (a model after a step of its own: step 5); the
    outcome, and which keys differ from the saved state (step 1) and from the template."""
    from megatron.core import dist_checkpointing as dc

    template = sharded(5, with_fc2)
    expected = {key: getattr(item, "data", item) for key, item in template.items()}
    try:
        loaded = dc.load(template, ckpt)
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException too
        return {"error": f"{type(exc).__name__}: {exc}",
                "classes": [c.__name__ for c in type(exc).__mro__]}
    saved = {key: getattr(item, "data", item) for key, item in sharded(1, False).items()}
    return {"not_saved": compare(loaded, saved),
            "not_template": compare(loaded, {k: v for k, v in expected.items()
                                             if f"{FC2}._extra_state" in k})}


def worker(rank: int, ws: int, features: list[str] | None) -> dict:
    import megatron_ckpt_fixes
    from megatron.core import dist_checkpointing as dc
    from megatron.core import parallel_state as ps

    megatron_ckpt_fixes.install(features)
    ps.initialize_model_parallel()
    out = {}
    with shared_temp_dir() as root:
        ckpt = os.path.join(root, "ckpt")
        if rank == 0:
            os.makedirs(ckpt)
        dist.barrier()
        dc.save(sharded(1, with_fc2=False), ckpt)
        out["strict_all_saved"] = _load(ckpt, with_fc2=False)
        out["strict_unsaved_fc2"] = _load(ckpt, with_fc2=True)
        fork_planner()
        out["partial_all_saved"] = _load(ckpt, with_fc2=False)
        out["partial_unsaved_fc2"] = _load(ckpt, with_fc2=True)
    ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def upstream() -> list[dict]:
    return [r.value for r in run_ranks(worker, WS, ["compat.cpu"], timeout_s=300)]


@pytest.fixture(scope="module")
def fixed() -> list[dict]:
    return [r.value for r in run_ranks(worker, WS, None, timeout_s=300)]


def _exact(outcome: dict) -> bool:
    return "error" not in outcome and not outcome["not_saved"]


def test_upstream_loads_both_forms_exactly_when_the_checkpoint_has_them(upstream):
    for rank, out in enumerate(upstream):
        assert _exact(out["strict_all_saved"]), (rank, out)
        assert _exact(out["partial_all_saved"]), (rank, out)


def test_upstream_fork_planner_fails_on_an_extra_state_the_checkpoint_lacks(upstream):
    """The report: the skipped object keeps its serialized stand-in; ``len()`` of it."""
    for rank, out in enumerate(upstream):
        error = out["partial_unsaved_fc2"].get("error", "")
        assert error.startswith("TypeError: object of type '_io.BytesIO' has no len()"), \
            (rank, out)


def test_upstream_strict_planner_names_the_missing_extra_state(upstream):
    for rank, out in enumerate(upstream):
        error = out["strict_unsaved_fc2"].get("error", "")
        assert f"Missing key in checkpoint state_dict: {FC2}._extra_state/shard_" in error, \
            (rank, out)


def test_partial_load_keeps_the_template_extra_state_and_loads_the_rest_exactly(fixed):
    """With ``install()``: everything saved loads exactly (both forms' bytes, weights max delta
    0.0); the ``_extra_state`` the checkpoint lacks is the template's own, BytesIO and tensor.

    Fails on the trivial wrong fixes: substituting an empty uint8 tensor for a bare BytesIO
    (the fork's own fix: a tensor where the model held a BytesIO, no bytes where it held
    its FP8 state), catching the TypeError and skipping the key (missing), handing the
    stand-in BytesIO on (the bytes of megatron-core's serialized list, not the state)."""
    for rank, out in enumerate(fixed):
        for name in ("strict_all_saved", "partial_all_saved"):
            assert _exact(out[name]), (rank, name, out[name])
        outcome = out["partial_unsaved_fc2"]
        assert "error" not in outcome, (rank, outcome)
        assert not outcome["not_saved"], (rank, outcome)
        assert not outcome["not_template"], (rank, outcome)


def test_strict_load_still_refuses_an_extra_state_the_checkpoint_lacks(fixed):
    """Keeping the template is what a partial load asked for; a strict load still fails, the
    same on every rank, naming the key."""
    for rank, out in enumerate(fixed):
        outcome = out["strict_unsaved_fc2"]
        assert f"Missing key in checkpoint state_dict: {FC2}._extra_state/shard_" in \
            outcome.get("error", ""), (rank, outcome)
        assert "CheckpointLoadError" in outcome["classes"], (rank, outcome)
