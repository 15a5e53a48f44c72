"""Turn a functional case's ``MODEL_ARGS`` into ``pretrain_gpt.py`` flags for CPU/gloo ranks.

Three kinds of change, each recorded as a :class:`Change` and printed by the runner:

- ``size``: what only sets the size of the job (layers, hidden size, heads, sequence,
  micro/global batch, and the data-parallel size the world size gives);
- ``gpu``: what needs a GPU or its libraries (``--bf16``/``--fp16`` stay: torch runs both
  on CPU; ``--transformer-impl transformer_engine``, fused kernels, NCCL, the nvrx async
  strategy);
- ``ci``: what Megatron-LM's CI provides (data and tokenizer files, paths), and the flags
  its scripts add (``--exit-interval`` = ``--train-iters``).

Every checkpoint, rerun, fault and async flag is kept as the case has it
(:data:`KEPT_AS_IS`); :func:`adapt` checks that before returning.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cases import Case

#: Flags whose values the runner never changes (paths are substituted, nothing else).
KEPT_AS_IS: tuple[str, ...] = (
    "--ckpt-format", "--async-save", "--use-persistent-ckpt-worker", "--rerun-mode",
    "--error-injection-rate", "--error-injection-type", "--save-interval",
    "--ckpt-assume-constant-structure", "--dist-ckpt-optim-fully-reshardable",
    "--dist-ckpt-strictness", "--no-load-optim",
    "--no-ckpt-fully-parallel-save", "--ckpt-fully-parallel-save", "--train-iters",
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size",
)

#: Size flags -> the value used here (only where the case sets the flag).
SIZE: dict[str, int] = {
    "--num-layers": 4,
    "--hidden-size": 64,
    "--ffn-hidden-size": 128,
    "--num-attention-heads": 4,
    "--kv-channels": 16,
    "--num-query-groups": 2,
    "--seq-length": 32,
    "--max-position-embeddings": 32,
}
#: A global batch up to this size is kept (a case that compares layouts at the same batch,
#: such as checkpoint-consistency, depends on it); a larger one is shrunk to
#: :data:`MICRO_BATCHES` micro-batches of one sample per data-parallel rank.
MAX_KEPT_GLOBAL_BATCH = 8
MICRO_BATCHES = 4
#: The mock data's vocabulary (NullTokenizer). Megatron-LM pads the vocabulary to a
#: multiple of 128 x TP (``--make-vocab-size-divisible-by``); 500 (501 with the EOD token
#: Megatron-LM 0.16's NullTokenizer adds) pads to 512 for every TP size up to 4, so layouts
#: with different TP compute the same softmax (128 padded to 128 at TP=1 but to 256 at TP=2,
#: and the checkpoint-consistency case's gradients differed).
VOCAB_SIZE = 500

DISTRIBUTED_OPTIMIZER_WHY = (
    "it trains and saves on CPU, but its torch_dist checkpoint loads only with Transformer "
    "Engine's or Apex's FusedAdam: with torch.optim.Adam megatron-core builds the load "
    "template from the fresh optimizer's state and asserts that every parameter's Adam "
    "'step' agrees (DistributedOptimizer.state_dict: assert len(steps) == 1, on an empty "
    "state)")

#: GPU-only flags and their CPU replacements (None: dropped).
GPU_FLAGS: dict[str, tuple[object, str]] = {
    "--distributed-backend": ("gloo", "NCCL needs GPUs; gloo runs the same collectives on CPU"),
    "--transformer-impl": ("local", "Transformer Engine needs CUDA; megatron-core's local "
                                    "(torch) layers"),
    "--cross-entropy-loss-fusion": (None, "a fused CUDA kernel"),
    "--ckpt-fully-parallel-load": (None, "megatron-core's load exchange builds CUDA buffers "
                                         "(init_data('cuda'), .cuda())"),
    "--use-distributed-optimizer": (None, DISTRIBUTED_OPTIMIZER_WHY),
    "--overlap-param-gather": (None, "needs the distributed optimizer"),
}
#: Flags added to turn off fusions that have no CPU kernel (Apex / CUDA).
NO_FUSION: dict[str, str] = {
    "--no-persist-layer-norm": "Apex's persistent layer norm; torch's LayerNorm refuses it",
    "--no-masked-softmax-fusion": "Megatron's fused softmax is a CUDA kernel",
    "--no-gradient-accumulation-fusion": "Apex's fused weight-gradient kernel",
    "--no-rope-fusion": "the fused RoPE kernel needs Transformer Engine",
}
#: CI inputs replaced by mock data.
DATA_FLAGS = ("--data-path", "--vocab-file", "--merge-file", "--data-cache-path", "--split")


@dataclass(frozen=True)
class Change:
    """One change to the case's flags, as printed: ``kind: flag old -> new (why)``."""

    kind: str
    flag: str
    old: object
    new: object
    why: str

    def __str__(self) -> str:
        def shown(value: object) -> str:
            return "(absent)" if value is None else "(flag)" if value is True else str(value)

        return f"[{self.kind}] {self.flag} {shown(self.old)} -> {shown(self.new)}: {self.why}"


@dataclass(frozen=True)
class Paths:
    """Where a run saves and loads (CI's ``${CHECKPOINT_SAVE_PATH}``/``...LOAD_PATH``)."""

    save: Path
    load: Path
    tensorboard: Path


@dataclass(frozen=True)
class Adapted:
    argv: list[str]
    changes: list[Change]
    data_parallel_size: int


def world_size_of(case: Case, nproc: int | None = None) -> int:
    """The ranks a case runs on here: ``nproc``, or TP x PP x CP (data-parallel size 1)."""
    model_parallel = (case.int_arg("--tensor-model-parallel-size", 1)
                      * case.int_arg("--pipeline-model-parallel-size", 1)
                      * case.int_arg("--context-parallel-size", 1))
    return nproc or model_parallel


def adapt(case: Case, paths: Paths, *, world_size: int, async_strategy_needed: bool,
          extra: dict[str, object] | None = None, ci_gpus: int = 8) -> Adapted:
    """The flags to run ``case`` on ``world_size`` CPU ranks, and every change made.

    ``async_strategy_needed``: the installed megatron-core defaults ``--async-save`` to
    nvidia-resiliency-ext's strategy (0.17+), which cannot run here. ``extra``: flags the
    caller adds or overrides on purpose (e.g. ``--ckpt-assume-constant-structure``), each
    recorded as a change of kind ``run``.
    """
    args: dict[str, object] = dict(case.model_args)
    changes: list[Change] = []

    def change(kind: str, flag: str, new: object, why: str) -> None:
        old = args.get(flag)
        if old == new:
            return
        changes.append(Change(kind, flag, old, new, why))
        if new is None:
            args.pop(flag, None)
        else:
            args[flag] = new

    model_parallel = world_size_of(case)
    if world_size % model_parallel:
        raise ValueError(f"{case.name}: {world_size} ranks do not divide into TP x PP x CP "
                         f"= {model_parallel}")
    dp = world_size // model_parallel
    ci_dp = ci_gpus // model_parallel
    for flag, value in SIZE.items():
        if flag in args:
            change("size", flag, value, "size only")
    per_chunk = case.int_arg("--num-layers-per-virtual-pipeline-stage", 0)
    if per_chunk:
        change("size", "--num-layers", 2 * per_chunk * case.int_arg(
            "--pipeline-model-parallel-size", 1), "size only: two virtual stages per "
            "pipeline rank, so the interleaved schedule still interleaves")
        change("gpu", "--no-overlap-p2p-communication", True,
               "the interleaved schedule's overlapped send/receive leans on CUDA stream "
               "order; on gloo a stage reads a receive buffer before the receive completed "
               "(NaN gradients from iteration 1 in bf16)")
    if case.int_arg("--global-batch-size", 0) > MAX_KEPT_GLOBAL_BATCH:
        change("size", "--micro-batch-size", 1, "size only")
        change("size", "--global-batch-size", MICRO_BATCHES * dp,
               f"{MICRO_BATCHES} micro-batches per data-parallel rank; data-parallel size "
               f"{ci_dp} on CI's {ci_gpus} GPUs -> {dp} on {world_size} ranks")
    elif case.int_arg("--global-batch-size", 0) % (case.int_arg("--micro-batch-size", 1) * dp):
        raise ValueError(f"{case.name}: its global batch does not divide into {dp} "
                         "data-parallel ranks")
    for flag, (new, why) in GPU_FLAGS.items():
        if flag in args:
            change("gpu", flag, new, why)
    for flag, why in NO_FUSION.items():
        change("gpu", flag, True, why)
    if case.int_arg("--tensor-model-parallel-size", 1) > 1 and args.get("--sequence-parallel"):
        change("gpu", "--sequence-parallel", None,
               "megatron-core's torch norms (no Apex, no Transformer Engine) refuse sequence "
               "parallelism")
    if args.get("--async-save") and async_strategy_needed and "--async-strategy" not in args:
        change("gpu", "--async-strategy", "mcore",
               "the default nvrx strategy needs nvidia-resiliency-ext >= 0.6 (not on PyPI); "
               "megatron-core's own asynchronous save")
    for flag in DATA_FLAGS:
        if flag in args:
            change("ci", flag, None, "CI's data (the Pile shard, its GPT-2 BPE files)")
    change("ci", "--mock-data", True, "megatron-core's MockGPTDataset instead")
    change("ci", "--tokenizer-type", "NullTokenizer", "no vocabulary files")
    change("ci", "--vocab-size", VOCAB_SIZE, "NullTokenizer's vocabulary")
    change("ci", "--exit-interval", (extra or {}).get("--train-iters", args.get("--train-iters")),
           "run_ci_test.sh sets --exit-interval to --train-iters")
    # CI's paths: a value under ${CHECKPOINT_LOAD_PATH} (a recorded checkpoint below CI's
    # artifacts) is the run's load path itself.
    substitutions = {"${CHECKPOINT_SAVE_PATH}": paths.save, "${CHECKPOINT_LOAD_PATH}": paths.load,
                     "${TENSORBOARD_PATH}": paths.tensorboard}
    for flag, value in list(args.items()):
        for variable, path in substitutions.items():
            if isinstance(value, str) and value.startswith(variable):
                args[flag] = str(path)
        if args[flag] == "${REPEAT}":
            change("ci", flag, 1, "run_ci_test.sh's first repeat")
    for flag, value in (extra or {}).items():
        change("run", flag, value, "added by this run")
    _check_kept(case, args, extra or {})
    return Adapted(_argv(args), changes, dp)


def _check_kept(case: Case, args: dict[str, object], extra: dict[str, object]) -> None:
    for flag in KEPT_AS_IS:
        if flag in extra:
            continue
        if case.model_args.get(flag) != args.get(flag):
            raise AssertionError(f"{case.name}: {flag} changed from "
                                 f"{case.model_args.get(flag)!r} to {args.get(flag)!r}")


def _argv(args: dict[str, object]) -> list[str]:
    argv: list[str] = []
    for flag, value in args.items():
        if value is True:
            argv.append(flag)
        elif value is not None and value is not False:
            argv += [flag, str(value)]
    return argv
