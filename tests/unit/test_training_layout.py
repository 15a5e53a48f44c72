"""Megatron checkpoint layout: the tracker only ever names a published, complete directory."""

from __future__ import annotations

import pytest

from megatron_ckpt_fixes._dev.training import layout

pytestmark = pytest.mark.varies_with()


def _stage(root, iteration, payload):
    staging = layout.staging_dir(root, iteration)
    staging.mkdir(parents=True)
    (staging / "payload").write_text(payload)


def test_publish_renames_then_points_the_tracker(tmp_path):
    assert layout.read_tracker(tmp_path) is None
    _stage(tmp_path, 7, "a")
    assert layout.read_tracker(tmp_path) is None  # staged is not published
    layout.publish(tmp_path, 7)
    assert layout.read_tracker(tmp_path) == 7
    assert layout.tracker_path(tmp_path).read_text() == "7\n"
    assert (layout.iteration_dir(tmp_path, 7) / "payload").read_text() == "a"
    assert not layout.staging_dir(tmp_path, 7).exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no tmp left


def test_republishing_an_iteration_replaces_it(tmp_path):
    _stage(tmp_path, 3, "regular")
    layout.publish(tmp_path, 3)
    _stage(tmp_path, 3, "fault")
    layout.publish(tmp_path, 3)
    assert (layout.checkpoint_dir(tmp_path, 3) / "payload").read_text() == "fault"
    assert not layout.superseded_dir(tmp_path, 3).exists()


def test_crash_between_the_two_renames_falls_back_to_the_superseded_copy(tmp_path):
    _stage(tmp_path, 3, "regular")
    layout.publish(tmp_path, 3)
    layout.iteration_dir(tmp_path, 3).rename(layout.superseded_dir(tmp_path, 3))
    assert (layout.checkpoint_dir(tmp_path, 3) / "payload").read_text() == "regular"


def test_missing_checkpoint_and_bad_tracker_are_loud(tmp_path):
    layout.write_tracker(tmp_path, 5)
    with pytest.raises(FileNotFoundError, match="iteration 5"):
        layout.checkpoint_dir(tmp_path, 5)
    layout.tracker_path(tmp_path).write_text("release\n")
    with pytest.raises(ValueError, match="release"):
        layout.read_tracker(tmp_path)
