"""Every feature by name: what it is (a fix, a speed-up, CPU support), where its patches are
declared, which system it patches, and whether ``install()`` applies it by default.

Names are what users write (``install(["structure"])``, ``MEGATRON_CKPT_FIXES=structure``);
they are decoupled from the package's layout by this table, and a renamed feature keeps its
old name as an alias. Fixes are on by default. A speed-up is on by default only where it is
built on megatron-core's and torch's public interfaces and falls back to upstream's path on
any failure of its own; one that reads private internals is applied only when named. Each
speed-up names the upstream change that would make it unnecessary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: The system of every feature that does not name another.
MEGATRON_CORE = "megatron.core"

FIX: Literal["fix"] = "fix"
SPEEDUP: Literal["speedup"] = "speedup"
SUPPORT: Literal["support"] = "support"


@dataclass(frozen=True)
class Feature:
    """One named feature.

    Attributes:
        name: what users write.
        module: the module inside the package that declares its ``PATCHES``.
        kind: a fix (a checkpoint that saves and then fails, or loads wrong values), a
            speed-up (the same bytes, sooner), or support (what makes upstream run on
            CPU/gloo).
        system: the import name of the package it patches; features of a system other than
            megatron-core are applied when that system is imported.
        default: applied by ``install()`` without arguments.
        aliases: earlier names that still select it.
        removed_by: for a speed-up, the upstream change that would make it unnecessary.
    """

    name: str
    module: str
    kind: Literal["fix", "speedup", "support"]
    system: str = MEGATRON_CORE
    default: bool = True
    aliases: tuple[str, ...] = ()
    removed_by: str = ""


#: Every feature, in the order ``install()`` applies them.
REGISTRY: tuple[Feature, ...] = (
    Feature("compat.cpu", "compat.cpu", SUPPORT),
    Feature("compat.tensor_metadata", "compat.tensor_metadata", FIX),
    Feature("structure", "fixes.structure", FIX),
    Feature("replicas", "fixes.replicas", FIX),
    Feature("rerun.sentinel", "fixes.rerun.sentinel", FIX),
    Feature("rerun.stats_report", "fixes.rerun.stats_report", FIX),
    Feature("rerun.transient_fault", "fixes.rerun.transient_fault", FIX),
    Feature("load_errors", "fixes.load_errors", FIX),
    Feature("sharded_objects", "fixes.sharded_objects", FIX),
    Feature("common_merge", "fixes.common_merge", FIX),
    Feature("dp_reshardable_step", "fixes.dp_reshardable_step", FIX),
    Feature("async_worker", "fixes.async_worker", FIX),
    Feature("compat.rerun_device", "compat.rerun_device", SUPPORT),
    Feature("dtensor.mcore", "integrations.mcore_dtensor", FIX),
    Feature("dtensor.mlite", "integrations.mlite", FIX, system="megatron.lite"),
    Feature("dtensor.nemo_automodel", "integrations.nemo_automodel", FIX,
            system="nemo_automodel"),
    Feature("snapshot", "fixes.snapshot", FIX),
    Feature("snapshot.nvrx", "integrations.nvrx", FIX, system="nvidia_resiliency_ext"),
    Feature("checksums", "fixes.checksums", FIX),
    Feature("reshard.tzrec", "integrations.tzrec", FIX, system="tzrec"),
    Feature("writer_failures", "fixes.writer_failures", FIX),
    Feature("megatron_lm.rng_state", "integrations.megatron_lm.rng_state", FIX,
            system="megatron.training"),
    Feature("writer_threads", "speedups.writer_threads", SPEEDUP,
            removed_by="megatron-core writing a rank's bucket files with threads (0.19+ does: "
                       "not applied there)"),
    Feature("write_results", "speedups.write_results", SPEEDUP,
            removed_by="megatron-core handing writers in the saving process a plain queue "
                       "instead of a multiprocessing Manager's"),
    Feature("writeback", "speedups.writeback", SPEEDUP,
            removed_by="megatron-core starting each file's write-back while it writes "
                       "(sync_file_range), instead of one fsync at the end"),
    Feature("item_stream", "speedups.item_stream", SPEEDUP, default=False,
            removed_by="torch defining the stream wrapper of _StorageWriterTransforms once, "
                       "at module level"),
    Feature("torch_save_frames", "speedups.torch_save_frames", SPEEDUP,
            removed_by="torch DCP serializing a plain tensor item without torch.save's "
                       "per-item zip framing in Python"),
    Feature("training.cpu_support", "_dev.training.cpu_support", SUPPORT, default=False),
)

BY_NAME: dict[str, Feature] = {f.name: f for f in REGISTRY}
BY_NAME.update({alias: f for f in REGISTRY for alias in f.aliases})


def canonical(name: str) -> str:
    """The feature's name, for its name or one of its aliases; KeyError otherwise."""
    return BY_NAME[name].name


def named(kind: str, default: bool | None = None) -> tuple[str, ...]:
    """The names of the features of ``kind`` (and of ``default`` when given), in order."""
    return tuple(f.name for f in REGISTRY
                 if f.kind == kind and (default is None or f.default == default))
