import asyncio

from replay.buffer import TrajectoryBuffer
from replay.config import ReplayConfig
from rollout.config import SamplingConfig
from rollout.tasks import TaskConfig, TaskSource
from rollout.worker import RolloutConfig, RolloutWorker
from rollout.types import Sample
from tests.fakes import FakeEngine, FakeReplay, FakeTokenizer

TASK = TaskSource(TaskConfig(params={"min_terms": 2, "max_terms": 2, "max_digits": 1, "operators": ["+"],
                                     "allow_parentheses": False, "allow_negation": False}, heldout_size=4))


def make_worker(replay, engine=None, **cfg):
    config = RolloutConfig.model_construct(
        engine=None, sampling=SamplingConfig(), group_size=cfg.get("group_size", 2),
        groups_in_flight=cfg.get("groups_in_flight", 2), max_ready_groups=cfg.get("max_ready_groups", 3),
        eval_max_new_tokens=8, retry_backoff_s=0.01, num_workers=1)
    return RolloutWorker("r0", config, TASK, engine or FakeEngine(["7"]), replay, FakeTokenizer(), seed=3)


async def run_for(worker, seconds):
    task = asyncio.create_task(worker.run())
    await asyncio.sleep(seconds)
    worker.stop()
    await task


def test_worker_streams_whole_scored_groups_until_backpressure():
    buf = TrajectoryBuffer(ReplayConfig())
    worker = make_worker(FakeReplay(buf), max_ready_groups=3)
    asyncio.run(run_for(worker, 1.0))
    info = buf.info()
    # Stops leasing once 3 groups wait (at most groups_in_flight more may already be in flight).
    assert 3 <= info["size_groups"] <= 3 + 2
    _, table = buf.sample(1, learner_version=0)
    row = table.to_pylist()[0]
    assert row["version_span_versions"] == [0, 1] and row["reward_fn_version"] == "rg-last-int-v1"
    assert row["trajectory_id"] == f"{row['prompt_index']}-{row['sample_index']}-0"


def test_worker_retries_inserts_while_replay_is_down_and_loses_nothing():
    buf = TrajectoryBuffer(ReplayConfig())
    replay = FakeReplay(buf, fail_inserts=3)
    worker = make_worker(replay, max_ready_groups=2, groups_in_flight=1)
    asyncio.run(run_for(worker, 1.0))
    assert worker.stats.insert_retries == 3
    assert buf.info()["prompts_completed"] == worker.stats.groups >= 2


def test_apply_weights_moves_forward_only():
    engine = FakeEngine(["1"], version=2)
    worker = make_worker(FakeReplay(TrajectoryBuffer(ReplayConfig())), engine=engine)
    asyncio.run(worker.apply_weights(1, []))
    asyncio.run(worker.apply_weights(3, []))
    assert engine.updates == [3] and worker.stats.weight_updates == 1


def test_evaluate_counts_exact_answers_only():
    problems = TASK.heldout_problems()
    answers = [problems[0]["answer"], problems[1]["answer"] + "1", "no number", problems[3]["answer"]]

    class ScriptedEngine(FakeEngine):
        async def generate_greedy(self, prompts, max_new_tokens):
            return [Sample([1], [-0.1], "stop", [0], [0], text=f"It is {a}") for a in answers]

    worker = make_worker(FakeReplay(TrajectoryBuffer(ReplayConfig())), engine=ScriptedEngine([]))
    result = asyncio.run(worker.evaluate())
    assert result["heldout_correct"] == 2 and result["heldout_accuracy"] == 0.5
