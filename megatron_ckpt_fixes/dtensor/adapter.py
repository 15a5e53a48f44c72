"""A state-dict adapter base whose layout changes always carry their placements along.

Adapter authors declare key mappings as data (:class:`KeyMap`); the base class applies the
dim permutation and the split/concat through :mod:`.transpose`, so the placements, global
shape and stride of a DTensor follow every transpose. There is no place in a subclass where
a ``Shard(1)`` could be left behind after a ``transpose(1, 2)``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from megatron_ckpt_fixes.dtensor import transpose as tp
from megatron_ckpt_fixes.dtensor.errors import PlacementError

_FIELD = re.compile(r"\{(\w+)\}")


def _template_regex(template: str) -> re.Pattern[str]:
    """``"layers.{i}.w"`` -> a regex with a named group per ``{field}`` (no dots inside)."""
    parts = _FIELD.split(template)
    return re.compile("".join(re.escape(p) if n % 2 == 0 else f"(?P<{p}>[^.]+)"
                              for n, p in enumerate(parts)))


@dataclass(frozen=True)
class KeyMap:
    """One native key template <-> one or several HF key templates.

    ``perm``: the HF tensor is ``native.permute(perm)`` (``None``: same dim order). Several
    ``hf`` keys: the permuted native tensor is split into equal parts along ``split_dim``
    (an unsharded dim), e.g. a fused gate/up projection.
    """

    native: str
    hf: str | tuple[str, ...]
    perm: tuple[int, ...] | None = None
    split_dim: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.hf, str):
            object.__setattr__(self, "hf", (self.hf,))


class StateDictAdapter:
    """Native <-> HF state dicts by a table of :class:`KeyMap`; unmatched keys pass through.

    Subclasses set ``key_maps``; they override nothing else for layout changes.
    """

    key_maps: tuple[KeyMap, ...] = ()

    def to_hf(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        """Native -> HF. Tensors come back as views of the native ones where possible."""
        out: dict[str, Any] = {}
        for key, value in state_dict.items():
            hit = self._match(key, "native")
            if hit is None:
                out[key] = value
                continue
            km, fields = hit
            if km.perm is not None:
                value = tp.permute(value, km.perm, key)
            hf_keys = [t.format(**fields) for t in km.hf]
            if len(hf_keys) == 1:
                out[hf_keys[0]] = value
                continue
            size = value.shape[km.split_dim]
            if size % len(hf_keys):
                raise PlacementError(key, None, f"dim {km.split_dim} of size {size} does not "
                                                f"split into {len(hf_keys)} equal parts")
            parts = tp.split(value, [size // len(hf_keys)] * len(hf_keys), km.split_dim, key)
            out.update(zip(hf_keys, parts))
        return out

    def from_hf(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        """HF -> native: concat the parts, then apply the inverse permutation."""
        out: dict[str, Any] = {}
        for key, value in state_dict.items():
            hit = self._match(key, "hf")
            if hit is None:
                out[key] = value
                continue
            km, fields = hit
            native_key = km.native.format(**fields)
            if native_key in out:
                continue
            hf_keys = [t.format(**fields) for t in km.hf]
            missing = [k for k in hf_keys if k not in state_dict]
            if missing:
                raise PlacementError(native_key, None, f"HF keys {missing} missing for {key!r}")
            parts = [state_dict[k] for k in hf_keys]
            value = parts[0] if len(parts) == 1 else tp.cat(parts, km.split_dim, native_key)
            if km.perm is not None:
                inverse = tuple(sorted(range(len(km.perm)), key=lambda d: km.perm[d]))
                value = tp.permute(value, inverse, native_key)
            out[native_key] = value
        return out

    def _match(self, key: str, side: str) -> tuple[KeyMap, dict[str, str]] | None:
        for km in self.key_maps:
            templates = (km.native,) if side == "native" else km.hf
            for template in templates:
                m = _template_regex(template).fullmatch(key)
                if m:
                    return km, m.groupdict()
        return None

