"""The ranks' fork server preloads modules that exist: ``set_forkserver_preload`` skips a
name it cannot import without a word, and each rank then imports it itself (a few tenths of
a second per rank, on every multi-rank test)."""

from __future__ import annotations

import importlib.util

from megatron_ckpt_fixes._dev import testing


def test_every_preloaded_module_exists():
    names = [*testing.PRELOAD, *testing.PRELOAD_MEGATRON, *testing._feature_modules()]
    assert len(names) > len(testing.PRELOAD) + len(testing.PRELOAD_MEGATRON)
    assert [n for n in names if importlib.util.find_spec(n) is None] == []
