"""The ``reshard.tzrec`` feature on TorchEasyRec's own checkpoint module (the snapshot's):
where it applies, what it replaces, when it refuses, and that it detects a tzrec that already
routes managed-collision entries by value from that code's behaviour.

Each test imports tzrec in this process (``tzrec_harness``: a first import of the package
``tzrec``) and forgets it afterwards, so other tests see no tzrec; only its protobuf modules
stay (protobuf's descriptor pool is per process: they cannot be imported twice). Needs TorchRec and
grpcio-tools (scripts/install_torchrec_cpu.sh, scripts/install_tzrec_test_deps.sh).
"""

from __future__ import annotations

import importlib
import sys

import pytest
from optional_systems import require

require("tzrec")
import torch
import tzrec_harness
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from megatron_ckpt_fixes.core.errors import UnsupportedVersionError
from megatron_ckpt_fixes.integrations import tzrec as feature

pytestmark = pytest.mark.varies_with("torch", "python", "torchrec", "tzrec")

FEATURE = "reshard.tzrec"
PATCHED = {"restore_model", "_needs_mch_redistribution"}


@pytest.fixture
def tzrec_path(clean_install, monkeypatch):
    """tzrec importable (not imported yet); afterwards no tzrec module stays imported."""
    monkeypatch.syspath_prepend(str(tzrec_harness.import_root()))
    yield clean_install
    clean_install.uninstall()
    for name in [m for m in sys.modules if m == "tzrec" or m.startswith("tzrec.")]:
        if not name.startswith("tzrec.protos"):
            del sys.modules[name]


def _checkpoint_util():
    return importlib.import_module(feature._CU)


def _names(mcf) -> dict[str, str]:
    return {n: why for n, why in mcf.installed().items() if n.startswith(FEATURE)}


def test_not_applied_where_tzrec_is_not_installed(clean_install):
    clean_install.install([FEATURE])
    assert set(_names(clean_install).values()) == {"not applied: tzrec is not installed"}
    assert "tzrec" not in sys.modules


def test_applied_at_the_first_import_of_tzrec_and_restored_exactly(tzrec_path):
    mcf = tzrec_path
    mcf.install([FEATURE])
    assert all(why.startswith("waiting") for why in _names(mcf).values())
    import tzrec  # noqa: F401 - the first import applies the waiting feature

    cu = _checkpoint_util()
    assert len(_names(mcf)) == 3 and not any(w.startswith(("not", "waiting")) for w in _names(mcf).values())
    wrappers = {name: vars(cu)[name] for name in PATCHED}
    assert vars(cu.PartialLoadPlanner)["set_up_planner"].__wrapped__ is DefaultLoadPlanner.set_up_planner
    mcf.uninstall()
    assert all(vars(cu)[name] is wrappers[name].__wrapped__ for name in PATCHED)
    assert "set_up_planner" not in vars(cu.PartialLoadPlanner)


def test_upstream_routes_by_slot_detected_from_its_behaviour(tzrec_path):
    import tzrec  # noqa: F401

    assert feature.upstream_routes_by_value() is None


def _redistribute_by_value(model: torch.nn.Module) -> None:
    """A tzrec that routed by value (test-only): each entry goes to the rank that serves its
    id (blocks of ceil(input_hash_size / buckets) ids, buckets spread evenly over the ranks)."""
    from torchrec.modules.mc_modules import MCHManagedCollisionModule

    dist = _checkpoint_util().dist
    world = dist.get_world_size()
    for mc in (m for m in model.modules() if isinstance(m, MCHManagedCollisionModule)):
        ids = mc._mch_sorted_raw_ids[mc._mch_sorted_raw_ids != torch.iinfo(torch.int64).max]
        block = -(-mc._input_hash_size // mc._buckets)
        counts = torch.bincount(ids // block * world // mc._buckets, minlength=world)
        dist.all_to_all_single(torch.empty_like(counts), counts)


def test_not_applied_where_tzrec_already_routes_by_value(tzrec_path, monkeypatch):
    import tzrec  # noqa: F401

    cu = _checkpoint_util()
    restore = cu.restore_model
    monkeypatch.setattr(cu, "_redistribute_mch_state", _redistribute_by_value)
    tzrec_path.install([FEATURE])
    reasons = set(_names(tzrec_path).values())
    assert len(reasons) == 1 and "sends each managed-collision entry to the rank that serves its id" in reasons.pop()
    assert cu.restore_model is restore and "set_up_planner" not in vars(cu.PartialLoadPlanner)
    assert cu.dist is torch.distributed  # the probe's stand-in is gone


@pytest.mark.parametrize("break_it,named", [
    (lambda cu, mp: mp.delattr(cu, "_redistribute_mch_state"), "_redistribute_mch_state"),
    (lambda cu, mp: mp.setattr(cu, "restore_model", lambda checkpoint_dir, model: None), "'optimizer'"),
])
def test_refused_loudly_and_atomically_where_upstream_lacks_what_it_needs(tzrec_path, monkeypatch,
                                                                          break_it, named):
    import tzrec  # noqa: F401

    cu = _checkpoint_util()
    break_it(cu, monkeypatch)
    before = {name: getattr(cu, name, None) for name in PATCHED}
    with pytest.raises(UnsupportedVersionError, match=named):
        tzrec_path.install([FEATURE])
    assert {name: getattr(cu, name, None) for name in PATCHED} == before
    assert "set_up_planner" not in vars(cu.PartialLoadPlanner)
    assert _names(tzrec_path) == {}
