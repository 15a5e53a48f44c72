"""A view reads several DCP checkpoints as one, under key prefixes (``reshard.view``): what
the TorchEasyRec restore needs to move a table's embedding rows (``model/``) and optimizer
rows (``optimizer/``) together. Real DCP save and load, one process."""

from __future__ import annotations

import pytest

import torch
import torch.distributed.checkpoint as dcp

from megatron_ckpt_fixes.reshard.view import Part, read_metadata, view_metadata, write_view

pytestmark = pytest.mark.varies_with("torch", "python")


def _save(path, state) -> None:
    dcp.save(state, checkpoint_id=str(path), no_dist=True)


def test_view_loads_keys_of_two_checkpoints_under_prefixes(tmp_path):
    weight, bias, momentum = torch.randn(6, 3), torch.randn(3), torch.randn(6, 3)
    _save(tmp_path / "model", {"emb.weight": weight, "dense.bias": bias})
    _save(tmp_path / "optimizer", {"state": {"emb.weight": {"momentum1": momentum}}})
    parts = {"model": Part(str(tmp_path / "model"), read_metadata(str(tmp_path / "model")),
                           {"emb.weight": "emb.weight", "renamed.bias": "dense.bias"}),
             "optimizer": Part(str(tmp_path / "optimizer"), read_metadata(str(tmp_path / "optimizer")),
                               {"state.emb.weight.momentum1": "state.emb.weight.momentum1"})}
    (tmp_path / "view").mkdir()
    view = write_view(tmp_path / "view", parts)
    state = {"model": {"emb.weight": torch.zeros(6, 3), "renamed.bias": torch.zeros(3)},
             "optimizer": {"state.emb.weight.momentum1": torch.zeros(6, 3)}}
    dcp.load(state, checkpoint_id=view, no_dist=True)
    assert torch.equal(state["model"]["emb.weight"], weight)
    assert torch.equal(state["model"]["renamed.bias"], bias)
    assert torch.equal(state["optimizer"]["state.emb.weight.momentum1"], momentum)
    # only the chosen keys, nothing copied: the view's files are links to the parts
    assert set(view_metadata(parts).state_dict_metadata) == {
        "model.emb.weight", "model.renamed.bias", "optimizer.state.emb.weight.momentum1"}
    assert (tmp_path / "view" / "model").is_symlink()
