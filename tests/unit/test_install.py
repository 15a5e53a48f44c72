"""install() checks what it needs, applies all or nothing, detects upstream behaviour, and
uninstall() restores the exact originals."""

from __future__ import annotations

import sys
import types
from importlib.metadata import version

import pytest
import torch
from packaging.version import Version

import megatron_ckpt_fixes
from megatron_ckpt_fixes import FEATURES, OPTIONAL_FEATURES, UnsupportedVersionError
from megatron_ckpt_fixes.core import save_call
from megatron_ckpt_fixes.core.patching import (_MISSING, EntryPoint, Layer, Patch, PatchSet, _raw,
                                           definer, resolve)
from megatron_ckpt_fixes.compat import versions
from megatron_ckpt_fixes.core.features import BY_NAME
from megatron_ckpt_fixes.fixes.structure import cached_save

#: The megatron-core features: those of other systems (``SYSTEMS``) are applied only where
#: their system is imported, and have their own tests through that system's code.
ALL_FEATURES = tuple(f for f in FEATURES + OPTIONAL_FEATURES
                     if megatron_ckpt_fixes.feature_system(f) == megatron_ckpt_fixes.MEGATRON_CORE)


def _declared(features=ALL_FEATURES):
    return megatron_ckpt_fixes._declared(features)


def _snapshot():
    """The raw attribute objects every declared patch touches (aliases included)."""
    snap = {}
    for patch in _declared():
        for owner_name in (patch.target, *patch.aliases):
            try:
                owner = resolve(owner_name)
            except AttributeError:  # a class this release lacks: only for a patch not needed
                assert patch.not_needed is not None and patch.not_needed(), patch.name
                continue
            snap[(owner_name, patch.attr)] = _raw(owner, patch.attr)
    return snap


def _untouched(before) -> bool:
    return all(v is before[k] for k, v in _snapshot().items())


def test_install_uninstall_restores_exact_originals(clean_install):
    before = _snapshot()
    names = clean_install.install(ALL_FEATURES)
    assert names and set(names) <= set(clean_install.installed())
    assert not _untouched(before), "install() patched nothing"
    clean_install.uninstall()
    assert _untouched(before)
    assert clean_install.installed() == {}


def test_install_is_idempotent(clean_install):
    first = clean_install.install()
    snap = _snapshot()
    assert clean_install.install() == first
    assert _untouched(snap)


def test_features_are_registered_by_name_and_name_their_patches(clean_install):
    for feature in ALL_FEATURES:
        module = resolve(f"megatron_ckpt_fixes.{BY_NAME[feature].module}")
        assert module.PATCHES and all(p.name.startswith(feature + ".")
                                      for p in module.PATCHES if p is not save_call.PATCH)
    names = clean_install.install(["compat.cpu"])
    assert names and all(n.startswith("compat.cpu.") for n in names)
    with pytest.raises(ValueError, match="unknown features"):
        clean_install.install(["no-such-feature"])


def test_every_patch_names_why_it_exists(clean_install):
    clean_install.install()
    assert all(why for why in clean_install.installed().values())


@pytest.mark.parametrize("found", ["0.15.3", "0.21.0", "1.0.0"])
def test_unsupported_megatron_core_is_refused_before_patching(clean_install, monkeypatch, found):
    monkeypatch.setattr(versions, "mcore_version", lambda: Version(found))
    before = _snapshot()
    with pytest.raises(UnsupportedVersionError, match=found):
        clean_install.install()
    assert clean_install.installed() == {}
    assert _untouched(before)


# -- every requirement is checked, by name, before anything is touched ---------------------

def _requirement_sites():
    """(owner, attribute, text the error must contain) for everything a patch that is
    needed here relies on: the attribute it replaces (on the class upstream defines it on),
    the symbols it reads and the aliases it patches. Optional patches are skipped where
    upstream lacks what they need (``test_optional_patch_with_missing_symbol_...``)."""
    sites = {}
    for patch in _declared():
        if patch.optional:
            continue
        if patch.not_needed is not None and patch.not_needed() is not None:
            continue  # upstream has this fix here: what the patch would read does not matter
        if not patch.adds:  # deleted from whichever class defines it in this release
            sites[(patch.target, patch.attr)] = (definer(resolve(patch.target), patch.attr),
                                                  patch.attr, f"{patch.target}.{patch.attr}")
        for alias in patch.aliases:
            sites[(alias, patch.attr)] = (resolve(alias), patch.attr, f"{alias}.{patch.attr}")
        for symbol in patch.reads:
            owner, _, name = symbol.rpartition(".") if "." in symbol.partition(":")[2] \
                else (symbol.partition(":")[0], None, symbol.partition(":")[2])
            sites[(owner, name)] = (resolve(owner), name, symbol)
    return sorted(sites.items())


SITES = _requirement_sites()


@pytest.mark.parametrize("site", [s for s, _ in SITES], ids=lambda s: f"{s[0]}.{s[1]}")
def test_a_missing_upstream_symbol_is_named_and_nothing_is_patched(clean_install, monkeypatch,
                                                                   site):
    """Deleted from the class (or module) that defines it, and only there: a base class
    that still provides an attribute of that name does not stand in for it (e.g. 0.16's
    TorchDistSaveShardedStrategy.async_save deleted, its abstract parent's left: install()
    must not patch the parent's method onto the strategy as if it were its own)."""
    owner, attr, text = dict(SITES)[site]
    assert attr in vars(owner), f"{site}: not defined where the patch says upstream does"
    before = _snapshot()
    monkeypatch.delattr(owner, attr)
    with pytest.raises(UnsupportedVersionError) as err:
        clean_install.install(ALL_FEATURES)
    assert text in str(err.value) and "nothing was patched" in str(err.value)
    # the releases the refusal is about: the torch whose internals a patch reads, too
    assert f"megatron-core {version('megatron-core')}, torch {version('torch')}:" \
        in str(err.value)
    if isinstance(owner, type) and hasattr(owner, attr):  # a base still provides it
        assert "through the MRO" in str(err.value)
    assert clean_install.installed() == {}
    monkeypatch.undo()
    assert _untouched(before)


def _fresh_wrapper():
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper)
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    return FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy("torch_dist", 1), None)


needs_pg_cache = pytest.mark.skipif(not hasattr(_fresh_wrapper(), "pg_cache_path"),
                                    reason="this megatron-core has no pg_cache_path (< 0.20)")


@pytest.mark.parametrize("strategy, attr", [
    ("torch:TorchDistSaveShardedStrategy", "use_cached_ckpt_structure"),
    ("torch:TorchDistSaveShardedStrategy", "cached_local_plan"),
    ("torch:TorchDistSaveShardedStrategy", "cached_central_plan"),
    ("torch:TorchDistSaveShardedStrategy", "cached_global_metadata"),
    ("torch:TorchDistSaveShardedStrategy", "validated_cache_reuse"),
    ("torch:TorchDistSaveShardedStrategy", "validated_loaded_metadata_reuse"),
    ("fully_parallel:FullyParallelSaveStrategyWrapper", "do_cache_distribution"),
    ("fully_parallel:FullyParallelSaveStrategyWrapper", "cached_distribution"),
    # megatron-core >= 0.20's distribution memo: renamed, a setting is an unknown cache
    ("fully_parallel:FullyParallelSaveStrategyWrapper", "pg_cache_path"),
    ("fully_parallel:FullyParallelSaveStrategyWrapper", "pg_cache_create"),
])
def test_a_renamed_strategy_attribute_is_refused(clean_install, monkeypatch, strategy, attr):
    """A renamed cache attribute would make the structure fix skip a cache layer silently."""
    later = attr in cached_save.DISTRIBUTION_CACHES.later | cached_save.PLAN_CACHES.later
    if later and not hasattr(_fresh_wrapper(), attr):
        pytest.skip(f"this megatron-core has no {attr}")
    cls = resolve(f"megatron.core.dist_checkpointing.strategies.{strategy}")
    original_init = cls.__init__

    def renamed_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        setattr(self, f"{attr}_v2", vars(self).pop(attr))

    monkeypatch.setattr(cls, "__init__", renamed_init)
    before = _snapshot()
    with pytest.raises(UnsupportedVersionError) as err:
        clean_install.install(["structure"])
    assert later or f"no attribute {attr!r}" in str(err.value)
    if "cache" in attr or attr.startswith("validated"):
        assert f"attribute '{attr}_v2', which looks like a cache" in str(err.value)
    assert _untouched(before)


@needs_pg_cache
@pytest.mark.parametrize("symbol", cached_save._PG_CACHE_READS)
def test_the_distribution_memo_is_required_where_the_wrapper_has_a_cache_path(
        clean_install, monkeypatch, symbol):
    """What the reset of megatron-core >= 0.20's memo reads is checked like any symbol."""
    module, _, name = symbol.partition(":")
    before = _snapshot()
    monkeypatch.delattr(resolve(module), name)
    with pytest.raises(UnsupportedVersionError) as err:
        clean_install.install(["structure"])
    assert symbol in str(err.value) and "nothing was patched" in str(err.value)
    monkeypatch.undo()
    assert _untouched(before)


def test_install_is_all_or_nothing_when_applying_fails(clean_install, monkeypatch):
    """A patch whose build raises (after earlier ones were applied) rolls every one back."""
    before = _snapshot()
    core = [f for f in FEATURES if f in ALL_FEATURES]
    last = _declared(core)[-1]

    def broken(_original):
        raise RuntimeError("cannot build")

    failing = Patch(name=last.name, target=last.target, attr=last.attr, build=broken,
                    why=last.why, not_needed=None)
    module = resolve(f"megatron_ckpt_fixes.{BY_NAME[core[-1]].module}")
    monkeypatch.setattr(module, "PATCHES", (*module.PATCHES[:-1], failing))
    with pytest.raises(RuntimeError, match="cannot build"):
        clean_install.install(ALL_FEATURES)
    assert clean_install.installed() == {}
    assert _untouched(before)


def test_restore_of_inherited_attribute_deletes_override():
    class Base:
        def f(self):
            return "base"

    class Child(Base):
        pass

    mod = types.ModuleType("mcf_test_mod")
    mod.Base, mod.Child = Base, Child
    sys.modules["mcf_test_mod"] = mod
    try:
        ps = PatchSet()
        with pytest.raises(UnsupportedVersionError, match=r"no longer defined on Child \(found "
                                                          r"on Base"):
            ps.install([Patch("t.f", "mcf_test_mod:Child", "f",
                              lambda orig: lambda self: "patched", why="test")])
        ps.install([Patch("t.f", "mcf_test_mod:Child", "f", lambda orig: lambda self: "patched",
                          why="test", inherits_from=("mcf_test_mod:Base",))])
        assert Child().f() == "patched"
        ps.restore_all()
        assert _raw(Child, "f") is _MISSING and Child().f() == "base"
    finally:
        del sys.modules["mcf_test_mod"]


def test_each_upstream_attribute_is_patched_by_one_patch(clean_install):
    """Features that wrap the same attribute do so as layers of one entry point: one patch
    per attribute, one wrapper over upstream's original (no wrapper of a wrapper)."""
    shared = [p for p in _declared() if isinstance(p, Layer)]
    entries = {p.entry for p in shared}
    upstream = {e: getattr(resolve(e.target), e.attr, None) for e in entries}
    clean_install.install(ALL_FEATURES)
    patched = megatron_ckpt_fixes._patches.patched()
    assert len(patched) == len(set(patched)), sorted(p for p in patched if patched.count(p) > 1)
    for entry, original in upstream.items():
        if original is not None:  # one wrapper, directly over upstream's
            assert getattr(resolve(entry.target), entry.attr).__wrapped__ is original
    assert len(upstream) == 3 and any(o is not None for o in upstream.values())
    assert {p.entry.name for p in shared} == {"entry.write_item", "entry.writer_finish",
                                              "entry.write_buckets"}
    own = {(p.target, p.attr) for p in _declared() if isinstance(p, Patch)}
    assert not own & {(p.target, p.attr) for p in shared}


def test_layers_run_in_the_declared_order_whatever_the_install_order():
    """The trivial wrong design (each feature wraps whatever is there) makes the order the
    order of install() calls: here b is installed first and must still run inside a."""
    calls: list[str] = []
    mod = types.ModuleType("mcf_test_entry")
    mod.f = lambda x: calls.append("upstream") or x
    original = mod.f
    sys.modules["mcf_test_entry"] = mod
    entry = EntryPoint("entry.f", "mcf_test_entry", "f", layers=("t.a", "t.b"))

    def layer(name):
        def build(inner):
            return lambda x: calls.append(name) or inner(x + 1)
        return Layer(name, entry, build, why="test")

    try:
        ps = PatchSet()
        ps.install([layer("t.b")])
        ps.install([layer("t.a")])
        assert mod.f(0) == 2 and calls == ["t.a", "t.b", "upstream"]
        assert ps.patched() == [("mcf_test_entry", "f")] and ps.names() == ["t.b", "t.a"]
        ps._restore(["t.a"])
        calls.clear()
        assert mod.f(0) == 1 and calls == ["t.b", "upstream"]
        with pytest.raises(ValueError, match="not in the declared order"):
            ps.install([layer("t.c")])
        ps.restore_all()
        assert mod.f is original and ps.patched() == []
    finally:
        del sys.modules["mcf_test_entry"]


def test_optional_patch_with_missing_symbol_is_reported_not_applied():
    mod = types.ModuleType("mcf_test_opt")
    sys.modules["mcf_test_opt"] = mod
    try:
        ps = PatchSet()
        applied = ps.install([Patch("t.g", "mcf_test_opt", "g", lambda orig: orig, why="test",
                                    optional=True)])
        assert applied == [] and ps.describe()["t.g"].startswith("not applied: optional")
        with pytest.raises(UnsupportedVersionError, match=r"mcf_test_opt\.g not found"):
            ps.install([Patch("t.h", "mcf_test_opt", "g", lambda orig: orig, why="test")])
    finally:
        del sys.modules["mcf_test_opt"]


def test_alias_that_no_longer_holds_the_original_is_refused(clean_install, monkeypatch):
    """A module that stopped importing the patched function by name (or imports another
    object now) would keep calling the unpatched one."""
    import megatron.core.dist_checkpointing.state_dict_utils as sdu

    monkeypatch.setattr(sdu, "validate_sharding_integrity", lambda *a, **k: None)
    with pytest.raises(UnsupportedVersionError, match="state_dict_utils.validate_sharding_"
                                                      "integrity is no longer the object"):
        clean_install.install(["structure"])


# -- upstream behaviour, not version numbers ------------------------------------------------

def test_sentinel_decision_does_not_read_the_version(clean_install, monkeypatch):
    """The decision follows what upstream's state machine does, whatever version it claims."""
    from megatron_ckpt_fixes.fixes.rerun.sentinel import upstream_emits_sentinel

    expected = upstream_emits_sentinel() is None
    for claimed in ("0.16.1", "0.19.2"):
        monkeypatch.setattr(versions, "mcore_version", lambda c=claimed: Version(c))
        clean_install.uninstall()
        assert ("rerun.sentinel.state_dict" in clean_install.install()) == expected


def test_cpu_standin_only_where_collectives_are_not_on_cuda(clean_install, monkeypatch):
    """On a CUDA process (NCCL or no group yet) megatron-core keeps the real torch object."""
    from megatron.core.dist_checkpointing.strategies import async_utils, state_dict_saver

    from megatron_ckpt_fixes.compat.device import BackendAwareTorch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    clean_install.install()
    assert async_utils.torch is torch and state_dict_saver.torch is torch
    assert clean_install.installed()["compat.cpu.async_utils"].startswith("not applied")
    clean_install.uninstall()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    clean_install.install()
    assert isinstance(async_utils.torch, BackendAwareTorch)
    assert isinstance(state_dict_saver.torch, BackendAwareTorch)


def test_load_failures_are_attributed_to_the_rank_that_failed():
    from megatron_ckpt_fixes.fixes.load_errors import attribute

    gathered = {0: "missing a/shard_0_2", 1: "missing a/shard_1_2"}
    assert attribute({0: gathered, 1: dict(gathered)}) == gathered  # collective load (0.16)
    local = {0: {0: "missing a/shard_0_2"}, 1: {0: "missing a/shard_1_2"}}
    assert attribute(local) == gathered  # rank-local loads (0.19, no_dist)
    assert attribute({1: {0: "missing b"}}) == {1: "missing b"}  # only rank 1 failed


def test_optional_features_only_when_named(clean_install):
    default = clean_install.install()
    assert not any(n.startswith("training.cpu_support") for n in default)
    added = clean_install.install(list(OPTIONAL_FEATURES))
    assert set(default) < set(added)
    assert any(n.startswith("training.cpu_support") for n in added)


def test_probes_enter_no_collective_and_keep_the_groups_rank(single_rank_group, clean_install,
                                                             monkeypatch):
    """install() may run on one rank while the others train (an import that applies a
    system's features): a probe's rehearsal must never enter a collective, even where
    compat.cpu already lets megatron-core's finalize reach its broadcast on CPU, and with a
    process group the group's rank answers (nothing stands in for get_rank)."""
    import torch.distributed as dist

    clean_install.install(["compat.cpu"])
    entered: list[str] = []
    for name in ("broadcast", "all_reduce", "all_gather", "all_gather_object", "barrier",
                 "broadcast_object_list", "gather_object", "reduce_scatter", "all_to_all"):
        monkeypatch.setattr(dist, name, lambda *args, _name=name, **kwargs: entered.append(_name))
    get_rank = dist.get_rank
    clean_install.install(ALL_FEATURES)
    assert entered == [] and dist.get_rank is get_rank
