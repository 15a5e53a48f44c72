"""Under a logging strictness a load that leaves requested keys unloaded says so in one line,
the same on every rank; the pre-flight refuses the same keys before any data is read.

Twins in one run of 2 ranks (strictness_ranks.py): the checkpoint lacks ``model.new`` (asked
by both ranks) and ``model.expert.1`` (asked by rank 1 only), and holds ``model.only_saved``
(asked by none). Upstream (``compat.cpu``): each rank logs its own keys in its own words, so
rank 0 never mentions the expert rank 1 resumes without. With ``install()``: one line, equal
on both ranks, naming every key left unloaded and who asked for it. The load itself is the
one asked for, under either: the same keys loaded, the same values, the same keys left out;
the trivial wrong fixes fail here: refusing the load (the caller chose to log), or logging
on the ranks that lack a key only.
"""

from __future__ import annotations

import pytest
import torch
from strictness_ranks import SAVED_W, STRICT, strictness_worker

from megatron_ckpt_fixes._dev.testing import run_ranks

pytestmark = pytest.mark.varies_with("megatron-core")

WS = 2
UNLOADED = ("Unexpected keys (requested, not in the checkpoint: left unloaded, they keep the "
            "values they had before the load): 2: 'model.expert.1' (rank 1), 'model.new' "
            "(ranks 0, 1)")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    root = str(tmp_path_factory.mktemp("strictness"))
    return [r.value for r in run_ranks(strictness_worker, WS, root)]


@pytest.mark.parametrize("strict", STRICT)
def test_upstream_logs_each_ranks_own_keys(ranks, strict):
    rank0, rank1 = (r["upstream"][strict]["lines"] for r in ranks)
    assert len(rank0) == len(rank1) == 1 and rank0 != rank1, (rank0, rank1)
    assert "model.new" in rank0[0] and "model.expert.1" not in rank0[0]
    assert "model.expert.1" in rank1[0]


@pytest.mark.parametrize("strict", STRICT)
def test_one_agreed_line_names_every_key_left_unloaded(ranks, strict, tmp_path_factory):
    lines = [r["fixed"][strict]["lines"] for r in ranks]
    assert lines[0] == lines[1] and len(lines[0]) == 1, lines
    line = lines[0][0]
    assert f"with strict={strict}: {UNLOADED}" in line, line
    if strict == "log_all":
        assert line.endswith("; Missing keys (in the checkpoint, not requested): 1: "
                             "'model.only_saved'"), line
    else:
        assert "Missing keys" not in line  # log_unexpected does not look for them


@pytest.mark.parametrize("strict", STRICT)
def test_the_load_is_the_one_asked_for(ranks, strict):
    for rank, outcome in enumerate(ranks):
        upstream, fixed = outcome["upstream"][strict], outcome["fixed"][strict]
        assert fixed["keys"] == upstream["keys"] == ["model.w"]
        assert torch.equal(fixed["w"], SAVED_W[rank:rank + 1])
        assert torch.equal(upstream["w"], SAVED_W[rank:rank + 1])


def test_the_preflight_names_the_same_keys_before_reading_data(ranks):
    """On a copy of the checkpoint without its data files: what it says is from metadata."""
    verdicts = [r["preflight"] for r in ranks]
    assert verdicts[0] == verdicts[1], verdicts
    verdict = verdicts[0]
    assert verdict.startswith("CheckpointLoadError: "), verdict
    assert "rank 0: pre-flight: 'model.new': not in the checkpoint" in verdict, verdict
    assert ("rank 1: pre-flight: 'model.new': not in the checkpoint (it was saved without this "
            "key); 'model.expert.1': not in the checkpoint") in verdict, verdict
