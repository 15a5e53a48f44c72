"""A deterministic synthetic token stream whose position is all the state it has.

Batch ``i`` is a pure function of ``(seed, i)``; each data-parallel rank takes its slice of
the global batch. Resuming at a position therefore replays exactly the batches an
uninterrupted run would have seen, and the checkpoint only has to store that position
(Megatron's ``consumed_train_samples``, here counted in global batches).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SyntheticTokens:
    """Iterator of ``{"tokens", "labels"}`` micro-batches of shape ``[local_batch, seq]``."""

    seed: int
    vocab_size: int
    seq_length: int
    global_batch_size: int
    dp_rank: int
    dp_size: int
    position: int = 0

    def __post_init__(self) -> None:
        if self.global_batch_size % self.dp_size:
            raise ValueError(f"global batch {self.global_batch_size} is not divisible by the "
                             f"data-parallel size {self.dp_size}")

    def __iter__(self) -> "SyntheticTokens":
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        batch = self.batch(self.position)
        self.position += 1
        return batch

    def batch(self, index: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        tokens = torch.randint(0, self.vocab_size, (self.global_batch_size, self.seq_length + 1),
                               generator=generator)
        local = self.global_batch_size // self.dp_size
        mine = tokens[self.dp_rank * local:(self.dp_rank + 1) * local]
        return {"tokens": mine[:, :-1].contiguous(), "labels": mine[:, 1:].contiguous()}
