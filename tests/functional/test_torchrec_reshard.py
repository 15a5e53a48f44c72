"""Real TorchRec: a DMP-sharded managed-collision model saved with DCP at N ranks, loaded at M.

Cases 2->3, 3->2 (a second round trip: the 2->3 result saved at 3 and loaded back at 2),
2->4, 4->3, 1->3, the merge 4->2, and 2->2 (same layout: loaded by position). After ``megatron_ckpt_fixes.integrations.torchrec.load``
(then the usual ``load_state_dict`` calls), on every rank: every id admitted before the save
looks up (eval forward) bitwise the same embedding row; the rank that serves each id holds
exactly those ids with the saved optimizer rows, counts and last-access iterations; unknown
ids map to the miss slot of the rank that serves them; the iteration counter and the dense
layer are exact; a training step runs. Each case has an upstream twin: plain ``dcp.load`` and
``load_state_dict``, asserting today's failure (TorchRec's ``validate_state`` refuses the
segments; with that check bypassed, learned ids look up other rows) -- or, for 4->2, whose new
boundaries are all old ones, that upstream already works.

Needs TorchRec (scripts/install_torchrec_cpu.sh); one spawn per world size and step.
"""

from __future__ import annotations

import logging

import pytest
from optional_systems import require

require("torchrec")
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor

import torchrec_model as tm
from megatron_ckpt_fixes.reshard import ReshardError
from megatron_ckpt_fixes.integrations.torchrec import TorchRecRouting, load
from megatron_ckpt_fixes._dev.testing import run_ranks

pytestmark = pytest.mark.varies_with("torch", "python", "torchrec")

STEPS = 5
logger = logging.getLogger(__name__)


def _save(rank: int, world: int, ckpt: str, seed: int, corrupt_to: str | None = None) -> dict:
    model = tm.build(world, seed)
    tm.train(model, rank, STEPS, seed)
    truth = tm.local_truth(model)
    ids = sorted(i for part in _gather(list(truth)) for i in part)
    rows, _ = tm.lookup(model, ids)
    dcp.save(tm.state_dict(model), checkpoint_id=ckpt)
    if corrupt_to:  # then rank 1 also admits rank 0's smallest id (still sorted): a duplicate
        first = _gather(min(truth))[0]
        if rank == 1:
            tm.mc_module(model)._mch_sorted_raw_ids[0] = first
        dcp.save(tm.state_dict(model), checkpoint_id=corrupt_to)
    return {"truth": truth, "ids": ids, "rows": rows.tolist(), "dense": model.module.dense.weight.tolist(),
            "iter": int(tm.mc_module(model)._current_iter_tensor)}


def _gather(value: object) -> list:
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _check(model: tm.DistributedModelParallel, rank: int, world: int, saved: dict) -> dict:
    """Everything the issue asks of a loaded model, measured on this rank."""
    truth, ids = saved["truth"], saved["ids"]
    rows, _ = tm.lookup(model, ids)
    wrong_rows = sum(a != b for a, b in zip(rows.tolist(), saved["rows"]))
    mine = tm.local_truth(model)
    routing = TorchRecRouting(tm.H, world)
    owned = [i for i, o in zip(ids, routing.owner(torch.tensor(ids), world).tolist()) if o == rank]
    wrong_state = sum(mine[i] != truth[i] for i in owned if i in mine)
    unknown = [i for i in range(5, tm.H, 97) if i not in truth][:64]
    _, unknown_slots = tm.lookup(model, unknown)
    miss = _gather(tm.miss_slot(model))
    expected = [miss[o] for o in routing.owner(torch.tensor(unknown), world).tolist()]
    return {"wrong_rows": wrong_rows, "ids_here": sorted(mine), "owned": owned, "wrong_state": wrong_state,
            "unknown_to_miss": unknown_slots.tolist() == expected,
            "iter": int(tm.mc_module(model)._current_iter_tensor),
            "dense_exact": model.module.dense.weight.tolist() == saved["dense"]}


def _ours(rank: int, world: int, ckpt: str, saved: dict, save_to: str | None) -> dict:
    model = tm.build(world, seed=7)  # other initial values than the saved model's
    state = tm.state_dict(model)
    reports = load(state, ckpt, model)
    model.load_state_dict(state["model"])  # what a TorchRec user does next: validate_state passes
    model.fused_optimizer.load_state_dict(state["optim"])
    out = _check(model, rank, world, saved)
    out["evicted"] = sum(r.evicted_total for r in reports.values())
    if save_to:
        dcp.save(tm.state_dict(model), checkpoint_id=save_to)
    tm.train(model, rank, 1, seed=99)
    out["trained"] = True
    return out


def _upstream(rank: int, world: int, ckpt: str, saved: dict) -> dict:
    """Plain DCP, as TorchRec documents it. Then, with the segment check bypassed (the part
    of validate_state after its assertion: reset segments, re-sort), where each learned id
    lands on the rank that serves it: found with its saved row, or lost (a miss, another row,
    or a row outside the rank's range, which FBGEMM's bounds check refuses mid-forward, so
    the lookup is measured on the module, not by a forward that would kill the job)."""
    model = tm.build(world, seed=7)
    state = tm.state_dict(model)
    dcp.load(state, checkpoint_id=ckpt)
    error = None
    try:
        model.load_state_dict(state["model"])
    except AssertionError as exc:
        error = str(exc)
        mc = tm.mc_module(model)
        mc._output_segments_tensor = mc._init_output_segments_tensor
        mc._sort_mch_buffers()
    ids = torch.tensor(saved["ids"])
    mine = ids[TorchRecRouting(tm.H, world).owner(ids, world) == rank]
    got = tm.local_rows(model, mine)
    want = dict(zip(saved["ids"], saved["rows"]))
    lost = sum(row is None or row != want[i] for i, row in zip(mine.tolist(), got))
    return {"error": error, "lost": sum(_gather(lost))}


def _refused(rank: int, world: int, ckpt: str, copy: bool) -> dict:
    """A load that must fail: a checkpoint with one id on two ranks, or a state dict that is
    a copy (its tensors are not the model's). Same error on every rank, model untouched."""
    model = tm.build(world, seed=7)
    before = {k: _local(v).clone() for k, v in model.state_dict().items()}
    state = tm.state_dict(model)
    if copy:
        state = {"model": {k: _copied(v) for k, v in state["model"].items()}, "optim": state["optim"]}
    error, is_value_error = None, False
    try:
        load(state, ckpt, model)
    except ReshardError as exc:
        error, is_value_error = str(exc), isinstance(exc, ValueError)
    after = {k: _local(v) for k, v in model.state_dict().items()}
    return {"error": error, "is_value_error": is_value_error,
            "untouched": all(torch.equal(before[k], after[k]) for k in before)}


def _local(value: object) -> torch.Tensor:
    return value.local_shards()[0].tensor if isinstance(value, ShardedTensor) else value


def _copied(value: object) -> object:
    if not isinstance(value, ShardedTensor):
        return value.clone()
    shards = [Shard(s.tensor.clone(), s.metadata) for s in value.local_shards()]
    return ShardedTensor._init_from_local_shards_and_global_metadata(shards, value.metadata())


def job(rank: int, world: int, steps: list[tuple]) -> list:
    out = []
    for kind, *args in steps:
        fn = {"save": _save, "ours": _ours, "upstream": _upstream, "refused": _refused}[kind]
        out.append(fn(rank, world, *args))
    return out


def _merge(per_rank: list[dict]) -> dict:
    truth = {i: v for r in per_rank for i, v in r["truth"].items()}
    first = per_rank[0]
    return {"truth": truth, "ids": first["ids"], "rows": first["rows"], "dense": first["dense"],
            "iter": first["iter"]}


CASES = ("2to3", "3to2", "2to4", "4to3", "1to3", "4to2", "2to2")  # 2to2: the positional path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("torchrec")
    ck = {n: str(root / n) for n in ("at1", "at2", "at4", "at3_from_2", "at2_duplicate")}
    saved: dict[str, dict] = {}
    out: dict[str, list] = {}

    def spawn(world: int, steps: list[tuple], names: list[str]) -> None:
        results = [r.value for r in run_ranks(job, world, steps, timeout_s=240)]
        for i, name in enumerate(names):
            if name.startswith("save:"):
                saved[name[5:]] = _merge([r[i] for r in results])
            else:
                out[name] = [r[i] for r in results]

    spawn(1, [("save", ck["at1"], 1)], ["save:at1"])
    spawn(4, [("save", ck["at4"], 4)], ["save:at4"])
    spawn(2, [("save", ck["at2"], 2, ck["at2_duplicate"]), ("ours", ck["at4"], saved["at4"], None),
              ("upstream", ck["at4"], saved["at4"])], ["save:at2", "4to2", "4to2:upstream"])
    spawn(3, [("ours", ck["at2"], saved["at2"], ck["at3_from_2"]), ("upstream", ck["at2"], saved["at2"]),
              ("ours", ck["at4"], saved["at4"], None), ("upstream", ck["at4"], saved["at4"]),
              ("ours", ck["at1"], saved["at1"], None), ("upstream", ck["at1"], saved["at1"]),
              ("refused", ck["at2_duplicate"], False), ("refused", ck["at2"], True)],
          ["2to3", "2to3:upstream", "4to3", "4to3:upstream", "1to3", "1to3:upstream",
           "duplicate_id", "state_dict_copy"])
    # 3 -> 2: the 2 -> 3 result, saved at 3, back at 2, against the original 2-rank state.
    spawn(2, [("ours", ck["at3_from_2"], saved["at2"], None), ("upstream", ck["at3_from_2"], saved["at2"]),
              ("ours", ck["at2"], saved["at2"], None)],
          ["3to2", "3to2:upstream", "2to2"])
    spawn(4, [("ours", ck["at2"], saved["at2"], None), ("upstream", ck["at2"], saved["at2"])],
          ["2to4", "2to4:upstream"])
    sources = {"2to3": "at2", "3to2": "at2", "2to4": "at2", "4to3": "at4", "1to3": "at1", "4to2": "at4",
               "2to2": "at2"}
    return out, {case: saved[src] for case, src in sources.items()}


@pytest.mark.parametrize("case", CASES)
def test_every_id_keeps_its_rows_state_and_training_continues(runs, case):
    out, saved = runs
    results, source = out[case], saved[case]
    assert len(source["ids"]) > 20  # the model really learned ids
    held = sorted(i for r in results for i in r["ids_here"])
    assert held == source["ids"], "every admitted id is held exactly once, on some rank"
    for rank, r in enumerate(results):
        assert r["wrong_rows"] == 0, f"rank {rank}: {r['wrong_rows']} ids look up other rows"
        assert r["ids_here"] == sorted(r["owned"]), f"rank {rank} holds ids it does not serve"
        assert r["wrong_state"] == 0 and r["unknown_to_miss"] and r["dense_exact"] and r["trained"]
        assert r["iter"] == source["iter"] == STEPS
        assert r["evicted"] == 0


@pytest.mark.parametrize("case", [c for c in CASES if c not in ("4to2", "2to2")])
def test_upstream_twin_fails_validate_state_and_loses_ids(runs, case):
    out, saved = runs
    results = out[f"{case}:upstream"]
    for r in results:
        assert r["error"] is not None and "cannot be built out of segements" in r["error"], r["error"]
    lost = results[0]["lost"]
    logger.warning("%s upstream, segment check bypassed: %d of %d learned ids look up another row",
                   case, lost, len(saved[case]["ids"]))
    assert lost > 0


def test_upstream_twin_merge_whose_boundaries_nest_already_works(runs):
    """4 -> 2: every new boundary is an old one, so positional DCP is right by luck; ours
    gives the same lookups."""
    out, _ = runs
    assert all(r["error"] is None and r["lost"] == 0 for r in out["4to2:upstream"])


@pytest.mark.parametrize("case,words", [("duplicate_id", "appears 2+ times"),
                                        ("state_dict_copy", "not a copy")])
def test_refused_load_same_error_on_every_rank_model_untouched(runs, case, words):
    out, _ = runs
    results = out[case]
    assert len({r["error"] for r in results}) == 1 and words in results[0]["error"], results[0]["error"]
    assert "t0" in results[0]["error"] and "rank" in results[0]["error"]
    assert all(r["is_value_error"] and r["untouched"] for r in results)
