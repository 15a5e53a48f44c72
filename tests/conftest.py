"""Shared fixtures (an in-process world-size-1 gloo group for single-process tests) and the
selection of tests by what is new on a CI leg (:data:`NEW_ENV`, the ``varies_with`` marker)."""

from __future__ import annotations

import ast
import datetime
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch.distributed as dist

from megatron_ckpt_fixes._dev.testing import init_test_group

# Spawned ranks import helper modules that live beside the tests.
sys.path.insert(0, str(Path(__file__).parent / "functional"))


@pytest.fixture
def single_rank_group(tmp_path):
    """A real gloo process group of one rank (megatron-core code asks for rank/world size);
    another backend where ``MCF_TEST_BACKEND`` names one (scripts/gpu_check.sh)."""
    init_test_group(0, 1, f"file://{tmp_path / 'rdzv'}", datetime.timedelta(seconds=30))
    yield
    dist.destroy_process_group()


@pytest.fixture
def clean_install():
    """Leave the process without patches, whatever a test installed."""
    import megatron_ckpt_fixes

    megatron_ckpt_fixes.uninstall()
    yield megatron_ckpt_fixes
    megatron_ckpt_fixes.uninstall()


@pytest.fixture(scope="session")
def beside(tmp_path_factory):
    """``beside("pkg==1.2")``: the environment for a subprocess that sees only that package
    from a directory of its own (``pip install --no-deps --target``, from the package registry)
    first on PYTHONPATH, everything else from this environment; one download per session and
    spec."""
    root = tmp_path_factory.mktemp("beside")
    made: dict[str, Path] = {}

    def env(spec: str) -> dict[str, str]:
        if spec not in made:
            target = root / spec.replace("=", "_")
            subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                            "--ignore-requires-python", "--target", str(target), spec],
                           check=True, timeout=600)
            made[spec] = target
        return {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(made[spec]), *filter(None, [os.environ.get("PYTHONPATH")])])}

    return env


#: What a CI leg runs that no earlier leg ran: a comma-separated list of :data:`COMPONENTS`
#: (``.ci/run`` sets it per leg). Unset: everything is new, every test runs.
NEW_ENV = "MCF_CI_NEW"
#: What can change a test's outcome: the megatron-core release, torch, Python, and the
#: optional systems (tests/optional_systems.py).
COMPONENTS = frozenset({"megatron-core", "torch", "python", "torchrec", "tzrec",
                        "nemo_automodel", "mlite"})
#: The optional systems a CI leg does not install (``.ci/run``): the tests that vary with one
#: of them are left to the legs that have it, and the run's summary names them.
WITHOUT_ENV = "MCF_CI_WITHOUT"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "varies_with(*components): the only components whose version can change "
        f"this test's outcome (of {sorted(COMPONENTS)}); a test runs on every CI leg where one "
        "of them is new. Without the marker a test varies with everything and runs on every "
        "leg; with no component it runs once, on the first leg.")


def _checked(components: tuple, where: str) -> frozenset[str]:
    unknown = set(components) - COMPONENTS
    if unknown:
        raise pytest.UsageError(f"{where}: varies_with names {sorted(unknown)}; "
                                f"known: {sorted(COMPONENTS)}")
    return frozenset(components)


def _listed(variable: str) -> frozenset[str] | None:
    """The components a variable lists; None where it is unset."""
    value = os.environ.get(variable, "").strip()
    if not value:
        return None
    return _checked(tuple(filter(None, (v.strip() for v in value.split(",")))), variable)


@dataclass(frozen=True)
class Leg:
    """What a CI leg names: the components new on it, the systems it does not install."""

    new: frozenset[str]
    without: frozenset[str]

    def runs(self, declared: frozenset[str] | None) -> bool:
        """Whether a test that declared ``declared`` (None: no marker, it varies with
        everything) runs here: something it varies with is new, and it names no system the
        leg lacks."""
        return declared is None or bool(declared & self.new) and not declared & self.without


def _leg() -> Leg | None:
    """This leg, from :data:`NEW_ENV` and :data:`WITHOUT_ENV`; None where :data:`NEW_ENV` is
    unset (everything is new: every test runs)."""
    new = _listed(NEW_ENV)
    return None if new is None else Leg(new, _listed(WITHOUT_ENV) or frozenset())


def _module_varies_with(path: Path) -> frozenset[str] | None:
    """A module's own ``pytestmark = pytest.mark.varies_with(...)``, read from its source
    without importing it (a module whose tests are all proven elsewhere is not even imported:
    its optional system need not be installed on this leg); None where it has none."""
    for node in ast.parse(path.read_text()).body:
        if (isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark"
                                                 for t in node.targets)
                and isinstance(node.value, ast.Call)
                and ast.unparse(node.value.func) == "pytest.mark.varies_with"):
            return _checked(tuple(ast.literal_eval(a) for a in node.value.args), str(path))
    return None


def _proven_elsewhere(path: Path, leg: Leg) -> bool:
    """A test module whose own marker names nothing new on ``leg``, or a system it lacks."""
    if path.suffix != ".py" or not path.name.startswith("test_"):
        return False
    varies = _module_varies_with(path)
    return varies is not None and not leg.runs(varies)


def pytest_ignore_collect(collection_path: Path, config):
    """On a leg that names what is new, a test module whose own marker names none of it, or
    names a system the leg does not install, is not collected (an earlier leg ran it)."""
    leg = _leg()
    return True if leg is not None and _proven_elsewhere(collection_path, leg) else None


def pytest_collection_modifyitems(config, items):
    """On a leg that names what is new, deselect each test that varies with none of it."""
    leg = _leg()
    if leg is None:
        return
    keep, proven = [], []
    for item in items:
        marker = item.get_closest_marker("varies_with")
        declared = None if marker is None else _checked(marker.args, item.nodeid)
        (keep if leg.runs(declared) else proven).append(item)
    if proven:
        config.hook.pytest_deselected(items=proven)
        items[:] = keep


def pytest_terminal_summary(terminalreporter, config):
    """Names the modules the leg did not collect. Found again from the paths pytest was given,
    not from the collection: with ``-n`` the workers collect, and the summary is the main
    process's."""
    leg = _leg()
    if leg is None:
        return
    paths = [Path(config.rootpath, arg.split("::")[0]) for arg in config.args]
    found = [p for arg in paths
             for p in ([arg] if arg.is_file() else sorted(arg.rglob("test_*.py")))]
    modules = [p.name for p in found if _proven_elsewhere(p, leg)]
    if modules:
        terminalreporter.write_line(
            f"{NEW_ENV}={os.environ[NEW_ENV]} {WITHOUT_ENV}={os.environ.get(WITHOUT_ENV, '')}: "
            f"{len(modules)} test modules vary with nothing new here, or with a system this "
            f"leg does not install, and were not collected (other legs run them: .ci/run): "
            f"{' '.join(sorted(modules))}")
