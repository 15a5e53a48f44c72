"""TorchEasyRec's ``restore_model`` with its managed-collision tables loaded by value.

TorchEasyRec (``tzrec``) saves with ``save_model``: ``model.state_dict()`` through DCP into
``<ckpt>/model``, ``optimizer.state_dict()`` into ``<ckpt>/optimizer`` (for a DMP model the
fused optimizer's per-row state, exact Adagrad's ``momentum1`` say, keyed
``state.<weight key>.<table>.<state>``) and the sharding plan into ``<ckpt>/plan`` (an input
of tzrec's planner at the next start; the load does not need it: the saved layout is read
from the chunks in ``model/.metadata``). ``restore_model`` loads both folders with its
``PartialLoadPlanner`` (keys missing from the checkpoint are skipped with a warning, a
parameter map renames keys). Its world-size fix (tzrec pull request 467): when the world
size counted from the ``__<rank>_*.distcp`` file names does not divide into the current one,
``_needs_mch_redistribution`` says so, the MC buffers load by position and
``_redistribute_mch_state`` sends each entry to the rank that holds its *slot*
(``remapped // local zch_size``), while TorchRec routes a lookup to the rank that serves the
id's *value*. Measured on a real DMP-sharded ``ManagedCollisionEmbeddingCollection``: a
third to a half of the learned ids become unreachable (1->2, 2->3, 2->4), learned ids take a
rank's miss slot so that most unknown ids read a learned row, and with uneven per-rank sizes
2->3 stops with ``received 21 > local zch_size 20``.

With this feature ``restore_model`` does everything it did, except for the state of the
model's DMP-sharded managed-collision collections: their MC buffers, their tables' embedding
rows and the optimizer's per-row state of those rows. Before upstream's loads run, that
state is loaded by :func:`~megatron_ckpt_fixes.integrations.torchrec.load` (every entry, with its rows, moves to the rank
that serves its id) from a view of ``model/`` and ``optimizer/`` (:mod:`megatron_ckpt_fixes.reshard.view`), each key
read from the checkpoint key tzrec's own ``PartialLoadPlanner`` maps it to (parameter map
and renames included). Upstream's own loads then run as before, with those tensors left out
of its planner, and its slot redistribution is not asked for. What it does not find in the
checkpoint it skips as before (warnings, ``error_on_missing_keys``).

The feature applies where tzrec is installed (``megatron_ckpt_fixes.SYSTEMS``), right
after its first import. Whether the installed tzrec already routes by value is probed from
its behaviour (:func:`upstream_routes_by_value`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import json
import logging
import os
import tempfile
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from megatron_ckpt_fixes.core import agreement
from megatron_ckpt_fixes.core.patching import Patch
from megatron_ckpt_fixes.reshard.errors import ReshardError
from megatron_ckpt_fixes.reshard.view import Part, read_metadata, write_view

logger = logging.getLogger(__name__)

_CU = "tzrec.utils.checkpoint_util"
_DEFAULT_PLANNER = "torch.distributed.checkpoint.default_planner:DefaultLoadPlanner"
#: What ``restore_model``'s wrapper reads from its arguments.
_ARGUMENTS = ("checkpoint_dir", "model", "optimizer", "ckpt_param_map_path")

Memory = tuple[int, int, torch.dtype]


@dataclass
class _Loaded:
    """The tensors one ``restore_model`` call loaded by value (by memory), and those of them
    that upstream's planners have since left out."""

    memory: frozenset[Memory]
    left_out: set[Memory] = field(default_factory=set)


#: Set while a ``restore_model`` call that loaded managed-collision state by value runs.
_LOADED: ContextVar[_Loaded | None] = ContextVar("megatron_ckpt_fixes_tzrec_loaded", default=None)


def _memory(value: Any) -> Memory | None:
    """The memory of a tensor, or of a ``ShardedTensor``'s one local shard (None: empty)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if isinstance(value, ShardedTensor):
        shards = value.local_shards()
        value = shards[0].tensor if len(shards) == 1 else None
    if isinstance(value, torch.Tensor) and value.numel():
        return value.data_ptr(), value.numel(), value.dtype
    return None


def _saved_keys(cu: Any, state: dict[str, Any], path: str, param_map: str | None) -> tuple[Any, dict[str, str]]:
    """The checkpoint at ``path``'s metadata, and the saved key tzrec's own planner reads each
    flattened key of ``state`` from (keys it would skip are absent)."""
    metadata = read_metadata(path)
    planner = cu.PartialLoadPlanner(ckpt_param_map_path=param_map, warn_on_missing_keys=False)
    planner.set_up_planner(state, metadata)
    return metadata, {i.dest_index.fqn: i.storage_index.fqn for i in planner.create_local_plan().items}


@dataclass(frozen=True)
class _Plan:
    """What one rank loads by value: the state for :func:`~megatron_ckpt_fixes.integrations.torchrec.load` (``{"model":
    {key: tensor}, "optimizer": {flattened key: tensor}}``, the live tensors) and the parts of
    the view it reads them from."""

    state: dict[str, dict[str, Any]]
    parts: dict[str, Part]

    def summary(self) -> list[tuple[str, list[str]]]:
        return [(prefix, sorted(part.keys)) for prefix, part in self.parts.items()]

    def memory(self) -> frozenset[Memory]:
        return frozenset(m for part in self.state.values() for m in map(_memory, part.values()) if m)


def _collections(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The DMP-sharded managed-collision collections of ``model``."""
    from torchrec.distributed.mc_embedding_modules import BaseShardedManagedCollisionEmbeddingCollection

    return [m for m in model.modules() if isinstance(m, BaseShardedManagedCollisionEmbeddingCollection)]


def _plan(checkpoint_dir: str, model: torch.nn.Module, collections: list[torch.nn.Module], optimizer: Any,
          param_map: str | None) -> _Plan | None:
    """Rank-local: the state of ``collections`` that the checkpoint holds, as tzrec's restore
    would read it; None when there is nothing to load by value (then upstream's restore runs
    unchanged)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    model_dir, optim_dir = os.path.join(checkpoint_dir, "model"), os.path.join(checkpoint_dir, "optimizer")
    if not os.path.exists(model_dir):
        return None  # upstream's restore raises its own error
    meta = {}
    if os.path.exists(os.path.join(checkpoint_dir, "meta")):
        with open(os.path.join(checkpoint_dir, "meta")) as f:
            meta = json.load(f)
    if not meta.get("load_model", True):
        return None
    cu = importlib.import_module(_CU)
    ours = {m for c in collections for m in map(_memory, c.state_dict().values()) if m is not None}
    model_state = {k: v for k, v in model.state_dict().items() if _memory(v) in ours}
    model_md, model_keys = _saved_keys(cu, model_state, model_dir, param_map)
    if not model_keys:
        return None  # no managed-collision state in the checkpoint: upstream skips it, warning
    missing = sorted(set(model_state) - set(model_keys))
    if missing:
        raise ReshardError(f"checkpoint {model_dir} holds only part of the managed-collision state; "
                           f"missing: {missing}")
    plan = _Plan({"model": model_state}, {"model": Part(model_dir, model_md, model_keys)})
    if optimizer is not None and meta.get("load_optim", True) and os.path.exists(optim_dir):
        # A keyed optimizer (TorchRec's, tzrec's) keys its state by the key of each parameter in
        # ``params``: those of these tables' weights are found by memory, whatever their names.
        weights = {_memory(v) for v in model_state.values()}
        keys = [k for k, p in getattr(optimizer, "params", {}).items() if _memory(p) in weights]
        saved = optimizer.state_dict().get("state", {})
        optim_state, _ = flatten_state_dict({"state": {k: saved[k] for k in keys if k in saved}})
        optim_md, optim_keys = _saved_keys(cu, optim_state, optim_dir, param_map)
        if optim_keys:  # states absent from the checkpoint: upstream skips them, warning
            plan.parts["optimizer"] = Part(optim_dir, optim_md, optim_keys)
            plan.state["optimizer"] = {k: optim_state[k] for k in optim_keys}
    return plan


def _load_by_value(checkpoint_dir: str, model: torch.nn.Module, optimizer: Any,
                   param_map: str | None, view_dir: str) -> _Loaded | None:
    """Load the managed-collision state of ``model`` by value; collective where the model has
    DMP-sharded managed-collision collections (a sharded model's restore is). None: nothing
    was loaded (every rank agrees)."""
    from megatron_ckpt_fixes.integrations.torchrec import load

    collections = _collections(model)
    if not collections:
        return None  # no collective: tzrec also restores unsharded models on one rank (export)
    plan, error = None, None
    try:
        plan = _plan(checkpoint_dir, model, collections, optimizer, param_map)
        if plan is not None:
            write_view(view_dir, plan.parts)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - raised on every rank by agreement.same
        error = agreement.describe_error(exc)
    agreement.same(plan.summary() if plan else None,
                   f"the managed-collision state of {checkpoint_dir} to load by value",
                   raise_as=lambda what, reports: ReshardError(agreement.describe_failures(what, reports)),
                   error=error)
    if plan is None:
        return None
    load(plan.state, view_dir, model)
    return _Loaded(plan.memory())


def restore_by_value(original: Callable[..., Any]) -> Callable[..., Any]:
    """``restore_model`` that loads the managed-collision state by value first, then runs
    upstream's restore with that state left out of its loads."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def restore_model(*args: Any, **kwargs: Any) -> Any:
        given = signature.bind(*args, **kwargs).arguments
        with tempfile.TemporaryDirectory(prefix="mcf-tzrec-view-") as view_dir:
            loaded = _load_by_value(given["checkpoint_dir"], given["model"], given.get("optimizer"),
                                    given.get("ckpt_param_map_path"), view_dir)
        if loaded is None:
            return original(*args, **kwargs)
        token = _LOADED.set(loaded)
        try:
            result = original(*args, **kwargs)
        finally:
            _LOADED.reset(token)
        if loaded.left_out != loaded.memory:
            raise ReshardError(f"restore_model of {given['checkpoint_dir']} loaded "
                               f"{len(loaded.memory - loaded.left_out)} managed-collision tensors "
                               "without PartialLoadPlanner after they were loaded by value; this "
                               "tzrec restores in a way this fix was not written for")
        return result

    return restore_model


def leaves_loaded_out(original: Callable[..., Any]) -> Callable[..., Any]:
    """``PartialLoadPlanner.set_up_planner`` that, during a restore that loaded
    managed-collision state by value, leaves those tensors out (found by memory)."""

    @functools.wraps(original)
    def set_up_planner(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        loaded = _LOADED.get()
        if loaded is None:
            return
        kept = {}
        for key, value in self.state_dict.items():
            memory = _memory(value)
            if memory in loaded.memory:
                loaded.left_out.add(memory)
            else:
                kept[key] = value
        self.state_dict = kept

    return set_up_planner


def no_slot_redistribution(original: Callable[..., Any]) -> Callable[..., Any]:
    """``_needs_mch_redistribution``: no, during a restore that loaded the managed-collision
    state by value (upstream's answer otherwise)."""

    @functools.wraps(original)
    def _needs_mch_redistribution(*args: Any, **kwargs: Any) -> bool:
        return False if _LOADED.get() is not None else original(*args, **kwargs)

    return _needs_mch_redistribution


class _Observed(Exception):
    """The probe has seen what upstream would send."""


@dataclass
class _RankOfTwo:
    """Stands in for ``torch.distributed`` inside tzrec's checkpoint module during the probe:
    this process is rank 1 of 2, and the first all_to_all records what it would send."""

    sent: list[int] | None = None

    def is_initialized(self) -> bool:
        return True

    def get_rank(self, group: Any = None) -> int:
        return 1

    def get_world_size(self, group: Any = None) -> int:
        return 2

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        self.sent = [int(x) for x in input.tolist()]
        raise _Observed


@contextlib.contextmanager
def _module_attr(module: Any, name: str, value: Any) -> Iterator[None]:
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


def upstream_routes_by_value() -> str | None:
    """Whether tzrec's ``_redistribute_mch_state`` sends an entry to the rank that serves its
    id (then this feature is not needed), probed on a real ``MCHManagedCollisionModule``.

    The module is rank 1's of two ranks with 4 slots each over ids ``[0, 8)`` in 2 buckets:
    TorchRec routes ids 0-3 to rank 0. It holds id 1 at slot 4 and id 6 at slot 5. Routing by
    slot keeps both on rank 1 (sends ``[0, 2]``); routing by value sends id 1 to rank 0. No
    collective runs: during the call, the checkpoint module's ``torch.distributed`` is a
    stand-in that stops at the first all_to_all (the counts) with what it would send (as rank
    1, so upstream's rank-0 log line stays quiet). ``install()`` holds its lock meanwhile, but
    another thread inside tzrec's checkpoint module at that moment would see the stand-in:
    apply the feature before training starts (the first ``import tzrec`` does).
    """
    from torchrec.modules.mc_modules import DistanceLFU_EvictionPolicy, MCHManagedCollisionModule

    cu = importlib.import_module(_CU)
    holder = torch.nn.Module()
    holder.mc = MCHManagedCollisionModule(zch_size=4, device=torch.device("cpu"),
                                          eviction_policy=DistanceLFU_EvictionPolicy(), eviction_interval=1,
                                          input_hash_size=8, output_global_offset=4, buckets=2)
    holder.mc._mch_sorted_raw_ids[:2] = torch.tensor([1, 6])
    stand_in = _RankOfTwo()
    with _module_attr(cu, "dist", stand_in), contextlib.suppress(_Observed):
        cu._redistribute_mch_state(holder)
    if stand_in.sent is None:
        raise RuntimeError("tzrec's _redistribute_mch_state sent nothing for a rank holding an id "
                           "another rank serves")
    if stand_in.sent[0] > 0:
        return (f"tzrec's _redistribute_mch_state sends each managed-collision entry to the rank "
                f"that serves its id (probed as rank 1 of 2: sends {stand_in.sent})")
    return None


def _signatures() -> list[str]:
    """The arguments the wrappers read must still be there."""
    cu = importlib.import_module(_CU)
    problems = []
    restore = inspect.signature(cu.restore_model).parameters
    problems += [f"{_CU}:restore_model has no argument {a!r}" for a in _ARGUMENTS if a not in restore]
    planner = inspect.signature(cu.PartialLoadPlanner).parameters
    problems += [f"{_CU}:PartialLoadPlanner has no argument {a!r}"
                 for a in ("ckpt_param_map_path", "warn_on_missing_keys") if a not in planner]
    return problems


_READS = (f"{_CU}:PartialLoadPlanner", f"{_CU}:_redistribute_mch_state",
          "torchrec.distributed.mc_embedding_modules:BaseShardedManagedCollisionEmbeddingCollection")

PATCHES: tuple[Patch, ...] = (
    Patch(
        name="reshard.tzrec.restore_model",
        target=_CU,
        attr="restore_model",
        build=restore_by_value,
        reads=_READS,
        probes=(_signatures,),
        not_needed=upstream_routes_by_value,
        why="the state of DMP-sharded managed-collision tables (MC buffers, embedding and "
            "optimizer rows) is loaded by value from model/ and optimizer/ (every learned id on "
            "the rank that serves it, with its rows; the miss slot kept), the rest as before",
    ),
    Patch(
        name="reshard.tzrec.partial_load_planner",
        target=f"{_CU}:PartialLoadPlanner",
        attr="set_up_planner",
        build=leaves_loaded_out,
        inherits_from=(_DEFAULT_PLANNER,),
        not_needed=upstream_routes_by_value,
        why="restore_model's own loads leave out the managed-collision state loaded by value",
    ),
    Patch(
        name="reshard.tzrec.needs_mch_redistribution",
        target=_CU,
        attr="_needs_mch_redistribution",
        build=no_slot_redistribution,
        not_needed=upstream_routes_by_value,
        why="no slot-routed redistribution after the managed-collision state was loaded by value",
    ),
)
