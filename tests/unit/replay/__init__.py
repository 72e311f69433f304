"""Unit tests: replay service and core."""
