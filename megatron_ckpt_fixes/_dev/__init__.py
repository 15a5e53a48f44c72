"""Development only, not shipped in the wheel: the Megatron-style demo trainer (``training``)
and the multi-process test harness (``testing``) that the tests, scripts and benchmarks of a
checkout use."""
