"""The training script's checkpoint flow is Megatron-LM's, and bad flags are one line.

Megatron-LM's ``save_checkpoint`` builds the save strategy once per job (default strategy,
cached structure under ``--ckpt-assume-constant-structure``, the load strategy's metadata
plugged in, the fully-parallel wrapper unless ``--no-ckpt-fully-parallel-save``), keeps it
and validates the sharding on the first save only under the flag. These tests build the
strategies with a one-rank gloo group and megatron-core's parallel state.
"""

from __future__ import annotations

import pytest
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelSaveStrategyWrapper,
)
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

from megatron_ckpt_fixes._dev.training import strategies
from megatron_ckpt_fixes._dev.training.args import build_parser, layout_problem, parse_args
from megatron_ckpt_fixes._dev.training.errors import ConfigError
from megatron_ckpt_fixes._dev.training.strategies import (
    CheckpointingContext,
    StrategyOptions,
    save_strategy,
)


@pytest.fixture
def parallel_state_of_one(single_rank_group):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    yield
    parallel_state.destroy_model_parallel()


# -- flags ------------------------------------------------------------------------------------

def test_megatron_lm_checkpoint_flags_and_defaults():
    args = build_parser().parse_args(["--train-iters", "1"])
    assert args.ckpt_fully_parallel_save is True  # Megatron-LM: on unless switched off
    assert args.ckpt_fully_parallel_load is False and args.ckpt_assume_constant_structure is False
    off = build_parser().parse_args(["--train-iters", "1", "--no-ckpt-fully-parallel-save",
                                     "--ckpt-fully-parallel-save"])
    assert off.ckpt_fully_parallel_save is False and off.ckpt_fully_parallel_save_deprecated


@pytest.mark.parametrize("flags, message", [
    (["--save-interval", "-2"], "argument --save-interval: must be a positive integer, got -2"),
    (["--save-interval", "0"], "argument --save-interval: must be a positive integer, got 0"),
    (["--exit-interval", "0"], "argument --exit-interval: must be a positive integer, got 0"),
    (["--error-injection-rate", "-1"], "must be zero or positive, got -1"),
    (["--async-save"], "--async-save needs --save"),
    (["--tensor-model-parallel-size", "3"], "--tensor-model-parallel-size 3 does not divide "
                                            "the world size 2"),
])
def test_bad_flags_are_one_line_on_rank_0_only(capsys, monkeypatch, flags, message):
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as exit_:
            parse_args(["--train-iters", "4", *flags])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        if rank == "0":
            assert err.count("\n") == 1 and message in err and err.startswith("train.py: error:")
        else:
            assert err == ""


def test_layout_problems_name_the_flags():
    args = build_parser().parse_args(["--train-iters", "1", "--tensor-model-parallel-size", "2",
                                      "--num-attention-heads", "3"])
    assert "--num-attention-heads 3 is not divisible" in layout_problem(args, 2)
    args = build_parser().parse_args(["--train-iters", "1", "--global-batch-size", "3"])
    assert "data-parallel size 2" in layout_problem(args, 2)
    assert layout_problem(build_parser().parse_args(["--train-iters", "1"]), 4) is None


# -- strategies -------------------------------------------------------------------------------

def test_first_save_builds_megatron_lm_strategy_and_later_saves_reuse_it(parallel_state_of_one):
    context = CheckpointingContext()
    options = StrategyOptions(assume_constant_structure=True)
    strategy, validate = save_strategy(options, context)
    assert isinstance(strategy, FullyParallelSaveStrategyWrapper) and validate
    assert strategy.do_cache_distribution
    assert strategy.parallelization_group is parallel_state.get_data_parallel_group(
        with_context_parallel=True)
    base = strategy.base_strategy
    assert isinstance(base, TorchDistSaveShardedStrategy) and base.use_cached_ckpt_structure
    again, validate = save_strategy(options, context)
    assert again is strategy and validate is False  # skipped after the first save under the flag

    fresh = CheckpointingContext()
    first, validate = save_strategy(StrategyOptions(), fresh)
    assert first.do_cache_distribution is False and validate
    assert save_strategy(StrategyOptions(), fresh) == (first, True)  # no flag: always validate


def test_loaded_metadata_is_handed_to_the_save_strategy_under_the_flag(parallel_state_of_one):
    loaded = object()
    load = type("Loaded", (), {"cached_global_metadata": loaded})()
    options = StrategyOptions(assume_constant_structure=True, fully_parallel_save=False)
    strategy, _ = save_strategy(options, CheckpointingContext(load_strategy=load))
    assert isinstance(strategy, TorchDistSaveShardedStrategy)
    assert strategy.cached_global_metadata is loaded
    plain, _ = save_strategy(StrategyOptions(fully_parallel_save=False),
                             CheckpointingContext(load_strategy=load))
    assert plain.cached_global_metadata is None and not plain.use_cached_ckpt_structure


def test_fully_parallel_load_is_refused_without_cuda_collectives(single_rank_group):
    strategies.check_fully_parallel_load(StrategyOptions())
    with pytest.raises(ConfigError, match="--ckpt-fully-parallel-load needs CUDA collectives"):
        strategies.check_fully_parallel_load(StrategyOptions(fully_parallel_load=True))


def test_async_strategy_follows_megatron_lm_where_megatron_core_has_strategies():
    resolve = strategies.resolve_async_strategy
    if not strategies.has_async_strategies():  # megatron-core 0.16: its own async save only
        assert resolve(StrategyOptions(async_save=True)) is None
        assert resolve(StrategyOptions(async_save=True, async_strategy="mcore")) is None
        with pytest.raises(ConfigError, match="needs megatron-core >= 0.17"):
            resolve(StrategyOptions(async_save=True, async_strategy="nvrx"))
        return
    assert resolve(StrategyOptions()) == "mcore"  # synchronous saves, as Megatron-LM
    assert resolve(StrategyOptions(async_save=True, async_strategy="mcore")) == "mcore"
    # Megatron-LM's default needs nvidia-resiliency-ext >= 0.6.0, which cannot be installed
    # here (the registry's newest is 0.4.1): refused before training, with the way out.
    with pytest.raises(ConfigError, match="nvidia-resiliency-ext.*--async-strategy mcore"):
        resolve(StrategyOptions(async_save=True))
