"""speedups."""
