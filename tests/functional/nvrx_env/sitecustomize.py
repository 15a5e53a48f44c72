"""Put on the PYTHONPATH of the nvidia-resiliency-ext snapshot test's processes (the ranks and
the persistent worker nvidia-resiliency-ext spawns): opens the CPU platform of the
megatron-core suite (``scripts/mcore_suite/cpu_platform.py``) at start-up, because
nvidia-resiliency-ext's writer calls ``torch.cuda`` and its worker pins
``rank % device_count()`` (0 devices: it dies at start). Only with ``MCF_NVRX_CPU`` set, and
not in multiprocessing's resource tracker (it runs no torch)."""

import os
import sys
from pathlib import Path

_TRACKER = "from multiprocessing.resource_tracker import"
if os.environ.get("MCF_NVRX_CPU") and not any(a.startswith(_TRACKER) for a in sys.orig_argv):
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts" / "mcore_suite"))
    import cpu_platform

    cpu_platform.CpuPlatform().open()
