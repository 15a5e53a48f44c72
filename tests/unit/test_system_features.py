"""Features of other systems (MLite, NeMo Automodel, TorchEasyRec) wait for their import.

A user calls ``install()`` (or sets the activation switch) long before the training code
imports MLite or tzrec, and often in processes that never import them. The contract: applied
at once where the system is already imported; right after its first import where it is
installed, before the importer binds any name from it; never where it is not installed
(``installed()`` says so); all or nothing per system, loudly at that import; no megatron-core
version check for such a feature; nothing left waiting after ``uninstall()``.

The system here is a package written into ``tmp_path`` and the feature a module registered
for the test, so the mechanism is tested without any real system installed (the features of
the real systems have their own tests through the real code).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import subprocess
import sys
import types
from itertools import count

import pytest

import megatron_ckpt_fixes
from megatron_ckpt_fixes.core import after_import as _after_import
from megatron_ckpt_fixes.core.patching import Patch
from megatron_ckpt_fixes.activation import arm, by_system, disarm
from megatron_ckpt_fixes.core.errors import UnsupportedVersionError
from megatron_ckpt_fixes.core.features import BY_NAME, FIX, Feature

_names = count()


@pytest.fixture
def system(tmp_path, monkeypatch, clean_install):
    """A fresh installable package ``mcf_fake_sys_N`` with ``api.answer() == 1``, and a
    feature ``fake_sys_N`` whose patch makes it return 2 (``reads`` a symbol the test may
    remove). Yields (package name, feature name)."""
    n = next(_names)
    package, feature = f"mcf_fake_sys_{n}", f"fake_sys_{n}"
    root = tmp_path / package
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "api.py").write_text("def answer():\n    return 1\n\nNEEDED = True\n")
    (tmp_path / f"{package}_user.py").write_text(
        f"from {package}.api import answer\n")  # binds the name at its import
    monkeypatch.syspath_prepend(str(tmp_path))
    module = types.ModuleType(f"megatron_ckpt_fixes.{feature}")
    module.PATCHES = (Patch(name=f"{feature}.answer", target=f"{package}.api", attr="answer",
                            build=lambda original: lambda: 2, why="the test's fix",
                            reads=(f"{package}.api:NEEDED",)),)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    registered = Feature(feature, feature, FIX, system=package)
    monkeypatch.setattr(megatron_ckpt_fixes, "REGISTRY",
                        (*megatron_ckpt_fixes.REGISTRY, registered))
    monkeypatch.setitem(BY_NAME, feature, registered)
    monkeypatch.setattr(megatron_ckpt_fixes, "FEATURES",
                        (*megatron_ckpt_fixes.FEATURES, feature))
    monkeypatch.setitem(megatron_ckpt_fixes.SYSTEMS, feature, package)
    yield package, feature
    disarm()
    for name in [m for m in sys.modules if m.startswith(package)]:
        del sys.modules[name]


def _answer_as_imported(package: str) -> int:
    return importlib.import_module(f"{package}_user").answer()


def test_installed_not_imported_waits_and_applies_at_the_first_import(system):
    package, feature = system
    megatron_ckpt_fixes.install([feature])
    assert package not in sys.modules  # install() imported nothing of it
    assert megatron_ckpt_fixes.installed() == {
        f"{feature}.answer": f"waiting: applied when {package} is first imported"}
    assert _answer_as_imported(package) == 2  # the importer bound the fixed function
    assert megatron_ckpt_fixes.installed() == {f"{feature}.answer": "the test's fix"}
    assert _after_import.pending() == {}
    megatron_ckpt_fixes.uninstall()
    assert importlib.import_module(f"{package}.api").answer() == 1


def test_a_probe_before_the_import_leaves_the_fix_waiting(system):
    """``importlib.util.find_spec`` (how libraries ask whether a package is installed, e.g.
    transformers' availability checks) imports nothing: the fix must still come with the
    import that follows. Before, the probe took the callbacks and the import got none."""
    package, feature = system
    megatron_ckpt_fixes.install([feature])
    assert importlib.util.find_spec(package) is not None
    assert package not in sys.modules and _after_import.pending() == {package: 1}
    assert _answer_as_imported(package) == 2
    assert _after_import.pending() == {}


def test_already_imported_is_applied_at_once(system):
    package, feature = system
    api = importlib.import_module(f"{package}.api")
    assert megatron_ckpt_fixes.install([feature]) == [f"{feature}.answer"]
    assert api.answer() == 2


def test_not_installed_is_skipped_and_says_so(system, monkeypatch):
    package, feature = system
    monkeypatch.setitem(megatron_ckpt_fixes.SYSTEMS, feature, "mcf_no_such_system")
    assert megatron_ckpt_fixes.install([feature]) == []
    assert megatron_ckpt_fixes.installed() == {
        f"{feature}.answer": "not applied: mcf_no_such_system is not installed"}
    assert _after_import.pending() == {}


def test_a_missing_symbol_fails_that_import_and_patches_nothing(system):
    package, feature = system
    api = importlib.import_module(f"{package}.api")  # edit the source before the real import
    source = api.__file__
    del sys.modules[f"{package}.api"], sys.modules[package]
    with open(source, "w") as f:
        f.write("def answer():\n    return 1\n")  # NEEDED is gone
    importlib.invalidate_caches()
    megatron_ckpt_fixes.install([feature])
    with pytest.raises(UnsupportedVersionError, match=rf"{package}.api:NEEDED not found"):
        importlib.import_module(f"{package}.api")
    assert megatron_ckpt_fixes.installed() == {f"{feature}.answer": (
        f"not applied: refused when {package} was imported (UnsupportedVersionError)")}


def test_uninstall_before_the_import_leaves_nothing_waiting(system):
    package, feature = system
    megatron_ckpt_fixes.install([feature])
    megatron_ckpt_fixes.uninstall()
    assert _after_import.pending() == {} and megatron_ckpt_fixes.installed() == {}
    assert _answer_as_imported(package) == 1


def test_no_megatron_core_version_check_for_a_system_feature(system, monkeypatch):
    package, feature = system

    def unsupported():
        raise UnsupportedVersionError("megatron-core 9.9 is not supported")

    monkeypatch.setattr(megatron_ckpt_fixes, "check_supported", unsupported)
    megatron_ckpt_fixes.install([feature])
    assert _answer_as_imported(package) == 2
    with pytest.raises(UnsupportedVersionError):
        megatron_ckpt_fixes.install(["structure"])


def test_the_activation_waits_per_system(system):
    package, feature = system
    assert by_system(["structure", feature, "checksums"]) == {
        "megatron.core": ("structure", "checksums"), package: (feature,)}
    arm(feature)
    assert _after_import.pending() == {package: 1}
    assert _answer_as_imported(package) == 2
    assert _after_import.pending() == {}


def test_the_default_install_works_where_no_system_is_installed():
    """The users of megatron-core alone: every system feature's module imports without its
    system (its patches are declared all the same) and install() names each as not installed.
    (dtensor.nemo_automodel once read NeMo Automodel's source at import: every install()
    without NeMo Automodel raised ImportError.)"""
    systems = sorted(set(megatron_ckpt_fixes.SYSTEMS.values()))
    probe = ("import json, sys\n"
             f"for name in {systems!r}:\n"
             "    sys.modules[name] = None  # as if not installed\n"
             "import megatron_ckpt_fixes as m\n"
             "m.install()\n"
             "print(json.dumps(m.installed()))\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=300, cwd="/")
    assert done.returncode == 0, done.stderr[-3000:]
    installed = json.loads(done.stdout.splitlines()[-1])
    for feature, system in megatron_ckpt_fixes.SYSTEMS.items():
        mine = {k: v for k, v in installed.items() if k.startswith(f"{feature}.")}
        assert mine and set(mine.values()) == {f"not applied: {system} is not installed"}, mine
    assert any(k.startswith("structure.") and not v.startswith("not applied")
               for k, v in installed.items())
