"""Megatron-LM's functional test cases, read from a snapshot's ``model_config.yaml``.

A case (``tests/functional_tests/test_cases/gpt/<name>/model_config.yaml``) holds what
Megatron-LM's CI runs: ``MODEL_ARGS`` (the flags of ``pretrain_gpt.py``, ``true`` meaning a
bare flag), ``ENV_VARS``, ``TEST_TYPE`` (``regular``: one run; ``ckpt-resume``: a run, then
a second one resumed from its middle checkpoint; ``frozen-start``: a run that starts from a
recorded checkpoint; ``checkpoint-consistency``: one short run per ``MODEL_ARGS_<n>``
layout, each on ``MODEL_ENV_VARS``' GPU count, whose checkpoints are then compared) and an
``AFTER_SCRIPT`` of log checks. This module only reads them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

CASES_DIR = Path("tests/functional_tests/test_cases/gpt")


@dataclass(frozen=True)
class Case:
    """One functional test case as Megatron-LM's CI sees it."""

    name: str
    test_type: str
    #: flag -> value, in the file's order; ``True`` is a bare flag.
    model_args: dict[str, object]
    env_vars: dict[str, str] = field(default_factory=dict)
    after_script: str = ""
    #: ``MODEL_ARGS_<n>`` -> its flags (``checkpoint-consistency`` cases).
    variants: dict[str, dict[str, object]] = field(default_factory=dict)
    #: ``MODEL_ARGS``/``MODEL_ARGS_<n>`` -> GPUs per node (``MODEL_ENV_VARS``).
    gpus: dict[str, int] = field(default_factory=dict)

    def int_arg(self, flag: str, default: int) -> int:
        value = self.model_args.get(flag)
        return default if value is None or isinstance(value, bool) else int(value)


def case_dir(tree: Path, name: str) -> Path:
    return tree / CASES_DIR / name


def load_case(tree: Path, name: str) -> Case:
    """Read the case ``name`` of the Megatron-LM tree ``tree`` (raises if it is absent)."""
    path = case_dir(tree, name) / "model_config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"no functional test case {name!r} at {path}")
    config = yaml.safe_load(path.read_text())
    return Case(
        name=name,
        test_type=str(config.get("TEST_TYPE", "regular")),
        model_args=dict(config.get("MODEL_ARGS") or {}),
        env_vars={k: str(v) for k, v in (config.get("ENV_VARS") or {}).items()},
        after_script=str(config.get("AFTER_SCRIPT") or ""),
        variants={key: dict(value) for key, value in config.items()
                  if re.fullmatch(r"MODEL_ARGS(_\d+)?", key)},
        gpus={key: int(value["GPUS_PER_NODE"])
              for key, value in (config.get("MODEL_ENV_VARS") or {}).items()
              if isinstance(value, dict) and "GPUS_PER_NODE" in value},
    )


def case_names(tree: Path, pattern: str) -> list[str]:
    """Names of the GPT cases of ``tree`` matching the glob ``pattern``, sorted."""
    return sorted(p.name for p in (tree / CASES_DIR).glob(pattern)
                  if (p / "model_config.yaml").is_file())
