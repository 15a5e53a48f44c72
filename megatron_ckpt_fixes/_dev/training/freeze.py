"""Gradual unfreezing: the embedding trains only after a given iteration.

Fine-tuning often keeps the embedding frozen for the first iterations. A frozen parameter
gets no gradient, so Adam keeps no state for it; when it unfreezes its state appears in the
optimizer's sharded state dict: the checkpoint structure changes in the middle of a run
(``optimizer.state.exp_avg.embedding...`` keys are added), which is exactly what a cached
save plan (``--ckpt-assume-constant-structure``) must not miss.

megatron-core checkpoints one Adam step for all parameters (``common_step``) and refuses
per-parameter steps, so an unfrozen parameter joins at the common step with zero moments:
how megatron-core's own ``init_state_fn`` initializes a parameter whose state a checkpoint
lacks. A checkpoint taken at an iteration up to ``until`` (the embedding still frozen) has no
state for it: its load template leaves that state out. One taken later has it, and a
checkpoint that lacks it then cannot load (that is a save that lost it, not a freeze).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.optimizer import MegatronOptimizer

#: Parameters whose names start with this are "the embedding" (word and position embeddings).
EMBEDDING_PREFIX = "embedding."


def _inner_optimizers(optimizer: MegatronOptimizer) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _prune(node: dict, drop: Any) -> bool:
    """Remove sharded tensors ``drop`` selects, and the dicts that only held them."""
    pruned = False
    for key, value in list(node.items()):
        if isinstance(value, ShardedTensor) and drop(value):
            del node[key]
            pruned = True
        elif isinstance(value, dict) and _prune(value, drop):
            pruned = True
            if not value:
                del node[key]
    return pruned


@dataclass
class EmbeddingFreeze:
    """The embedding is frozen in steps ``1..until`` and trains from step ``until + 1`` on."""

    until: int
    params: dict[str, torch.nn.Parameter]

    @classmethod
    def of(cls, model: torch.nn.Module, until: int) -> "EmbeddingFreeze":
        params = {n: p for n, p in model.named_parameters() if n.startswith(EMBEDDING_PREFIX)}
        if not params:
            raise ValueError(f"the model has no parameter named {EMBEDDING_PREFIX}*")
        return cls(until, params)

    def before_step(self, step: int, optimizer: MegatronOptimizer) -> None:
        """Freeze or unfreeze for ``step`` (1-based); on unfreezing, join the common step."""
        frozen = step <= self.until
        for param in self.params.values():
            param.requires_grad_(not frozen)
        if not frozen:
            self._join_common_step(optimizer)

    def _join_common_step(self, optimizer: MegatronOptimizer) -> None:
        mine = {id(p) for p in self.params.values()}
        for inner in _inner_optimizers(optimizer):
            torch_opt = inner.optimizer
            held = [p for g in torch_opt.param_groups for p in g["params"]]
            missing = [p for p in held if id(p) in mine and not torch_opt.state[p]]
            steps = [s["step"] for s in torch_opt.state.values() if "step" in s]
            if not missing or not steps:
                continue  # nothing to join, or no step taken yet: Adam starts everyone at 0
            for param in missing:  # as megatron-core's init_state_fn, at the common step
                torch_opt.state[param].update(exp_avg=torch.zeros_like(param.data),
                                              exp_avg_sq=torch.zeros_like(param.data),
                                              step=steps[0].clone())

    def prune_load_template(self, optimizer_template: dict, iteration: int) -> None:
        """Leave the embedding's optimizer state out of the template of a checkpoint taken at
        ``iteration``, if the embedding was frozen in every step before it."""
        if iteration > self.until:
            return
        suffixes = tuple(f".{name}" for name in self.params)
        _prune(optimizer_template, lambda t: t.key.endswith(suffixes))
