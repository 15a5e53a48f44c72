"""Put on the PYTHONPATH of a Megatron-LM job by the case runner: the job's ranks and the
processes they spawn (megatron-core's checkpoint workers) open the CPU platform at start-up,
so Megatron-LM's unchanged ``pretrain_gpt.py`` runs on gloo. See :mod:`mlm_rank`.

A platform that cannot open ends the process (exit 70) instead of letting it run without
(Python would only print "Error in sitecustomize" and go on)."""

import os

if os.environ.get("MCF_MLM_TREE"):
    try:
        import mlm_rank

        mlm_rank.start()
    except BaseException:
        import traceback

        traceback.print_exc()
        print("mlm_rank: the CPU platform could not open; exiting", flush=True)
        os._exit(70)
