"""The rollout service: its Ray actor, the gRPC weight client and the weight transports (``transport``)."""
