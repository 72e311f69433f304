"""Multi-turn episodes with a scripted engine and the real SmolLM2 chat template: token accounting, limits and
every way an environment can misbehave (the episode ends with a reason, nothing breaks the worker)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from transformers import AutoTokenizer

from gyre.proto.trajectory import from_table, to_table
from gyre.replay.buffer import TrajectoryBuffer
from gyre.replay.config import ReplayConfig
from gyre.rollout.agents.agent_group import EnvironmentLoadError, EpisodeRunner
from gyre.rollout.config import RolloutConfig, SamplingConfig
from gyre.rollout.agents.environment import EnvironmentConfig, EnvStep, EpisodeConfig
from gyre.rollout.agents.episode import TurnRenderer, run_episode
from gyre.rollout.types import Sample
from gyre.rollout.worker import RolloutWorker
from tests.fakes import FakeReplay, until
from tests.unit.rollout.test_rollout_worker import TASK

SAMPLING = SamplingConfig(temperature=1.0, max_new_tokens=8)


@pytest.fixture(scope="module")
def tok(tiny_llama):
    return AutoTokenizer.from_pretrained(tiny_llama)


class ScriptEngine:
    """One sample per call: ``closed`` turns end with ``<|im_end|>`` (id 2); records each call's context."""

    def __init__(self, closed: bool = True, version: int = 0, delay_s: float = 0.0) -> None:
        self.closed, self.version, self.delay_s, self.contexts = closed, version, delay_s, []

    async def generate(self, prompt_token_ids, n, sampling, request_id, seed=None):
        assert n == 1 and len(prompt_token_ids) + sampling.max_new_tokens <= 1024
        self.contexts.append(list(prompt_token_ids))
        await asyncio.sleep(self.delay_s)
        ids = [100 + len(self.contexts), 7] + ([2] if self.closed else [])
        return [Sample(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop" if self.closed else "length",
                       version_span_starts=[0], version_span_versions=[self.version], text="call calc")]


class Chatty:
    """Never done: answers every turn with a tool result (a model that never stops calling tools)."""

    def __init__(self, output: str = "42", fail_on: int = 0, hang_s: float = 0.0, sync_hang_s: float = 0.0):
        self.output, self.fail_on, self.hang_s, self.sync_hang_s, self.turns = output, fail_on, hang_s, sync_hang_s, 0
        self.closed = False

    def reset(self, problem):
        return [{"role": "user", "content": f"Compute {problem}"}]

    def step(self, completion):
        self.turns += 1
        if self.turns == self.fail_on:
            raise RuntimeError("tool backend fell over")
        time.sleep(self.sync_hang_s)
        return EnvStep(observation=[{"role": "tool", "content": self.output}], tool_calls=1,
                       tool_errors=int(self.output == "error"))

    def close(self):
        self.closed = True


class Hanging(Chatty):
    async def step(self, completion):
        await asyncio.sleep(60)


def play(env, engine=None, config=EpisodeConfig(max_turns=3), max_model_len=1024, tok=None):
    engine = engine or ScriptEngine()
    return asyncio.run(run_episode(engine, TurnRenderer(tok), env, "2+3", SAMPLING, config, "req", max_model_len,
                                   seed=1)), engine


def test_observations_append_the_template_text_after_the_turn_closed_or_cut(tok):
    r = TurnRenderer(tok)
    obs = [{"role": "tool", "content": "5"}]
    tail = "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    assert r.observation_ids(obs, turn_closed=True) == tok.encode(tail, add_special_tokens=False)
    assert r.observation_ids(obs, turn_closed=False) == tok.encode("<|im_end|>" + tail, add_special_tokens=False)
    assert tok.decode(r.observation_ids(obs, turn_closed=True)) == tail


def test_a_model_that_never_stops_calling_tools_is_cut_at_max_turns(tok):
    env = Chatty()
    ep, engine = play(env, tok=tok)
    assert (ep.episode_end, ep.finish_reason, ep.error, ep.tool_calls) == ("max_turns", "length", "", 3)
    assert len(ep.turn_starts) == len(engine.contexts) == 3 and env.closed
    obs = TurnRenderer(tok).observation_ids([{"role": "tool", "content": "42"}], turn_closed=True)
    turn = [101, 7, 2]
    assert ep.token_ids == turn + obs + [102, 7, 2] + obs + [103, 7, 2]  # no observation after the last turn
    assert ep.loss_mask == [1] * 3 + [0] * len(obs) + [1] * 3 + [0] * len(obs) + [1] * 3
    assert engine.contexts[2] == ep.prompt_token_ids + ep.token_ids[:ep.turn_starts[2]]


def test_an_environment_that_raises_breaks_the_episode_with_its_reason(tok):
    env = Chatty(fail_on=2)
    ep, _ = play(env, tok=tok)
    assert ep.error == "episode-env_error: step raised RuntimeError: tool backend fell over"
    assert len(ep.turn_starts) == 2 and env.closed


@pytest.mark.parametrize("env", [Hanging(), Chatty(sync_hang_s=3.0)], ids=["async", "blocking"])
def test_a_hanging_step_ends_the_episode_at_its_time_budget(tok, env):
    async def timed():
        start = time.monotonic()
        ep = await run_episode(ScriptEngine(), TurnRenderer(tok), env, "2+3", SAMPLING,
                               EpisodeConfig(max_turns=3, time_budget_s=0.5), "req", 1024)
        return ep, time.monotonic() - start

    ep, seconds = asyncio.run(timed())
    assert ep.error.startswith("episode-time_budget: over 0.5 s after 1 turns")
    assert seconds < 2.9  # the blocking step's thread is abandoned, not waited for


GATE = threading.Event()
"""Closed: every ``Stuck`` step blocks until it opens (set it in a ``finally``: the threads must end)."""


class Stuck(Chatty):
    """A blocking step that hangs while ``GATE`` is closed (a tool backend that stopped answering)."""

    made = 0

    def __init__(self):
        super().__init__()
        Stuck.made += 1

    def step(self, completion):
        GATE.wait(60)
        return super().step(completion)


def test_blocking_steps_abandoned_at_their_budget_leave_the_default_executor_free(tok):
    """Replay and spool I/O run in the event loop's default executor: steps abandoned at their time budget must not
    hold its threads (they held them until they returned: 4 hanging tool calls stalled a 4-thread executor)."""
    from concurrent.futures import ThreadPoolExecutor

    async def four_stuck_then_io():
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=4))
        try:
            eps = await asyncio.gather(*(
                run_episode(ScriptEngine(), TurnRenderer(tok), Stuck(), "2+3", SAMPLING,
                            EpisodeConfig(max_turns=3, time_budget_s=0.3), f"req-{i}", 1024) for i in range(4)))
            io = await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(None, lambda: "io"), 5.0)
            return eps, io
        finally:
            GATE.set()

    GATE.clear()
    try:
        eps, io = asyncio.run(four_stuck_then_io())
    except TimeoutError:
        raise AssertionError("the default executor stayed blocked by the abandoned steps") from None
    assert io == "io" and all(e.error.startswith("episode-time_budget: over 0.3 s") for e in eps)


def test_past_max_stuck_calls_new_calls_are_refused_until_a_stuck_one_returns(tok):
    """A rollout bounds the blocking calls it abandoned: at ``max_stuck_calls`` still running, new episodes break at
    once (``episode-env_stuck``) without an environment being made; counted in the rollout's stats and metrics."""
    from gyre.rollout.stats import RolloutStats
    from gyre.services.common.observability import RolloutMetrics

    run = EpisodeRunner(EnvironmentConfig(factory="tests.unit.rollout.test_episodes:Stuck", max_turns=2,
                                          time_budget_s=0.3, max_stuck_calls=2), tok)
    group = lambda: asyncio.run(run.run_group(ScriptEngine(), "2+2", 2, SAMPLING, "g", 1024, 3,  # noqa: E731
                                              fallback_prompt=[1]))
    GATE.clear()
    try:
        stuck = group()
        assert [e.error[:31] for e in stuck] == ["episode-time_budget: over 0.3 s"] * 2
        assert (run.threads.stuck, run.threads.abandoned) == (2, 2)
        made, start = Stuck.made, time.monotonic()
        refused = group()
        assert time.monotonic() - start < 0.3 and Stuck.made == made  # refused before the factory ran
        assert all(e.error.startswith("episode-env_stuck: 2 environment calls are still running past their "
                                      "episode's time budget (limit 2, rollout.environment.max_stuck_calls); "
                                      "refusing a new episode until one returns") for e in refused), refused[0].error
        env = Chatty()  # an episode already made when the bound was reached: its calls are refused, close is not
        ep = asyncio.run(run_episode(ScriptEngine(), TurnRenderer(tok), env, "2+3", SAMPLING, run.config, "req", 1024,
                                     threads=run.threads))
        assert "refusing Chatty.reset until one returns" in ep.error and env.closed and env.turns == 0
        assert run.threads.refused == 3
    finally:
        GATE.set()
    deadline = time.monotonic() + 10
    while run.threads.stuck and time.monotonic() < deadline:
        time.sleep(0.01)
    assert run.threads.stuck == 0  # the stuck steps returned: calls are taken again
    assert [e.error for e in group()] == ["", ""]
    stats = RolloutStats(env_threads=run.threads).as_dict(0)
    assert (stats["env_calls_stuck"], stats["env_calls_abandoned"], stats["env_calls_refused"]) == (0, 2, 3)
    samples = {s.name: s.value for f in RolloutMetrics("run", "r0", source=lambda: stats).registry.collect()
               for s in f.samples}
    assert (samples["gyre_rollout_env_calls_stuck"], samples["gyre_rollout_env_calls_abandoned_total"],
            samples["gyre_rollout_env_calls_refused_total"]) == (0, 2, 3)


def test_megabytes_of_tool_output_are_cut_before_tokenising(tok):
    ep, _ = play(Chatty(output="x" * 2_000_000), config=EpisodeConfig(max_turns=2, max_observation_chars=64), tok=tok)
    tool = [m for m in ep.messages if m["role"] == "tool"][0]["content"]
    assert len(tool) == 64 and tool.endswith("[... 1999936 chars cut]")
    assert ep.loss_mask.count(0) < 64


def test_a_full_context_ends_the_episode_with_max_tokens(tok):
    ep, engine = play(Chatty(output="y " * 200), config=EpisodeConfig(max_turns=5), max_model_len=120, tok=tok)
    assert (ep.episode_end, ep.finish_reason, ep.error) == ("max_tokens", "length", "")
    assert len(ep.prompt_token_ids) + len(ep.token_ids) < 120


def test_a_cut_turn_is_closed_with_the_end_token_as_an_observation_token(tok):
    ep, _ = play(Chatty(), engine=ScriptEngine(closed=False), config=EpisodeConfig(max_turns=2), tok=tok)
    assert ep.token_ids[2] == 2 and ep.loss_mask[2] == 0  # <|im_end|> written by gyre, not trained on


@pytest.mark.parametrize("reset, message", [
    (lambda self, p: "hello", "reset returned 'hello'; expected a list of messages"),
    (lambda self, p: 1 / 0, "reset raised ZeroDivisionError: division by zero"),
])
def test_bad_resets_break_the_episode_naming_what_was_wrong(tok, reset, message):
    env = type("Bad", (Chatty,), {"reset": reset})()
    ep, engine = play(env, tok=tok)
    assert ep.error.startswith(f"episode-env_error: {message}") and engine.contexts == []
    assert (ep.turn_starts, ep.version_span_starts, ep.version_span_versions) == ([0], [0], [0])


class Counting(Chatty):
    """Done after two turns, reward 1 on the last; reset varies with the episode when ``vary`` (broken)."""

    made = 0

    def __init__(self, vary: bool = False, explode: bool = False):
        super().__init__()
        if explode:
            raise OSError("no sandbox left")
        Counting.made += 1
        self.vary, self.n = vary, Counting.made

    def reset(self, problem):
        return [{"role": "user", "content": f"Compute {problem}" + (f" #{self.n}" if self.vary and self.n % 2 else "")}]

    def step(self, completion):
        super().step(completion)
        return EnvStep(reward=1.0, done=True) if self.turns == 2 else EnvStep(
            observation=[{"role": "tool", "content": "4"}], tool_calls=1)


def runner(tok, **kwargs):
    return EpisodeRunner(EnvironmentConfig(factory="tests.unit.rollout.test_episodes:Counting", max_turns=3,
                                           kwargs=kwargs), tok)


def test_a_group_of_episodes_becomes_valid_rows_and_broken_ones_are_not_trained(tok):
    run = runner(tok, vary=True)
    eps = asyncio.run(run.run_group(ScriptEngine(), "2+2", 4, SAMPLING, "g", 1024, 3, fallback_prompt=[1]))
    rows = from_table(to_table(run.rows(eps, 0, 0, "calc", "r0", 0)))
    prompts = {tuple(r.prompt_token_ids) for r in rows}
    assert len(prompts) == 1  # the group shares its prompt: the majority's
    ok = [r for r in rows if not r.reward_error]
    bad = [r for r in rows if r.reward_error]
    assert len(ok) == 2 and len(bad) == 2
    assert all(r.reward == 1.0 and r.episode_end == "done" and r.tool_calls == 1 and len(r.turn_starts) == 2
               for r in ok)
    assert all(r.reward == 0.0 and "reset returned other first messages" in r.reward_error
               and r.response_token_ids == [] for r in bad)
    assert ok[0].reward_fn_version.startswith("env:tests.unit.rollout.test_episodes:Counting@")


def test_the_task_reward_gets_each_episodes_last_model_turn_as_text_and_token_ids(tok):
    # Two turns per episode (a tool observation between them): a length-based task reward must see the last turn's
    # tokens. Before the fix completion_ids was [] for every episode: such a reward gave the group one constant
    # score and zero advantage, silently.
    run = runner(tok)
    engine = ScriptEngine()
    eps = asyncio.run(run.run_group(engine, "2+2", 2, SAMPLING, "g", 1024, 3, fallback_prompt=[1]))
    group = run.task_group(eps, {"answer": "4"})
    assert all(len(e.turn_starts) == 2 for e in eps)
    for e, ids in zip(eps, group.completion_ids, strict=True):
        last = e.turn_starts[-1]
        assert ids == e.token_ids[last:last + 3] and ids[-1] == 2 and len(ids) == 3  # [100 + k, 7, <|im_end|>]
        assert ids != e.token_ids[:3]  # the last turn, not the first
    assert group.completions == ["call calc", "call calc"]
    broken = run.task_group([type(eps[0])(prompt_token_ids=[1])], {"answer": "4"})
    assert broken.completion_ids == [[]] and broken.completions == [""]


def test_a_factory_that_raises_breaks_every_episode_and_a_bad_spec_fails_at_start(tok):
    run = runner(tok, explode=True)
    eps = asyncio.run(run.run_group(ScriptEngine(), "2+2", 2, SAMPLING, "g", 1024, 3, fallback_prompt=[1, 2]))
    rows = from_table(to_table(run.rows(eps, 0, 0, "calc", "r0", 0)))
    assert [r.reward_error for r in rows] == ["episode-env_error: factory raised OSError: no sandbox left"] * 2
    assert all(r.prompt_token_ids == [1, 2] for r in rows)
    with pytest.raises(EnvironmentLoadError, match="rollout.environment.factory 'tests.unit.rollout.test_episodes:Nope'"):
        EpisodeRunner(EnvironmentConfig(factory="tests.unit.rollout.test_episodes:Nope"), tok)
    with pytest.raises(ValueError, match="rollout.environment.factory 'no colon'"):
        EnvironmentConfig(factory="no colon")


def test_the_worker_streams_episode_groups_with_masks_and_counts_them(tok):
    buf = TrajectoryBuffer(ReplayConfig())
    config = RolloutConfig.model_construct(
        engine=type("E", (), {"max_model_len": 1024})(), sampling=SAMPLING, group_size=2, groups_in_flight=2,
        max_ready_groups=2, retry_backoff_s=0.01, num_workers=1,
        environment=EnvironmentConfig(factory="tests.unit.rollout.test_episodes:Counting", max_turns=3))
    worker = RolloutWorker("r0", config, TASK, ScriptEngine(), FakeReplay(buf), tok, seed=3)

    async def go():
        task = asyncio.create_task(worker.run())
        await until(lambda: task.done() or buf.info()["size_groups"] >= 2, "two episode groups in replay")
        worker.stop()
        await task

    asyncio.run(go())
    _, table = buf.sample(1, learner_version=0)
    row = from_table(table)[0]
    assert row.episode_end == "done" and 0 in row.loss_mask and row.reward == 1.0
    stats = worker.stats.as_dict(0)["episodes"]
    assert stats["episodes"] == 2 * worker.stats.groups and stats["turns"] == 2 * stats["episodes"]
    assert stats["tool_calls"] == stats["episodes"] and stats["end/done"] == stats["episodes"]
    assert worker.stats.tokens == 6 * stats["episodes"]  # sampled tokens only (2 turns × 3), not observations


def test_evaluation_runs_one_greedy_episode_per_held_out_problem_and_reports_tool_use(tok):
    from gyre.rollout.evaluation import EvalConfig

    config = RolloutConfig.model_construct(
        engine=type("E", (), {"max_model_len": 1024})(), sampling=SAMPLING, group_size=2, groups_in_flight=2,
        max_ready_groups=2, retry_backoff_s=0.01, num_workers=1,
        environment=EnvironmentConfig(factory="tests.unit.rollout.test_episodes:Counting", max_turns=3))
    engine = ScriptEngine()
    worker = RolloutWorker("r0", config, TASK, engine, FakeReplay(TrajectoryBuffer(ReplayConfig())), tok, seed=3)
    result = asyncio.run(worker.evaluate(EvalConfig(n_samples=2)))
    m = result.metrics
    assert m["heldout_size"] == 4 and m["heldout_accuracy"] == 1.0  # the environment's reward 1 (+ task's 0)
    assert (m["heldout_tool_use_rate"], m["heldout_tool_calls_mean"], m["heldout_turns_mean"]) == (1.0, 1.0, 2.0)
    assert m["heldout_broken"] == 0 and m["heldout_pass@2"] == 1.0
    greedy = [r for r in result.completions if r["greedy"]]
    assert len(greedy) == 4 and len(result.completions) == 4 + 4 * 2
    assert greedy[0]["transcript"][-1] == {"role": "assistant", "content": "call calc"}
    assert greedy[0]["turns"] == 2 and greedy[0]["episode_end"] == "done"


def test_the_tool_use_example_recipe_loads_and_its_environment_starts(tok):
    from pathlib import Path

    from gyre.services.control.recipe.schema import load_recipe

    repo = Path(__file__).resolve().parents[3]
    recipe = load_recipe(repo / "examples/tool-use/recipe.yaml", dry_run=True)
    env_cfg = recipe.rollout.environment
    assert env_cfg.factory == "gyre.rollout.agents.tools:ToolEnvironment" and env_cfg.max_turns == 3
    runner = EpisodeRunner(env_cfg, tok)
    first = runner._make().reset(type("P", (), {"question": "What is 1 + 2?"})())
    assert [m["role"] for m in first] == ["system"] + ["user", "assistant", "tool", "assistant"] * 2 + ["user"]
    assert len(runner.renderer.prompt_ids(first)) < recipe.rollout.engine.max_model_len // 2
