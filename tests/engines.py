"""The simulated rollout engine for whole-run tests where vLLM is not what the test is about: launchers
(``ray up``, ``ray job submit``, Slurm), ops commands, supervision and live scaling (the crash matrices, the
reward-model crash, partial restart, the learner-rank restart), recording and tracking, ``gyre sweep``.

``rollout.sim_engine.SimulatedEngine`` starts in well under a second where vLLM takes ~20 s on two cores, and it
sleeps while a group "generates" instead of taking a core from the learner and from the other xdist worker.
Measured on the 2-core machine (2026-11-29, ``deploy/recipes/tiny-test.yaml``, 3 steps with evaluations): the
whole run 42.5 s on vLLM, 19.1 s simulated. Its tokens are random, yet they earn the tiny recipes' dense reward
(``char_fraction`` over digits and spaces) graded values, so GRPO advantages are non-zero and every learner step
has a gradient (``tests.training.assert_trained`` holds). Weight updates stay real: every policy version crosses
gRPC and is checked tensor by tensor against the model folder's headers.

Whole-run tests about vLLM's own path keep it: the loop and its evaluations, lockstep bit-identity (lockstep needs
vLLM), and the integration tests of the engine itself.
"""

TINY_GROUP_S = 0.5
"""Seconds one group of the tiny recipes takes on vLLM with the tiny Llama (2 × 24 tokens) on two loaded cores,
roughly: runs whose fault hit counts and chaos timings were chosen at vLLM's pace simulate it."""


def sim_engine(seconds_per_group: float = 0.0) -> dict:
    """Recipe overrides (``load_recipe``'s dotted keys, scalar values) that select the simulated engine, each
    group taking ``seconds_per_group`` seconds (>= 0) to "generate"."""
    return {"rollout.engine.kind": "simulated", "rollout.engine.simulated.seconds_per_group": float(seconds_per_group)}


def sim_engine_sets(seconds_per_group: float = 0.0) -> list[str]:
    """The same overrides as ``gyre run`` arguments, ``["--set", "key=value", ...]``: no spaces or quotes, so they
    survive the shell command lines ``ray submit`` and ``sbatch`` build from them."""
    return [a for key, value in sim_engine(seconds_per_group).items() for a in ("--set", f"{key}={value}")]
