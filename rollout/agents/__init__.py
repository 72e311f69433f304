"""Multi-turn episodes: a rollout's groups played as conversations with an environment instead of one sampled
completion per prompt.

- ``environment`` / ``tools``: the environment contract (``rollout.environment`` in a recipe) and the built-in
  tool-calling environment;
- ``episode`` / ``episode_runners`` / ``agent_group`` / ``env_threads``: one episode's turns and tokens, the runners
  that play a group's episodes, and the threads that keep a stuck environment call from stalling the rollout;
- ``episode_eval``: held-out evaluation of an environment;
- ``verifiers_env`` / ``verifiers_renderer`` / ``generate_endpoint``: prime-rl ``verifiers`` environments played
  against the rollout's own engine through an OpenAI-compatible endpoint.
"""
