"""What users run to look at a checkpoint or an installation: the command line (``verify``,
``inspect``, ``status``, ``run``), the pre-flight (will this checkpoint load into this model),
and the status report."""
