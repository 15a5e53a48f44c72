"""The ranks of test_megatron_lm_rng_state: Megatron-LM's ``get_rng_state`` and its load, on
4 gloo ranks with expert parallelism 2 (data-parallel size 4).

There is no CUDA generator on CPU, so the tensor-parallel RNG tracker's streams would all be
empty tensors; :func:`cpu_cuda_generator` gives the process one CPU generator in the CUDA
generator's place (test harness only), so the tracker holds real, distinct states.
"""

from __future__ import annotations

import sys
import typing
from typing import Any

import torch
import torch.distributed as dist

from megatron_ckpt_fixes._dev.testing import shared_temp_dir

SEED = 1234
EP = 2
EXPERT_STREAM = "expert-parallel-rng"


def cpu_cuda_generator() -> None:
    """``torch.cuda``'s RNG calls on one CPU generator of this process (the tracker's
    ``add``/``get_states``/``set_states``, ``get_rng_state``'s ``cuda_rng_state``)."""
    from megatron.core.tensor_parallel import random as tp_random

    generator = torch.Generator()
    torch.cuda.get_rng_state = lambda device="cuda": generator.get_state()
    torch.cuda.set_rng_state = lambda state, device="cuda": generator.set_state(state)
    torch.cuda.manual_seed = lambda seed: generator.manual_seed(seed)
    tp_random._set_cuda_rng_state = lambda state, *a, **k: generator.set_state(state)


def megatron_lm_args() -> Any:
    """Megatron-LM's own defaults (its argument parser), as the training package's global
    args (``get_rng_state`` and the load read them)."""
    if not hasattr(typing, "override"):  # Megatron-LM 0.19+ is Python 3.12 code
        from typing_extensions import override

        typing.override = override
    from megatron.training.arguments import parse_args
    from megatron.training.global_vars import set_args

    argv, sys.argv = sys.argv, ["pretrain_gpt.py"]
    try:
        args = parse_args(ignore_unknown_args=True)
    finally:
        sys.argv = argv
    set_args(args)
    return args


def seeded_streams(rank: int) -> dict[str, torch.Tensor]:
    """The tracker seeded as Megatron-LM seeds it (``model_parallel_cuda_manual_seed``: the
    expert-parallel stream per EP rank); then each rank draws ``rank + 1`` numbers from its
    expert stream, as the router's noise does, so that every rank's state is its own."""
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    states = tracker.get_states()
    stream = torch.Generator()
    stream.set_state(states[EXPERT_STREAM])
    torch.rand(rank + 1, generator=stream)
    tracker.set_states({**states, EXPERT_STREAM: stream.get_state()})
    return {k: v.clone() for k, v in tracker.get_states().items()}


def _rng_state(checkpointing: Any) -> Any:
    from megatron.core import parallel_state as mpu

    return checkpointing.get_rng_state("torch_dist", mpu.get_tensor_model_parallel_group(),
                                       mpu.get_pipeline_model_parallel_group())


def _save(checkpointing: Any, root: str) -> str:
    from megatron.core import dist_checkpointing

    path = checkpointing.get_checkpoint_name(root, 1, False, return_base_dir=True)
    if dist.get_rank() == 0:
        import os

        os.makedirs(path)
    dist.barrier()
    dist_checkpointing.save({"rng_state": _rng_state(checkpointing)}, path)
    return path


def _load(checkpointing: Any, args: Any, root: str) -> dict[str, torch.Tensor]:
    """The tracker states a resume restores: Megatron-LM's own load of the template its
    ``get_rng_state`` builds (``data_parallel_random_init`` off: the list's one entry)."""
    state_dict, *_ = checkpointing._load_global_dist_base_checkpoint(
        root, args, False, {"rng_state": _rng_state(checkpointing)}, 1, False)
    return state_dict["rng_state"][0]["rng_tracker_states"]


def _whose(loaded: dict[str, torch.Tensor], saved: list[dict[str, torch.Tensor]]) -> list[int]:
    """The ranks whose saved states equal ``loaded`` exactly."""
    return [r for r, s in enumerate(saved)
            if s.keys() == loaded.keys() and all(torch.equal(s[k], loaded[k]) for k in s)]


def scenarios(rank: int, ws: int) -> dict[str, Any]:
    """Save and load the RNG states as upstream, with the fixes, and an
    upstream checkpoint with the fixes; per scenario, whose saved states each rank got."""
    import megatron_ckpt_fixes
    from megatron.core import parallel_state as mpu

    cpu_cuda_generator()
    mpu.initialize_model_parallel(expert_model_parallel_size=EP)
    args = megatron_lm_args()
    from megatron.training import checkpointing

    saved = seeded_streams(rank)
    every = [None] * ws
    dist.all_gather_object(every, saved)
    out: dict[str, Any] = {"distinct": len({tuple(s[EXPERT_STREAM].tolist()) for s in every})}

    def round_trip(name: str, root: str, load_root: str | None = None) -> None:
        try:
            if load_root is None:
                _save(checkpointing, root)
                obj = _rng_state(checkpointing)
                out[f"{name}.object"] = (obj.global_shape, obj.global_offset, obj.replica_id)
            out[name] = _whose(_load(checkpointing, args, load_root or root), every)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            out[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"

    with shared_temp_dir() as tmp:
        megatron_ckpt_fixes.uninstall()
        megatron_ckpt_fixes.install(["compat.cpu"])
        round_trip("upstream", f"{tmp}/upstream")
        megatron_ckpt_fixes.uninstall()
        megatron_ckpt_fixes.install()
        round_trip("fixed", f"{tmp}/fixed")
        round_trip("fixed_loads_upstream", "", load_root=f"{tmp}/upstream")
        megatron_ckpt_fixes.uninstall()
    return out
