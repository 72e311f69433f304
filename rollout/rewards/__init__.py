"""Reward functions for the rollout: what every reward shares and the scoring thread pool (``base``), a registry
by name (``registry``), plain Python functions (``function``), weighted sums (``combined``), task mixtures
(``mixture``), exact-match math (``math_exact``), HumanEval-format code run in a sandbox (``code``, ``sandbox``)
and a task's groups scored off the event loop (``scoring``). ``rollout.tasks.TaskSource`` ties them to prompt
indices."""
