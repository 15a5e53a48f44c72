"""The speed-ups: the same bytes, sooner. On by default only where they are built on public
interfaces and fall back to upstream's path on their own failure; the others are applied only
when named (docs/speedups.md). Each says which upstream change would make it unnecessary."""
