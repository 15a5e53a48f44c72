"""A ShardedObject that a load does not read comes back as the template's object, never as
megatron-core's serialized stand-in for it.

megatron-core's torch_dist load turns every ShardedObject of the template into an
``io.BytesIO`` (``mcore_to_pyt_state_dict`` pickles the objects' ``data`` into it) only so that
DCP plans a read for the key; DCP's ``load_bytes`` then replaces that value with the list of
objects the checkpoint holds. A key DCP does not read keeps the stand-in. Upstream's planner
is strict, so such a load fails first ("Missing key in checkpoint state_dict"); a planner
that allows partial loads (``allow_partial_load=True``, as Megatron-LM forks set so that a
model loads a checkpoint written without some transformer-engine ``_extra_state``) skips it,
and ``_replace_sharded_keys_with_state_dict_keys`` takes ``len()`` of the stand-in:
``TypeError: object of type '_io.BytesIO' has no len()``.

Here the stand-ins of a load remember their objects, and a key that still holds its stand-in
after the load gets what DCP's partial load gives a tensor it does not read: the template's
own value (for an ``_extra_state``, the module's current state, BytesIO or tensor), logged by
key. Neither an empty placeholder nor the stand-in's bytes reach the model. Any other value
that is not the list of saved objects is an error naming the key.
"""

from __future__ import annotations

import functools
import inspect
import io
import logging
from typing import Any, Callable

from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.mapping import ShardedObject

from megatron_ckpt_fixes.core.patching import Patch
from megatron_ckpt_fixes.core.agreement import rank_and_size
from megatron_ckpt_fixes.core.errors import MegatronCkptFixesError

logger = logging.getLogger(__name__)

_TORCH = "megatron.core.dist_checkpointing.strategies.torch"
#: Attribute of a load's stand-in BytesIO: the ``data`` of the ShardedObjects it stands for.
_OBJECTS_ATTR = "_mcf_template_objects"


class ObjectNotLoadedError(MegatronCkptFixesError, CheckpointingException):
    """The load returned something for a ShardedObject that is neither what the checkpoint
    holds for it nor its template (a ``CheckpointingException`` like megatron's own)."""


def remember_templates(state_dict: dict[str, list[Any]], pyt_state_dict: dict[str, Any]) -> None:
    """Mark each ShardedObject's stand-in with the objects it stands for (load only)."""
    for key, items in state_dict.items():
        stand_in = pyt_state_dict.get(key)
        if items and isinstance(items[0], ShardedObject) and isinstance(stand_in, io.BytesIO):
            setattr(stand_in, _OBJECTS_ATTR, [item.data for item in items])


def templates_kept(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``mcore_to_pyt_state_dict``: on a load, stand-ins remember their objects. Not on a
    save: a stand-in there is written, and may be pickled to a writer process."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def mcore_to_pyt_state_dict(state_dict: Any, *args: Any, **kwargs: Any) -> Any:
        loading = signature.bind(state_dict, *args, **kwargs).arguments.get("is_loading", False)
        items = dict(state_dict) if loading else {}  # the lists, before any in-place change
        result = original(state_dict, *args, **kwargs)
        if loading:
            remember_templates(items, result)
        return result

    return mcore_to_pyt_state_dict


def loaded_objects(key: str, value: Any) -> tuple[list[Any], bool]:
    """The objects for ``key`` after the load and whether the checkpoint was not read for it
    (then they are the template's). Raises :class:`ObjectNotLoadedError` for anything else
    that is not a list."""
    if isinstance(value, list):
        return value, False
    objects = getattr(value, _OBJECTS_ATTR, None) if isinstance(value, io.BytesIO) else None
    if objects is None:
        raise ObjectNotLoadedError(
            f"cannot load {key!r} on rank {rank_and_size()[0]}: the load returned a "
            f"{type(value).__name__} for it, not the list of objects megatron-core saves")
    return objects, True


def unread_objects_kept(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``_replace_sharded_keys_with_state_dict_keys``: a key the load did not read gets
    its template's objects (see the module docstring)."""

    @functools.wraps(original)
    def _replace_sharded_keys_with_state_dict_keys(state_dict: dict[str, Any], *args: Any,
                                                   **kwargs: Any) -> Any:
        recovered, unread = {}, []
        for key, value in state_dict.items():
            recovered[key], kept = loaded_objects(key, value)
            if kept:
                unread.append(key)
        if unread:
            logger.warning("rank %d: %d object(s) not in the checkpoint keep the template's "
                           "value (partial load): %s", rank_and_size()[0], len(unread),
                           ", ".join(sorted(unread)))
        return original(recovered, *args, **kwargs)

    return _replace_sharded_keys_with_state_dict_keys


def _loading_parameter() -> list[str]:
    from megatron.core.dist_checkpointing.strategies import torch as strategies_torch

    params = inspect.signature(strategies_torch.mcore_to_pyt_state_dict).parameters
    return [] if "is_loading" in params else [
        f"{_TORCH}.mcore_to_pyt_state_dict has no parameter 'is_loading'"]


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="sharded_objects.templates",
        target=_TORCH,
        attr="mcore_to_pyt_state_dict",
        build=templates_kept,
        reads=("megatron.core.dist_checkpointing.mapping:ShardedObject",),
        probes=(_loading_parameter,),
        why="on a load, each ShardedObject's serialized stand-in remembers the objects it "
            "stands for",
    ),
    Patch(
        name="sharded_objects.unread",
        target=_TORCH,
        attr="_replace_sharded_keys_with_state_dict_keys",
        build=unread_objects_kept,
        reads=("megatron.core.dist_checkpointing.core:CheckpointingException",),
        why="a ShardedObject a partial load did not read (a transformer-engine _extra_state "
            "the checkpoint lacks) keeps its template's value (upstream: TypeError, "
            "object of type 'BytesIO' has no len())",
    ),
)
