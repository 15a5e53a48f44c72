"""The README's commands can be pasted as they are, and CI runs the Quickstart's test command.

The README stays a page for users: at most 12,000 characters, no line over 200, no project
history (issue numbers, commit ids, dates: docs/development.md has those), and its "Using it"
example runs as it is.

Before, the training block held ``[--async-save --async-strategy mcore]`` (pasted: ``invalid
choice: 'mcore]'``) and other blocks ``<its arguments>`` (a redirection for bash). Every
bash block must parse (``bash -n``) and hold no placeholder syntax; the Quickstart says what
its second command needs and which torch a plain index gives.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.varies_with()

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
    assert test == "python -m pytest -q -n auto"
    ci = (REPO / ".ci" / "run").read_text()
    assert f"\n{install} \\\n" in ci
    assert '\ncheck "pytest (0.16.1)" python -m pytest -q -n auto\n' in ci


def test_the_quickstart_says_what_its_commands_need():
    text = " ".join(_quickstart().split())
    assert "MCF_UPSTREAM_SNAPSHOTS" in text and "../shared/upstream/megatron-lm" in text
    assert "is the CUDA build" in text  # what a plain index gives for torch==2.13.0


#: Project history has no place in the README (docs/development.md holds it): an issue
#: number of this project, a commit id, a dated run.
HISTORY = {
    "issue number": re.compile(r"\bissues? #?\d+", re.I),
    "commit id": re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b"),
    "date": re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b"),
}


def test_the_readme_is_short_and_holds_no_project_history():
    assert len(README) <= 12_000, f"README.md has {len(README)} characters (at most 12,000)"
    long = [n for n, line in enumerate(README.splitlines(), 1) if len(line) > 200]
    assert not long, f"README.md lines over 200 characters: {long}"
    found = {what: sorted(set(pattern.findall(README))) for what, pattern in HISTORY.items()}
    assert not any(found.values()), found


def test_the_using_it_example_runs(tmp_path):
    """The README's Python example, as a user pastes it into a file: one CPU process."""
    section = README.split("\n## Using it", 1)[1].split("\n## ", 1)[0]
    (example,) = re.findall(r"```python\n(.*?)```", section, re.S)
    script = tmp_path / "example.py"
    script.write_text(example)
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_CKPT_FIXES"}
    env["PYTHONWARNINGS"] = "ignore"
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "saved and loaded ['m', 'w']" in done.stdout, done.stdout
