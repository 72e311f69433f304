"""``bench.time_to_accuracy``'s TRL arm, run in its own process: ``python -m bench.tta_trl SPEC_JSON``.

SPEC: ``{"recipe": path, "overrides": {...}, "out": folder}``. Trains TRL's ``GRPOTrainer`` on the recipe's
task (its first ``steps × prompts_per_step`` training prompts, in gyre's order, as the chat messages gyre
sends) with gyre's reward for the task (the same ``RewardSet`` and ``score_groups`` a rollout scores with),
``GRPOConfig`` from ``bench.tta_parts.trl_settings``. Saves the policy every ``eval_every`` steps
(``{out}/checkpoint-N``: an HF folder ``gyre eval`` scores) and prints one JSON line:
``{"launch": wall s, "steps": [[step, wall s at its end]], "save_s": [[step, seconds saving]], "reward_version"}``.
Needs ``trl`` importable (the ``bench`` extra, or ``PYTHONPATH`` holding a ``pip install --target`` of it).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time


class GyreReward:
    """TRL's reward-function convention ``(completions, prompt_index, **columns) -> list[float]`` over gyre's
    reward for the task: each completion is scored by the task's ``RewardSet`` through
    ``rollout.rewards.scoring.score_groups`` against the entry of its prompt index (a failed score is 0.0,
    as in a rollout)."""

    def __init__(self, source) -> None:
        (self.task,) = source.mixture.names
        self.source = source
        self.reward_set = source.reward_for(self.task)
        self.__name__ = f"gyre:{self.reward_set.name}"  # TRL logs rewards under the function's __name__

    def __call__(self, completions: list, prompt_index: list[int], **_: object) -> list[float]:
        from gyre.rollout.rewards.base import Group
        from gyre.rollout.rewards.scoring import score_groups

        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        items = [(self.reward_set, Group([text], [self.source.messages(self.source.problem(i))],
                                         self.source.train_problem(i)))
                 for text, i in zip(texts, prompt_index)]
        return [score.results[0].reward for score in asyncio.run(score_groups(items))]


def prompt_dataset(source, count: int):
    """A ``datasets.Dataset`` of training prompts ``0 .. count-1``: ``prompt`` (chat messages) and
    ``prompt_index``."""
    from datasets import Dataset

    return Dataset.from_list([{"prompt": source.messages(source.problem(i)), "prompt_index": i}
                              for i in range(count)])


def make_timer():
    """A ``TrainerCallback`` stamping each optimizer step's end and each save's duration (wall seconds)."""
    from transformers import TrainerCallback

    class Timer(TrainerCallback):
        def __init__(self) -> None:
            self.steps, self.save_s, self._step_end = [], [], 0.0

        def on_step_end(self, args, state, control, **kwargs):
            self._step_end = time.time()  # the save of this step (if due) runs after this and before on_save
            self.steps.append([state.global_step, self._step_end])

        def on_save(self, args, state, control, **kwargs):
            self.save_s.append([state.global_step, time.time() - self._step_end])

    return Timer()


def main(spec: dict) -> dict:
    from gyre.rollout.tasks import TaskSource
    from gyre.services.control.recipe.schema import load_recipe
    from bench.tta_parts import trl_settings

    recipe = load_recipe(spec["recipe"], spec["overrides"])
    settings = trl_settings(recipe, spec["out"])
    source = TaskSource(recipe.task)
    reward = GyreReward(source)
    dataset = prompt_dataset(source, settings["max_steps"] * settings["generation_batch_size"]
                             // settings["num_generations"])
    import torch
    from trl import GRPOConfig, GRPOTrainer

    launch = time.time()  # the arm's clock: from here (model load, trainer set-up, training; imports excluded)
    config = GRPOConfig(**settings, model_init_kwargs={"dtype": torch.float32})
    timer = make_timer()
    trainer = GRPOTrainer(model=recipe.model, reward_funcs=reward, args=config, train_dataset=dataset,
                          callbacks=[timer])
    trainer.train()
    return {"launch": launch, "steps": timer.steps, "save_s": timer.save_s,
            "reward_version": reward.reward_set.version}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
