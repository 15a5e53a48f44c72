"""The distributed optimizer's ``dp_reshardable`` checkpoint resumes exactly at another
data-parallel size: megatron-core's own GPTModel (MoE, uneven parameter sizes), DDP and
DistributedOptimizer on gloo (see dist_optimizer_ranks.py for the CPU platform).

Saved at DP=2 (the ranks' slices of the gradient bucket hold 10 and 17 parameters), resumed
at DP=2 and at DP=1 (26), each time first with plain upstream (``compat.cpu`` and
``training.cpu_support`` only), then with ``install()``. Two checkpoints:

- ``upstream``: megatron-core's own writer. Upstream resumes it with the loading optimizer's
  Adam step (1) instead of the saved one (2): the bias correction of the next step differs
  (:mod:`megatron_ckpt_fixes.fixes.dp_reshardable_step`).
- ``plain_step``: the writer that leaves each entry's step a plain tensor (Megatron-LM forks,
  builds between releases): rank 0's per-rank bucket list lands in the common state and no
  rank with another count of parameters can resume: ``Cannot merge two lists with different
  lengths`` (radixark/Megatron-LM PR 66, modelscope/ms-swift issue 8240), rank 0 itself
  ``Duplicate non-dict and non-list values`` (:mod:`megatron_ckpt_fixes.fixes.common_merge`).

With the fixes every resume holds every saved value (main parameters and Adam moments, max
delta 0.0) and the saved step, and keeps the common state beside the lists (the iteration,
the sharding type): the trivial wrong fixes fail here: skipping the common state's merge on
the error loses them; keeping the loader's step, or taking rank 0's steps by position,
leaves the wrong step.
"""

from __future__ import annotations

import pytest
import torch
from dist_optimizer_ranks import NAMES, SAVED_STEPS, resume_only, save_and_resume

from megatron_ckpt_fixes._dev.testing import run_ranks

pytestmark = pytest.mark.varies_with("megatron-core", "torch")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("dp_reshardable"))
    dp2 = [r.value for r in run_ranks(save_and_resume, 2, root, timeout_s=600)]
    dp1 = [r.value for r in run_ranks(resume_only, 1, root, timeout_s=600)]
    return {"saved": [r["saved"] for r in dp2], 2: dp2, 1: dp1}


def _global(saved: list[dict]) -> dict[str, torch.Tensor]:
    """Each bucket tensor as the ranks saved it (NaN where no non-padding entry lies)."""
    ends: dict[str, int] = {}
    for rank in saved:
        for (key, offset), values in rank["pieces"].items():
            ends[key] = max(ends.get(key, 0), offset + values.numel())
    tensors = {key: torch.full((end,), float("nan")) for key, end in ends.items()}
    for rank in saved:
        for (key, offset), values in rank["pieces"].items():
            tensors[key][offset:offset + values.numel()] = values
    return tensors


def _differences(found: dict, saved: dict[str, torch.Tensor]) -> list[str]:
    """Every piece this rank holds that differs from what was saved there."""
    bad = []
    for (key, offset), values in found["pieces"].items():
        expected = saved[key][offset:offset + values.numel()]
        if not torch.equal(values, expected):
            bad.append(f"{key}@{offset}: max delta {(values - expected).abs().max().item()}")
    return bad


def test_the_ranks_slices_hold_different_numbers_of_parameters(runs):
    counts = [rank["entries"] for rank in runs["saved"]]
    resumed = runs[1][0]["fixed"]["upstream"]["entries"]
    assert len(set(counts)) == 2 and resumed not in counts, (counts, resumed)


def test_upstream_cannot_merge_the_plain_step_checkpoints_common_lists(runs):
    rank0, rank1 = (rank["upstream"]["plain_step"] for rank in runs[2])
    alone = runs[1][0]["upstream"]["plain_step"]
    assert rank0.startswith("ValueError: Duplicate non-dict and non-list values"), rank0
    assert rank1.startswith("ValueError: Cannot merge two lists with different lengths"), rank1
    assert alone.startswith("ValueError: Cannot merge two lists with different lengths"), alone
    assert "'param_state'" in rank1 and "'param_state'" in alone


@pytest.mark.parametrize("dp", [2, 1])
def test_upstream_resumes_with_the_loaders_adam_step(runs, dp):
    saved = _global(runs["saved"])
    for rank in runs[dp]:
        found = rank["upstream"]["upstream"]
        assert _differences(found, saved) == []
        assert found["steps"] == [1.0] != [float(SAVED_STEPS)]


@pytest.mark.parametrize("dp", [2, 1])
@pytest.mark.parametrize("name", NAMES)
def test_every_resume_is_exact_with_the_fixes(runs, dp, name):
    saved = _global(runs["saved"])
    for rank in runs[dp]:
        found = rank["fixed"][name]
        assert isinstance(found, dict), found
        assert _differences(found, saved) == []
        assert found["steps"] == [float(SAVED_STEPS)]
        assert (found["iteration"], found["sharding_type"]) == (8, "dp_reshardable")
