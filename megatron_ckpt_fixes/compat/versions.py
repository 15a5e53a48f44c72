"""The megatron-core releases the fixes are tested with.

What a release *does* is detected from its behaviour and its symbols (see
:mod:`megatron_ckpt_fixes.core.patching`); this range only says which releases the fixes have
been run against (0.16.1, 0.19.2 and 0.20.0, built from Megatron-LM main, in CI; 0.17.1
and 0.18.2 by the detection tests).
"""

from __future__ import annotations

from functools import lru_cache
from importlib.metadata import PackageNotFoundError, version

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from megatron_ckpt_fixes.core.errors import UnsupportedVersionError

#: Releases whose checkpoint internals the patches were written against and tested with.
SUPPORTED_MCORE = SpecifierSet(">=0.16,<0.21")


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
