"""The fleet's work budget (``ReplayConfig.work_budget``): groups ready in replay plus prompts leased for generation
never exceed what the learner can use before they go stale, however many rollouts ask, and rollouts lease in
batches without polling ``Info`` per prompt. On the code before it, every rollout leased ``groups_in_flight``
prompts (N × groups_in_flight in all) and called ``Info`` before each one."""

import asyncio

import pytest
from pydantic import ValidationError

from gyre.replay.buffer import TrajectoryBuffer
from gyre.replay.config import ReplayConfig
from gyre.rollout.config import RolloutConfig, SamplingConfig
from gyre.rollout.worker import RolloutWorker
from gyre.services.control.recipe.schema import load_recipe
from tests.fakes import FakeReplay, FakeTokenizer, SlowEngine, group_table, until
from tests.unit.rollout.test_version_gate import TASK

CONFIG = ReplayConfig(max_staleness=1, groups_per_step=2, work_budget_margin_steps=2)  # (1 + 2) steps x 2 = 6


def test_the_budget_is_the_staleness_window_plus_a_margin_in_groups():
    assert CONFIG.work_budget == 6
    assert ReplayConfig(max_staleness=2, groups_per_step=2).work_budget == 4  # max_staleness steps by default
    assert ReplayConfig(max_staleness=0, groups_per_step=2).work_budget == 2  # synchronous: one batch at a time
    assert ReplayConfig(max_staleness=2, groups_per_step=32, work_budget_margin_steps=0.5).work_budget == 80
    assert ReplayConfig().work_budget is None  # no groups_per_step: no budget (as before)
    with pytest.raises(ValidationError, match="groups_per_step"):
        ReplayConfig(groups_per_step=0)


def test_leases_stop_at_the_budget_and_resume_as_the_learner_consumes():
    buf = TrajectoryBuffer(CONFIG)
    first = buf.lease_prompts("rollout-0", 10)
    assert len(first) == 6 and buf.lease_prompts("rollout-1", 4) == [] and buf.prompts.budget() == 0
    for index, attempt in first[:2]:  # two groups land: still 6 ready or leased
        buf.insert(group_table(index, attempt=attempt))
    assert buf.lease_prompts("rollout-1", 4) == [] and buf.info()["size_groups"] == 2
    assert buf.sample(2, learner_version=0, consumer="learner") is not None  # the learner takes a batch: room for 2 more
    assert len(buf.lease_prompts("rollout-1", 4)) == 2 and buf.prompts.budget() == 0


def test_max_ready_groups_still_holds_per_request():
    buf = TrajectoryBuffer(ReplayConfig())
    index, attempt = buf.lease_prompts("rollout-0", 1)[0]
    buf.insert(group_table(index, attempt=attempt))
    assert buf.lease_prompts("rollout-0", 3, max_ready=1) == []
    assert len(buf.lease_prompts("rollout-0", 3, max_ready=2)) == 3


def test_max_ready_below_a_learner_batch_never_starves_the_learner():
    """A ``max_ready_groups`` under ``groups_per_step`` used to stop every rollout with fewer groups ready than the
    learner's batch: the learner waited for ever (seen in ``bench.fleet``: 15 groups ready, 16 wanted, no prompt
    leased). Leasing now goes on until a batch's worth (this shard's share of it) is ready."""
    buf = TrajectoryBuffer(ReplayConfig(groups_per_step=4))
    for index, attempt in buf.lease_prompts("rollout-0", 3):
        buf.insert(group_table(index, attempt=attempt))
    assert len(buf.lease_prompts("rollout-0", 1, max_ready=2)) == 1  # 3 ready < 4: the batch is not there yet
    buf.insert(group_table(3))
    assert buf.lease_prompts("rollout-0", 1, max_ready=2) == []  # 4 ready: a batch; back to the rollout's bound
    shard = TrajectoryBuffer(ReplayConfig(groups_per_step=4, shards=2, shard=1))  # its share: 2 of the 4
    for index, attempt in shard.lease_prompts("rollout-0", 2):
        shard.insert(group_table(index, attempt=attempt))
    assert shard.lease_prompts("rollout-0", 1, max_ready=1) == []


def test_a_rollout_behind_the_learner_gets_a_smaller_budget_and_none_past_the_staleness_bound():
    """The budget counts the asking rollout's lag: its groups start that many versions staler, so they would wait
    past the staleness gate behind a full budget (``bench.fleet`` at 16 rollouts dropped 9% with the lag uncounted)."""
    buf = TrajectoryBuffer(ReplayConfig(max_staleness=2, groups_per_step=2))
    buf.rejoin("learner", 5)
    assert buf.state.work_budget_left(5) == 4 and buf.state.work_budget_left() == 4  # level: 2 steps of 2
    assert buf.state.work_budget_left(4) == 2 and buf.state.work_budget_left(3) == 2  # one step at least
    assert buf.state.work_budget_left(2) == 0  # 3 behind: all it generated would be dropped
    assert buf.lease_prompts("rollout-0", 4, policy_version=2) == []
    assert len(buf.lease_prompts("rollout-0", 4, policy_version=4)) == 2
    assert len(buf.lease_prompts("rollout-1", 4, policy_version=5)) == 2  # the fleet's 4, 2 already leased


class CountingReplay(FakeReplay):
    def __init__(self, buffer):
        super().__init__(buffer)
        self.info_calls = self.lease_calls = 0

    def info(self):
        self.info_calls += 1
        return super().info()

    def lease_prompts(self, *args, **kwargs):
        self.lease_calls += 1
        return super().lease_prompts(*args, **kwargs)


def test_a_fleet_of_rollouts_holds_no_more_than_the_budget_and_never_polls_info():
    buf = TrajectoryBuffer(CONFIG)
    config = RolloutConfig.model_construct(
        engine=None, sampling=SamplingConfig(), group_size=2, groups_in_flight=8, max_ready_groups=100,
        retry_backoff_s=0.01, num_workers=1, max_groups_per_version=None)
    replays = [CountingReplay(buf) for _ in range(16)]
    workers = [RolloutWorker(f"rollout-{i}", config, TASK, SlowEngine(["7"], delay_s=60.0), r, FakeTokenizer(),
                             seed=i) for i, r in enumerate(replays)]

    async def scenario():
        tasks = [asyncio.create_task(w.run()) for w in workers]
        await until(lambda: sum(w.stats.groups_in_flight for w in workers) >= 6, "the fleet to fill the budget")
        await asyncio.sleep(1.5)  # every rollout asked again at least twice meanwhile
        held = sum(w.stats.groups_in_flight for w in workers)
        for w in workers:
            w.stop()
        await asyncio.gather(*tasks)
        return held

    assert asyncio.run(scenario()) == 6  # 16 rollouts x 8 in flight = 128 without the budget
    assert sum(r.info_calls for r in replays) == 0
    assert max(r.lease_calls for r in replays) < 20  # one batch request, then one every 0.5 s


def test_gyre_run_gives_replay_the_learners_groups_per_step():
    recipe = load_recipe("deploy/recipes/tiny-test.yaml", dry_run=True)
    assert recipe.replay.groups_per_step == recipe.learner.groups_per_step == 2
    assert recipe.replay.work_budget == max(recipe.replay.max_staleness, 1) * 2
    pinned = load_recipe("deploy/recipes/tiny-test.yaml", {"replay.groups_per_step": 5}, dry_run=True)
    assert pinned.replay.groups_per_step == 5


def test_info_reports_the_budget_left_and_the_stale_fraction():
    buf = TrajectoryBuffer(CONFIG)
    leased = buf.lease_prompts("rollout-0", 3)
    assert buf.info()["work_budget_left"] == 3 and buf.info()["dropped_stale_fraction"] == 0.0
    buf.insert(group_table(leased[0][0], attempt=leased[0][1], version=0))
    buf.sample(1, learner_version=5, consumer="learner")  # the learner moved on: the group is too stale
    assert buf.info()["dropped_stale_fraction"] == 1.0
    assert TrajectoryBuffer(ReplayConfig()).info()["work_budget_left"] == -1
