"""Error lines stay within a screen: long key lists keep their first items and a count."""

from __future__ import annotations

import pytest

from megatron_ckpt_fixes.core.messages import LIMIT, shorten, shorten_line

pytestmark = pytest.mark.varies_with()

KEYS = [f"decoder.layers.{i}.mlp.linear_fc1.weight" for i in range(200)]


def test_a_long_key_list_keeps_its_first_keys_and_a_count():
    line = f'KeyError: "optimizer.state.exp_avg.embedding.weight from model not in state dict: {KEYS}"'
    assert len(line) > 7000
    short = shorten_line(line)
    assert short == ('KeyError: "optimizer.state.exp_avg.embedding.weight from model not in state '
                     "dict: ['decoder.layers.0.mlp.linear_fc1.weight', "
                     "'decoder.layers.1.mlp.linear_fc1.weight', "
                     "'decoder.layers.2.mlp.linear_fc1.weight', ... 197 more (200 in all)]\"")
    assert shorten_line(f"unexpected keys {set(KEYS[:3])}") == f"unexpected keys {set(KEYS[:3])}"


def test_whatever_is_still_too_long_is_cut_with_a_count():
    line = "x" * 5000
    short = shorten_line(line)
    assert len(short) == LIMIT and short.endswith(f" ... [{5000 - LIMIT} more characters]")
    assert shorten(f"first\n{line}\nlast").splitlines()[::2] == ["first", "last"]


def test_the_training_error_line_fits_with_its_prefix(capsys):
    """The prefix ``train.py: error on rank N: `` counts: a key list whose first keys are
    long (the first key depends on the run) once made the line 25 characters too long."""
    from megatron_ckpt_fixes._dev.training.loop import report_error

    long_keys = [f"decoder.layers.mlp.linear_fc1._extra_state/shard_0_{i}" + "x" * 200
                 for i in range(60)]
    report_error(KeyError(f"optimizer.state.exp_avg.embedding.weight from model not in state "
                          f"dict: {long_keys}"), verbose=False)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("train.py: error on rank ")
    assert len(lines[0]) <= LIMIT, len(lines[0])
