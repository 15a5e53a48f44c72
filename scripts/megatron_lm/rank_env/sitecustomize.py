"""Put on the PYTHONPATH of a Megatron-LM job by the case runner: the job's ranks and the
processes they spawn (megatron-core's checkpoint workers) open the CPU platform at start-up,
so Megatron-LM's unchanged ``pretrain_gpt.py`` runs on gloo. See :mod:`mlm_rank`."""

import os

if os.environ.get("MCF_MLM_TREE"):
    import mlm_rank

    mlm_rank.start()
