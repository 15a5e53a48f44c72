"""scripts/demo_fault_resume.py: a fresh folder per run, never someone's files, one last line.

The demo itself (two 2-rank jobs, about 2 minutes) is not run here: these are its options and
its summary line, which need neither torch nor megatron-core.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from script_modules import script_module

pytestmark = pytest.mark.varies_with()


@pytest.fixture(scope="module")
def demo():
    with script_module("demo_fault_resume") as module:
        yield module


def test_every_run_gets_a_new_empty_folder(demo):
    first, second = demo.parse_args([]).out, demo.parse_args([]).out
    try:
        assert first != second
        for out in (first, second):
            assert out.is_dir() and not any(out.iterdir())
            assert out.parent == Path(tempfile.gettempdir())
            assert out.name != "megatron_ckpt_fixes_demo"  # the old fixed folder
    finally:
        first.rmdir()
        second.rmdir()


def test_out_is_created_or_must_be_empty(demo, tmp_path, capsys):
    new = tmp_path / "a" / "demo"
    assert demo.parse_args(["--out", str(new)]).out == new and new.is_dir()
    (new / "keep.txt").write_text("someone's file")
    with pytest.raises(SystemExit) as exit_:
        demo.parse_args(["--out", str(new)])
    assert exit_.value.code == 2
    assert "not an empty folder" in capsys.readouterr().err
    assert (new / "keep.txt").read_text() == "someone's file"


def test_the_last_line_sums_up_and_names_the_folder(demo, tmp_path):
    parts = {"part 1 (fault)": True, "part 2 (structure change)": True}
    line = demo.summary(parts, upstream=False, out=tmp_path)
    assert line.startswith("demo OK (with the fixes): ") and line.endswith(f"at {tmp_path}")
    assert "\n" not in line
    failed = demo.summary({**parts, "part 2 (structure change)": False}, True, tmp_path)
    assert failed.startswith("demo FAILED (plain megatron-core")
    assert "part 2 (structure change) UNEXPECTED" in failed
