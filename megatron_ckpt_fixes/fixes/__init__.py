"""fixes."""
