"""Version gates: which megatron-core releases the patches know how to fix."""

from __future__ import annotations

from functools import lru_cache
from importlib.metadata import PackageNotFoundError, version

from packaging.specifiers import SpecifierSet
from packaging.version import Version

#: Releases whose checkpoint internals the patches were written against and tested with
#: (0.16.1 in CI, 0.19.2 by hand). Outside this range internals may have moved: refuse loudly.
SUPPORTED_MCORE = SpecifierSet(">=0.16,<0.20")


class UnsupportedVersionError(RuntimeError):
    """The installed megatron-core is outside the range these patches support."""


@lru_cache(maxsize=None)
def mcore_version() -> Version:
    try:
        return Version(version("megatron-core"))
    except PackageNotFoundError as exc:  # pragma: no cover - depends on the environment
        raise UnsupportedVersionError(
            "megatron-core is not installed; megatron_ckpt_fixes.install() patches it"
        ) from exc


def check_supported(mcore: Version | None = None) -> Version:
    """Raise :class:`UnsupportedVersionError` unless megatron-core is in ``SUPPORTED_MCORE``."""
    found = mcore if mcore is not None else mcore_version()
    if Version(found.base_version) not in SUPPORTED_MCORE:
        raise UnsupportedVersionError(
            f"megatron-core {found} is not supported by megatron_ckpt_fixes "
            f"(supported: {SUPPORTED_MCORE}); the checkpoint internals it patches may differ"
        )
    return found
