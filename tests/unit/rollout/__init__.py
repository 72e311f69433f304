"""Unit tests: rollout core and the rollout service's weight client and transports."""
