"""Build hook only (metadata is in pyproject.toml): ship the zero-code activation's ``.pth``.

``megatron_ckpt_fixes-activation.pth`` must sit at the top of site-packages, where the
interpreter runs it at start-up (see megatron_ckpt_fixes/activation.py). A wheel installs
the files at its root there, so ``build_py`` adds it to the build tree. An editable install
(PEP 660) builds a wheel of finders/links instead and ignores the build tree, so its wheel
gets the file from ``editable_wheel``'s strategy (setuptools' extension point there is
private: tests/unit/test_activation.py checks that the installed package has the file).
Either way pip records it, and ``pip uninstall`` removes it.
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "megatron_ckpt_fixes-activation.pth"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), PTH)


class build_py_with_pth(build_py):
    def run(self):
        super().run()
        self.copy_file(SOURCE, os.path.join(self.build_lib, PTH), preserve_mode=0)

    def get_outputs(self, include_bytecode=1):
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


class _AddPth:
    """Wraps an editable-wheel strategy: whatever it writes, plus the ``.pth``."""

    def __init__(self, strategy):
        self.strategy = strategy

    def __enter__(self):
        self.strategy.__enter__()
        return self

    def __exit__(self, *exc):
        return self.strategy.__exit__(*exc)

    def __call__(self, wheel, files, mapping):
        self.strategy(wheel, files, mapping)
        wheel.write(SOURCE, PTH)


class editable_wheel_with_pth(editable_wheel):
    def _select_strategy(self, *args, **kwargs):
        return _AddPth(super()._select_strategy(*args, **kwargs))


setup(cmdclass={"build_py": build_py_with_pth, "editable_wheel": editable_wheel_with_pth})
