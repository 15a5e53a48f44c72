"""Run in a subprocess against one megatron-core release: what does install() decide there?

Prints one JSON object: the release, and per declared patch whether upstream already has
the fix (the detected reason) and what it lacks; then the result of a real ``install()``.
"""

from __future__ import annotations

import json
import logging
from importlib.metadata import version

logging.disable(logging.WARNING)


def main() -> None:
    import megatron_ckpt_fixes
    from megatron_ckpt_fixes.core.patching import not_needed_reason, requirement_problems

    patches = {}
    core = [f for f in megatron_ckpt_fixes.FEATURES + megatron_ckpt_fixes.OPTIONAL_FEATURES
            if megatron_ckpt_fixes.feature_system(f) == megatron_ckpt_fixes.MEGATRON_CORE]
    for patch in megatron_ckpt_fixes._declared(core):
        reason = not_needed_reason(patch)
        patches[patch.name] = {"not_needed": reason,
                               "missing": [] if reason else requirement_problems(patch)}
    installed = megatron_ckpt_fixes.install()
    print(json.dumps({"megatron-core": version("megatron-core"), "patches": patches,
                      "installed": installed}))


if __name__ == "__main__":
    main()
