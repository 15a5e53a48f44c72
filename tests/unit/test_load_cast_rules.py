"""Which casts at load lose nothing (loaded with one INFO line) and which round (refused)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_ckpt_fixes.fixes import load_casts

pytestmark = pytest.mark.varies_with("torch")

f32, bf16, f16, f64 = torch.float32, torch.bfloat16, torch.float16, torch.float64


@pytest.mark.parametrize("saved, target, exact", [
    (f32, bf16, False), (f32, f16, False), (f64, f32, False), (f16, bf16, False),
    (bf16, f16, False), (torch.int64, torch.int32, False), (f32, torch.int64, False),
    (torch.int64, f64, False), (torch.int16, bf16, False), (torch.uint8, torch.int8, False),
    (torch.int8, torch.uint8, False),
    (bf16, f32, True), (f16, f32, True), (f32, f64, True), (torch.int32, torch.int64, True),
    (torch.int32, f64, True), (torch.uint8, bf16, True), (torch.bool, torch.int8, True),
    (f32, f32, True),
])
def test_lossless(saved, target, exact):
    assert load_casts.lossless(saved, target) is exact


def _tensor(key: str, dtype: torch.dtype) -> SimpleNamespace:
    return SimpleNamespace(key=key, dtype=dtype)


def test_the_error_names_the_first_key_both_dtypes_the_count_and_the_switch(monkeypatch):
    monkeypatch.delenv(load_casts.ALLOW_ENV, raising=False)
    found = load_casts.casts([_tensor("a", bf16), _tensor("a", bf16), _tensor("b", f16),
                              _tensor("c", f64), _tensor("d", f32)],
                             {"a": f32, "b": f32, "c": f32, "d": f32})
    assert [c.key for c in found] == ["a", "b", "c"]  # one per key; "d" is no cast
    error = load_casts.lossy_cast_error(found)
    assert error == ("LossyCastError: 'a' saved as torch.float32, the template is "
                     "torch.bfloat16: loading would round its values (and 1 more key(s): "
                     "torch.float32 -> torch.bfloat16: 1 key(s), torch.float32 -> "
                     "torch.float16: 1 key(s)); load into a template of the saved dtype, or "
                     f"set {load_casts.ALLOW_ENV}=1 to cast on purpose")


def test_a_widening_or_an_allowed_cast_is_logged_not_refused(monkeypatch, caplog):
    caplog.set_level("INFO", logger=load_casts.__name__)
    assert load_casts.lossy_cast_error([load_casts.Cast("w", bf16, f32)]) is None
    monkeypatch.setenv(load_casts.ALLOW_ENV, "1")
    assert load_casts.lossy_cast_error([load_casts.Cast("w", f32, bf16)]) is None
    assert [r.levelname for r in caplog.records] == ["INFO", "WARNING"]
