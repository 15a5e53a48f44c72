"""install() is idempotent and version-aware; uninstall() restores the exact originals."""

from __future__ import annotations

import pytest
from packaging.version import Version

import megatron_ckpt_fixes
from megatron_ckpt_fixes import FEATURES, UnsupportedVersionError
from megatron_ckpt_fixes._patching import _MISSING, _raw, resolve
from megatron_ckpt_fixes.compat import versions


def _declared():
    return megatron_ckpt_fixes._declared(FEATURES)


def _snapshot():
    """The raw attribute objects every declared patch touches (aliases included)."""
    snap = {}
    for patch in _declared():
        for owner_name in (patch.target, *patch.aliases):
            owner = resolve(owner_name)
            snap[(owner_name, patch.attr)] = _raw(owner, patch.attr)
    return snap


def test_install_uninstall_restores_exact_originals(clean_install):
    before = _snapshot()
    names = clean_install.install()
    assert names and set(names) == set(clean_install.installed())
    changed = {k for k, v in _snapshot().items() if v is not before[k]}
    assert changed, "install() patched nothing"
    clean_install.uninstall()
    after = _snapshot()
    assert all(after[k] is before[k] for k in before)
    assert clean_install.installed() == {}


def test_install_is_idempotent(clean_install):
    first = clean_install.install()
    snap = _snapshot()
    assert clean_install.install() == first
    assert all(v is snap[k] for k, v in _snapshot().items())


def test_features_select_patches(clean_install):
    names = clean_install.install(["cpu"])
    assert names and all(n.startswith("cpu.") for n in names)
    with pytest.raises(ValueError, match="unknown features"):
        clean_install.install(["no-such-feature"])


def test_every_patch_names_why_it_exists(clean_install):
    clean_install.install()
    assert all(why for why in clean_install.installed().values())


@pytest.mark.parametrize("found", ["0.15.3", "0.20.0", "1.0.0"])
def test_unsupported_megatron_core_is_refused_before_patching(clean_install, monkeypatch, found):
    monkeypatch.setattr(versions, "mcore_version", lambda: Version(found))
    before = _snapshot()
    with pytest.raises(UnsupportedVersionError, match=found):
        clean_install.install()
    assert clean_install.installed() == {}
    assert all(v is before[k] for k, v in _snapshot().items())


def test_sentinel_patch_only_where_upstream_lacks_it(clean_install, monkeypatch):
    monkeypatch.setattr(versions, "mcore_version", lambda: Version("0.19.2"))
    names = clean_install.install()
    assert "rerun.sentinel" not in names
    clean_install.uninstall()
    monkeypatch.setattr(versions, "mcore_version", lambda: Version("0.16.1"))
    assert "rerun.sentinel" in clean_install.install()


def test_restore_of_inherited_attribute_deletes_override():
    from megatron_ckpt_fixes._patching import Patch, PatchSet

    class Base:
        def f(self):
            return "base"

    class Child(Base):
        pass

    import types
    import sys

    mod = types.ModuleType("mcf_test_mod")
    mod.Child = Child
    sys.modules["mcf_test_mod"] = mod
    try:
        ps = PatchSet()
        ps.apply(Patch("t", "mcf_test_mod:Child", "f", lambda orig: lambda self: "patched"))
        assert Child().f() == "patched"
        ps.restore_all()
        assert _raw(Child, "f") is _MISSING and Child().f() == "base"
    finally:
        del sys.modules["mcf_test_mod"]


def test_load_failures_are_attributed_to_the_rank_that_failed():
    from megatron_ckpt_fixes.load_errors import attribute

    gathered = {0: "missing a/shard_0_2", 1: "missing a/shard_1_2"}
    assert attribute({0: gathered, 1: dict(gathered)}) == gathered  # collective load (0.16)
    local = {0: {0: "missing a/shard_0_2"}, 1: {0: "missing a/shard_1_2"}}
    assert attribute(local) == gathered  # rank-local loads (0.19, no_dist)
    assert attribute({1: {0: "missing b"}}) == {1: "missing b"}  # only rank 1 failed


def test_optional_features_only_when_named(clean_install):
    from megatron_ckpt_fixes import OPTIONAL_FEATURES

    default = clean_install.install()
    assert not any(n.startswith("training-cpu") for n in default)
    added = clean_install.install(list(OPTIONAL_FEATURES))
    assert set(default) < set(added) and any(n.startswith("training-cpu") for n in added)
