"""The reward-model service: a Ray actor serving ``RewardModelService`` (gRPC) over the run's reward models."""
