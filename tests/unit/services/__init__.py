"""Unit tests: services: control, CLI, common (logs, metrics, security), faults."""
