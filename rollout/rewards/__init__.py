"""Reward functions for the rollout: a registry by name (``registry``), task mixtures (``mixture``),
exact-match math (``math_exact``), HumanEval-format code run in a sandbox (``code``, ``sandbox``) and
scoring off the event loop (``scoring``). ``rollout.tasks.TaskSource`` ties them to prompt indices."""
