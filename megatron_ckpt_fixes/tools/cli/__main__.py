import sys

from megatron_ckpt_fixes.tools.cli import main

sys.exit(main())
