"""verify finds what would stop a checkpoint from loading, from the files alone."""

from __future__ import annotations

import os

import torch
import torch.distributed.checkpoint as dcp

from megatron_ckpt_fixes.cli import main


def _save(path) -> None:
    dcp.save({"w": torch.arange(12.0).reshape(3, 4), "obj": {"step": 3}}, checkpoint_id=str(path))


def test_verify_accepts_a_complete_checkpoint(single_rank_group, tmp_path, capsys):
    _save(tmp_path / "ok")
    assert main(["verify", str(tmp_path / "ok")]) == 0
    assert "OK" in capsys.readouterr().out
    assert main(["inspect", str(tmp_path / "ok")]) == 0
    assert "w  tensor (3, 4) torch.float32" in capsys.readouterr().out


def test_verify_reports_missing_and_truncated_files(single_rank_group, tmp_path, capsys):
    _save(tmp_path / "bad")
    data = [f for f in os.listdir(tmp_path / "bad") if f.endswith(".distcp")]
    with open(tmp_path / "bad" / data[0], "r+b") as f:
        f.truncate(8)
    assert main(["verify", str(tmp_path / "bad")]) == 1
    out = capsys.readouterr().out
    assert "PROBLEM w:" in out and "ends at 8 bytes" in out
    os.remove(tmp_path / "bad" / data[0])
    assert main(["verify", str(tmp_path / "bad")]) == 1
    assert "is missing" in capsys.readouterr().out


def test_verify_reports_uncovered_chunks(single_rank_group, tmp_path, capsys):
    _save(tmp_path / "gap")
    reader = dcp.FileSystemReader(str(tmp_path / "gap"))
    md = reader.read_metadata()
    md.state_dict_metadata["w"].size = torch.Size([4, 4])  # one row no chunk covers
    from megatron_ckpt_fixes.cli import verify

    problems = verify(md, str(tmp_path / "gap"))
    assert [str(p) for p in problems] == ["w: chunks cover 12 of 16 elements"]
