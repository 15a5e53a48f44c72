"""Put on the ranks' PYTHONPATH by the functional tests: installs test-only hooks into the
training script's ranks (:mod:`mcf_test_hooks`), only in processes launched as ranks."""

import os

if "RANK" in os.environ:
    import mcf_test_hooks

    mcf_test_hooks.install()
