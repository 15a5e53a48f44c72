"""The replica check's pure parts: digests (equal iff equal values) and the verdict.

A digest that differed for equal values would refuse a good save; one that matched for
different values would pass a bad one. The verdict names exactly the ranks that differ from the
main replica (not from rank 0, not only rank 1).
"""

from __future__ import annotations

import pytest
import torch

from megatron_ckpt_fixes.fixes.replicas.claims import TENSOR
from megatron_ckpt_fixes.fixes.replicas.digest import tensor_digest, value_digest
from megatron_ckpt_fixes.fixes.replicas.verdict import differing

pytestmark = pytest.mark.varies_with("megatron-core", "torch")


def test_equal_values_have_equal_digests_whatever_shares_what():
    shared = [1, 2]
    assert value_digest({"a": shared, "b": shared}) == value_digest({"a": [1, 2], "b": [1, 2]})
    t = torch.arange(6.0).reshape(2, 3)
    assert value_digest({"t": t}) == value_digest({"t": t.clone()})
    assert tensor_digest(t) == tensor_digest(t.t().contiguous().t())  # strides do not count
    looped: list = []
    looped.append(looped)
    assert value_digest(looped) == value_digest(looped)  # cyclic: pickled with the memo


@pytest.mark.parametrize("other", [
    torch.arange(6.0).reshape(3, 2),  # same bytes, other shape
    torch.arange(6, dtype=torch.float64).reshape(2, 3),  # other dtype
    torch.tensor([[0.0, 1, 2], [3, 4, 6]]),  # one value other
])
def test_different_values_have_different_digests(other):
    assert tensor_digest(torch.arange(6.0).reshape(2, 3)) != tensor_digest(other)


def test_negative_zero_is_not_zero():
    assert tensor_digest(torch.tensor([0.0])) != tensor_digest(torch.tensor([-0.0]))


def test_the_verdict_names_the_ranks_that_differ_from_the_main_replica():
    chunk = (TENSOR, "w", (0,))
    # The main replica is on rank 2; ranks 0 and 3 differ from it, rank 1 agrees.
    lines = differing([{chunk: (1, 5)}, {chunk: (2, 7)}, {chunk: (0, 7)}, {chunk: (3, 9)}])
    assert lines == ["ShardedTensor 'w' at offset (0,): ranks 0, 3 hold values other than "
                     "rank 2's (the main replica, the one written; declared by ranks 0, 1, 2, 3)"]
    assert differing([{chunk: (0, 1)}, {chunk: (1, 1)}, {}, {chunk: (3, 1)}]) == []
