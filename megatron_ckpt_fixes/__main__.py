"""``python -m megatron_ckpt_fixes [COMMAND ...]``: the ``megatron-ckpt-fixes`` command;
without a command, ``status`` (what ``install()`` applies here)."""

import sys

from megatron_ckpt_fixes.tools.cli import main

sys.exit(main(sys.argv[1:] or ["status"]))
