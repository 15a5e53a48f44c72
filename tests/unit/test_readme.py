"""The README's commands can be pasted as they are, and CI runs the Quickstart's test command.

Before, the training block held ``[--async-save --async-strategy mcore]`` (pasted: ``invalid
choice: 'mcore]'``) and other blocks ``<its arguments>`` (a redirection for bash). Every
bash block must parse (``bash -n``) and hold no placeholder syntax; the Quickstart says what
its second command needs and which torch a plain index gives.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
BLOCKS = re.findall(r"```bash\n(.*?)```", README, re.S)
#: ``[--flag]`` (optional-part notation) and ``<something>`` (a placeholder) in a command.
PLACEHOLDER = re.compile(r"(^|\s)\[-|<[a-z][a-z _.-]*>")


def _quickstart() -> str:
    return README.split("## Quickstart", 1)[1].split("\n## ", 1)[0]


@pytest.mark.parametrize("block", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_every_bash_block_can_be_pasted(block):
    done = subprocess.run(["bash", "-n"], input=block, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert not [line for line in block.splitlines() if PLACEHOLDER.search(line)], block


def test_ci_runs_the_quickstarts_test_command():
    """Leg 1 of .ci/run: the Quickstart's second command, its install part and its pytest."""
    command = re.findall(r"```bash\n(.*?)\n```", _quickstart(), re.S)[1]
    install, _, test = command.rpartition(" && ")
    assert test == "python -m pytest -q"
    ci = (REPO / ".ci" / "run").read_text()
    assert f"\n{install} \\\n" in ci
    assert '\ncheck "pytest (0.16.1)" python -m pytest -q\n' in ci


def test_the_quickstart_says_what_its_commands_need():
    text = " ".join(_quickstart().split())
    assert "MCF_UPSTREAM_SNAPSHOTS" in text and "../shared/upstream/megatron-lm" in text
    assert "is the CUDA build" in text  # what a plain index gives for torch==2.13.0
