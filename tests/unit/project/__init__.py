"""Unit tests: the repository as shipped: docs site, lock files, examples."""
