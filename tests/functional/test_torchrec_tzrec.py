"""TorchEasyRec's own ``save_model`` / ``restore_model`` (the snapshot's code) on a real
DMP-sharded managed-collision table, saved at N gloo ranks and restored at M.

The model is ``torchrec_model``'s (a ``ManagedCollisionEmbeddingCollection`` sharded
row-wise with exact Adagrad, beside a dense layer) with the optimizer tzrec builds for it
(``TZRecOptimizer`` over ``CombinedOptimizer([model.fused_optimizer, dense])``; the dense
optimizer is SGD with momentum, so ``optimizer/`` holds dense state too). Directions 1->2,
2->3, 2->4, 3->2 (the 2->3 result saved by tzrec at 3, against the original 2-rank state) and
4->3 with 96 slots (even per-rank sizes), and 2->3 with 64 slots (22, 22 and 20 at 3 ranks),
where the rank with 20 slots serves 20 learned ids, one more than it can hold next to its
miss slot.

Fixed (``install()``; at 3 ranks only the switch ``MEGATRON_CKPT_FIXES=1`` and the first
import of ``tzrec``): every learned id looks up (eval forward) bitwise its saved row, the rank
that serves it holds it with its saved momentum, counts and last-access iteration; no learned
id is on a miss slot and every unknown id maps to the miss slot of the rank serving it; the
dense layer, its optimizer state and the iteration counter are exact; a training step runs.
At 64 slots, exactly the learned id of lowest count served by the full rank is evicted (it
reads the miss row like an unknown id) and every other one is exact: a resharder that let
the 20th id take the miss slot fails there.

Upstream twin (the same restore without the patches, tzrec pull request 467 routing each
entry by its slot): learned ids look up other rows, learned ids sit on miss slots and
unknown ids read learned rows; at 64 slots the rank with 20 slots is sent 21 entries and
stops (``received 22 > local zch_size 20``).

Needs TorchRec (scripts/install_torchrec_cpu.sh), grpcio-tools<1.63.0
(scripts/install_tzrec_test_deps.sh) and the TorchEasyRec snapshot (tzrec_harness.py).
"""

from __future__ import annotations

import logging
import os
import re

import pytest
from optional_systems import require

require("tzrec")
import torch
import torch.distributed as dist
import torchrec_model as tm
import tzrec_harness

from torch.distributed._shard.sharded_tensor import ShardedTensor

import megatron_ckpt_fixes
from megatron_ckpt_fixes.activation import ENV
from megatron_ckpt_fixes.reshard import ReshardError
from megatron_ckpt_fixes._dev.testing import run_ranks

pytestmark = pytest.mark.varies_with("torch", "python", "torchrec", "tzrec")

logger = logging.getLogger(__name__)

STEPS = 8
#: slots of the table, and the ids training sees (ids in [0, 10000); TorchRec routes blocks of
#: 834 ids, 12 blocks spread over the ranks).
EVEN = (96, [61 + 125 * i for i in range(80)])  # 20 per quarter, 26-27 per third, 40 per half
#: 64 slots: 29 and 30 ids per half (31 usable slots each at 2 ranks); per third 19, 20 and 20
#: (21, 21 and 19 usable slots at 3 ranks: the last rank must evict one).
UNEVEN = (64, [37 + 175 * i for i in range(19)] + [3400 + 160 * i for i in range(10)]
          + [5050 + 150 * i for i in range(10)] + [6700 + 160 * i for i in range(20)])
UNKNOWN = [i for i in range(3, 10_000, 37) if i not in set(EVEN[1]) | set(UNEVEN[1])][:256]
COUNTS_KEY = "sparse._managed_collision_collection._managed_collision_modules.t0._mch_counts"
TZREC_FEATURE = "reshard.tzrec"
PATCHES = [f"{TZREC_FEATURE}.{p}" for p in ("needs_mch_redistribution", "partial_load_planner", "restore_model")]


def _gather(value: object) -> list:
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _optimizer(model: tm.DistributedModelParallel):
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from tzrec.optim.optimizer import TZRecOptimizer

    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(model.named_parameters())),
                                  lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
    return TZRecOptimizer(CombinedOptimizer([model.fused_optimizer, dense]))


def _train(model, optimizer, rank: int, pool: list[int], steps: int, seed: int) -> None:
    """Every rank sees the whole pool, in its own random order, a part per step (so ids are
    admitted in an order unrelated to their values, as in training), with a few repeats."""
    g = torch.Generator().manual_seed(seed * 100 + rank)
    order = torch.tensor(pool)[torch.randperm(len(pool), generator=g)]
    model.train()
    for part in order.chunk(steps):
        ids = torch.cat([part, order[torch.randint(0, len(pool), (4,), generator=g)]])
        _, _, loss = model(tm.batch(ids))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def _dense(model, optimizer) -> dict:
    state = optimizer.state_dict()["state"]
    return {"weight": model.module.dense.weight.tolist(),
            "momentum": state["dense.weight"]["momentum_buffer"].tolist()}


def _save(rank: int, world: int, ckpt: str, scenario: tuple) -> dict:
    from tzrec.utils.checkpoint_util import save_model

    zch, pool = scenario
    model = tm.build(world, seed=0, zch=zch)
    optimizer = _optimizer(model)
    _train(model, optimizer, rank, pool, STEPS, seed=1)
    truth = tm.local_truth(model)
    ids = sorted(i for part in _gather(list(truth)) for i in part)
    rows, _ = tm.lookup(model, ids)
    save_model(ckpt, model, optimizer)
    return {"truth": truth, "ids": ids, "rows": rows.tolist(), "dense": _dense(model, optimizer),
            "iter": int(tm.mc_module(model)._current_iter_tensor)}


def _restore(rank: int, world: int, ckpt: str, saved: dict, zch: int, save_to: str | None) -> dict:
    """tzrec's restore_model as the installed patches (or none) make it; then measure."""
    from tzrec.utils.checkpoint_util import restore_model, save_model

    model = tm.build(world, seed=7, zch=zch)  # other initial values than the saved model's
    optimizer = _optimizer(model)
    # tzrec's train loop runs one batch before restoring (optimizer state is lazy); here of
    # ids the checkpoint does not know, which the restore must not leave behind.
    _train(model, optimizer, rank, UNKNOWN[:32], 1, seed=3)
    try:
        restore_model(ckpt, model, optimizer)
    except BaseException as exc:  # noqa: BLE001 - upstream's failure is the twin's result
        return {"error": f"{type(exc).__name__}: {exc}"}
    out = _measure(model, optimizer, rank, world, saved)
    if save_to:
        save_model(save_to, model, optimizer)
    _train(model, optimizer, rank, saved["ids"], 1, seed=9)
    out["trained"] = True
    return out


def _refused(rank: int, world: int, ckpt: str, zch: int, param_map: str) -> dict:
    """A restore whose parameter map sends one MC buffer to a key the checkpoint lacks: the
    table cannot be loaded by value (upstream would load the rest of it and skip that one)."""
    from tzrec.utils.checkpoint_util import restore_model

    model = tm.build(world, seed=7, zch=zch)
    optimizer = _optimizer(model)
    before = {k: _local(v).clone() for k, v in model.state_dict().items()}
    error = None
    try:
        restore_model(ckpt, model, optimizer, ckpt_param_map_path=param_map)
    except ReshardError as exc:
        error = str(exc)
    return {"error": error, "untouched": all(torch.equal(before[k], _local(v))
                                             for k, v in model.state_dict().items())}


def _local(value: object) -> torch.Tensor:
    return value.local_shards()[0].tensor if isinstance(value, ShardedTensor) else value


def _measure(model, optimizer, rank: int, world: int, saved: dict) -> dict:
    from megatron_ckpt_fixes.integrations.torchrec import TorchRecRouting

    ids, truth = saved["ids"], saved["truth"]
    rows, slots = tm.lookup(model, ids)
    miss = _gather(tm.miss_slot(model))
    unknown_rows, unknown_slots = tm.lookup(model, UNKNOWN)
    routing = TorchRecRouting(tm.H, tm.BUCKETS)
    learned = {tuple(r) for r in saved["rows"]}
    mine = tm.local_truth(model)
    mc = tm.mc_module(model)
    taken = mc._mch_remapped_ids_mapping == tm.miss_slot(model)
    owned = [i for i, o in zip(ids, routing.owner(torch.tensor(ids), world).tolist()) if o == rank]
    return {
        "wrong_rows": [i for i, a, b in zip(ids, rows.tolist(), saved["rows"]) if a != b],
        "on_miss_slot": [i for i, s in zip(ids, slots.tolist()) if s in miss],  # lost ids too
        "holds_miss_slot": [i for i in mc._mch_sorted_raw_ids[taken].tolist() if i in truth],
        "unknown_read_learned": sum(tuple(r) in learned for r in unknown_rows.tolist()),
        "unknown_to_miss": unknown_slots.tolist() == [miss[o] for o in routing.owner(
            torch.tensor(UNKNOWN), world).tolist()],
        "owned": owned, "held": sorted(mine),
        "wrong_state": [i for i in owned if i in mine and mine[i] != truth[i]],
        "dense_exact": _dense(model, optimizer) == saved["dense"],
        "iter": int(tm.mc_module(model)._current_iter_tensor),
        "patched": _applied(),
    }


def _applied() -> list[str]:
    return sorted(n for n, why in megatron_ckpt_fixes.installed().items()
                  if not why.startswith(("not applied", "waiting")))


def job(rank: int, world: int, steps: list[tuple]) -> dict:
    """Runs the steps in order; ``("fixed", ...)`` after ``install()``, or after nothing when
    the activation switch is set; ``("upstream", ...)`` after ``uninstall()``. Also returns
    the tzrec patches applied before and after the first ``import tzrec``."""
    tzrec_harness.activate()
    if not os.environ.get(ENV):
        megatron_ckpt_fixes.install([TZREC_FEATURE])
    before = _applied()
    import tzrec  # noqa: F401 - the first import: the switch (or the waiting install) applies the patches

    after, out = _applied(), []
    for kind, *args in steps:
        if kind == "save":
            out.append(_save(rank, world, *args))
            continue
        if kind == "upstream":
            megatron_ckpt_fixes.uninstall()
        out.append((_refused if kind == "refused" else _restore)(rank, world, *args))
    return {"before_import": before, "after_import": after, "steps": out}


def _merge(per_rank: list[dict]) -> dict:
    return {**per_rank[0], "truth": {i: v for r in per_rank for i, v in r["truth"].items()}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tzrec_harness.import_root()  # generated once, before the ranks look for it
    root = tmp_path_factory.mktemp("tzrec")
    ck = {n: str(root / n) for n in ("even1", "even2", "even4", "even3_from_2", "uneven2")}
    saved: dict[str, dict] = {}
    out: dict[str, list] = {}
    imports: dict = {}

    def spawn(world: int, steps: list[tuple], names: list[str], switch: str | None = None) -> None:
        old = os.environ.pop(ENV, None)
        if switch:
            os.environ[ENV] = switch
        try:
            results = [r.value for r in run_ranks(job, world, steps, timeout_s=300)]
            imports[world if not switch else f"{world}:switch"] = [
                (r["before_import"], r["after_import"]) for r in results]
            results = [r["steps"] for r in results]
        finally:
            os.environ.pop(ENV, None)
            if old is not None:
                os.environ[ENV] = old
        for i, name in enumerate(names):
            if name.startswith("save:"):
                saved[name[5:]] = _merge([r[i] for r in results])
            else:
                out[name] = [r[i] for r in results]

    def restore(kind: str, source: str, target: str | None = None) -> tuple:
        zch = UNEVEN[0] if source.startswith("uneven") else EVEN[0]
        return (kind, ck[source], saved[source], zch, target)

    spawn(1, [("save", ck["even1"], EVEN)], ["save:even1"])
    spawn(2, [("save", ck["even2"], EVEN), ("save", ck["uneven2"], UNEVEN),
              restore("fixed", "even1"), restore("upstream", "even1")],
          ["save:even2", "save:uneven2", "1to2", "1to2:upstream"])
    spawn(4, [("save", ck["even4"], EVEN), restore("fixed", "even2"), restore("upstream", "even2")],
          ["save:even4", "2to4", "2to4:upstream"])
    # Only the switch here: no install() in the ranks. The crash twin goes last (it stops a rank).
    spawn(3, [restore("fixed", "even2", ck["even3_from_2"]), restore("fixed", "even4"),
              restore("fixed", "uneven2"), restore("upstream", "even2"), restore("upstream", "even4"),
              restore("upstream", "uneven2")],
          ["2to3", "4to3", "uneven2to3", "2to3:upstream", "4to3:upstream", "uneven2to3:upstream"],
          switch="1")
    saved["even3_from_2"] = saved["even2"]
    param_map = root / "param_map"
    param_map.write_text(f"{COUNTS_KEY} no.such.key\n")
    spawn(2, [restore("fixed", "even3_from_2"), restore("fixed", "even2"),
              ("refused", ck["even3_from_2"], EVEN[0], str(param_map)), restore("upstream", "even3_from_2")],
          ["3to2", "2to2", "part_missing", "3to2:upstream"])
    sources = {"1to2": "even1", "2to3": "even2", "2to4": "even2", "3to2": "even2", "4to3": "even4",
               "uneven2to3": "uneven2", "2to2": "even2"}
    out["imports"] = imports
    return out, {case: saved[src] for case, src in sources.items()}


EVEN_CASES = ("1to2", "2to3", "2to4", "3to2", "4to3")


def _fixed_ok(results: list[dict], source: dict, evicted: set[int] = frozenset()) -> None:
    assert len(source["ids"]) == len(set(source["ids"])) > 50  # the model really learned ids
    held = sorted(i for r in results for i in r["held"])
    assert held == sorted(set(source["ids"]) - evicted), "every kept id is held once, on some rank"
    for rank, r in enumerate(results):
        assert r["patched"] == PATCHES
        assert sorted(r["wrong_rows"]) == sorted(evicted), f"rank {rank}: ids look up other rows"
        assert r["held"] == sorted(set(r["owned"]) - evicted), f"rank {rank} holds ids it does not serve"
        assert r["wrong_state"] == [], f"rank {rank}: optimizer rows or metadata differ"
        # no learned id on a miss slot (an evicted id is unknown now, so it maps there)
        assert sorted(r["on_miss_slot"]) == sorted(evicted), f"rank {rank}: learned ids on a miss slot"
        assert r["holds_miss_slot"] == [] and r["unknown_to_miss"] and r["unknown_read_learned"] == 0
        assert r["dense_exact"] and r["iter"] == source["iter"] == STEPS and r["trained"]


@pytest.mark.parametrize("case", (*EVEN_CASES, "2to2"))  # 2to2: the same layout, by position
def test_restore_model_keeps_every_learned_id(runs, case):
    out, saved = runs
    _fixed_ok(out[case], saved[case])


def test_restore_model_uneven_sizes_full_rank_evicts_lowest_count(runs):
    """64 slots at 3 ranks (22, 22, 20): rank 2 serves 20 learned ids, holds 19 next to its
    miss slot: the id of lowest count (ties: the higher id) goes, every other is exact."""
    out, saved = runs
    source = saved["uneven2to3"]
    served = [i for i in source["ids"] if i in out["uneven2to3"][2]["owned"]]
    assert len(served) == 20
    lowest = max(served, key=lambda i: (-source["truth"][i]["counts"], i))
    _fixed_ok(out["uneven2to3"], source, evicted={lowest})


@pytest.mark.parametrize("case", EVEN_CASES)
def test_upstream_restore_model_loses_learned_ids(runs, case):
    """tzrec pull request 467 moves entries by slot; lookups route by value."""
    out, saved = runs
    results = out[f"{case}:upstream"]
    assert all("error" not in r and r["patched"] == [] for r in results), results[0]
    first = results[0]
    logger.warning("%s upstream: %d of %d learned ids look up other rows, %d hold a miss slot, "
                   "%d of %d unknown ids read a learned row", case, len(first["wrong_rows"]),
                   len(saved[case]["ids"]), sum(len(r["holds_miss_slot"]) for r in results),
                   first["unknown_read_learned"], len(UNKNOWN))
    assert first["wrong_rows"] and first["unknown_read_learned"]
    assert sum(len(r["wrong_state"]) + len(set(r["held"]) - set(r["owned"])) for r in results) > 0


def test_zero_code_activation_applies_the_fix_at_the_first_import_of_tzrec(runs):
    """At 3 ranks only ``MEGATRON_CKPT_FIXES=1`` was set (no install() call): nothing was
    patched before ``import tzrec``, the three patches after it (and the restores there are
    the fixed ones above: 2to3, 4to3, uneven2to3)."""
    out, _ = runs
    assert out["imports"]["3:switch"] == [([], PATCHES)] * 3
    assert out["imports"][2] == [([], PATCHES)] * 2  # install() before the import: it waited


def test_restore_model_refuses_a_partial_table_on_every_rank_model_untouched(runs):
    out, _ = runs
    results = out["part_missing"]
    assert len({r["error"] for r in results}) == 1, "the same error on every rank"
    assert "holds only part of the managed-collision state" in results[0]["error"]
    assert COUNTS_KEY in results[0]["error"] and "rank 0" in results[0]["error"]
    assert all(r["untouched"] for r in results)


def test_upstream_restore_model_uneven_sizes_stops(runs):
    out, _ = runs
    results = out["uneven2to3:upstream"]
    error = results[2]["error"]
    assert error.startswith("AssertionError") and re.search(r"received 2\d > local zch_size 20", error), error
