"""A verifiers (v1) taskset with a scripted user: one- and two-digit arithmetic, and one second chance.

The user asks a question; if the model's reply does not end in the right number, the user says so and asks again.
The reward is 1.0 for a right first answer, 0.5 for a right second one, else 0. It is a plain verifiers taskset
(`vf.Taskset`, `vf.Task`, `vf.SingleAgentEnv`, `@vf.reward`) that runs the same under verifiers' own `eval` CLI;
gyre plays it against its rollout engine with `rollout.verifiers.taskset: examples/verifiers/arith_retry.py`.
"""

import random
import re

import verifiers.v1 as vf

N_TASKS = 576  # the recipe holds out the last 64


class ArithData(vf.TaskData):
    question: str
    answer: int


def last_number(text: str) -> int | None:
    found = re.findall(r"-?\d+", (text or "").replace(",", ""))
    return int(found[-1]) if found else None


class ArithTask(vf.Task[ArithData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        replies = [last_number(m.content) for m in trace.assistant_messages]
        if replies and replies[0] == self.data.answer:
            return 1.0
        return 0.5 if len(replies) > 1 and replies[1] == self.data.answer else 0.0


class ArithRetryEnv(vf.SingleAgentEnv):
    """The scripted user: the question, then (after a wrong answer) one correction."""

    async def run(self, task, agents):
        async with agents.agent.interaction(task) as chat:
            reply = await chat.turn(task.data.question)
            if reply.terminated or last_number(reply.last_reply) == task.data.answer:
                return
            await chat.turn(f"That is not right. {task.data.question}")


class ArithRetryTaskset(vf.Taskset[ArithTask, vf.TasksetConfig]):
    def load(self):
        rng = random.Random(0)
        tasks = []
        for i in range(N_TASKS):
            a, b, op = rng.randint(0, 99), rng.randint(0, 99), rng.choice("+-")
            question = f"What is {a} {op} {b}? Give only the final number."
            tasks.append(ArithTask(ArithData(idx=i, prompt=None, question=question,
                                             answer=a + b if op == "+" else a - b), self.config.task))
        return tasks


__all__ = ["ArithRetryEnv", "ArithRetryTaskset"]
