"""Unit tests: learner core."""
