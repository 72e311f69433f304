"""Unit tests: the shared contracts in proto/ (schema, journal, chunks, timelines, lockstep)."""
