import asyncio

import pytest

from gyre.replay.buffer import TrajectoryBuffer
from gyre.replay.config import ReplayConfig
from gyre.rollout.config import RolloutConfig, SamplingConfig
from gyre.rollout.evaluation import EvalConfig
from gyre.rollout.tasks import TaskConfig, TaskSource
from gyre.rollout.worker import RolloutWorker
from gyre.rollout.types import Sample
from tests.fakes import FakeEngine, FakeReplay, FakeTokenizer, until

TASK = TaskSource(TaskConfig(params={"min_terms": 2, "max_terms": 2, "max_digits": 1, "operators": ["+"],
                                     "allow_parentheses": False, "allow_negation": False}, heldout_size=4))


def make_worker(replay, engine=None, **cfg):
    config = RolloutConfig.model_construct(
        engine=None, sampling=SamplingConfig(), group_size=cfg.get("group_size", 2),
        groups_in_flight=cfg.get("groups_in_flight", 2), max_ready_groups=cfg.get("max_ready_groups", 3),
        retry_backoff_s=0.01, num_workers=1)
    return RolloutWorker("r0", config, TASK, engine or FakeEngine(["7"]), replay, FakeTokenizer(), seed=3)


async def run_until(worker, cond, what: str):
    """Run ``worker`` until ``cond()`` holds (``tests.fakes.until``'s deadline), then stop it; raises what
    ``run()`` raised if it ended first."""
    task = asyncio.create_task(worker.run())
    await until(lambda: task.done() or cond(), what)
    worker.stop()
    await task


def stopped_by_backpressure(worker, buf, max_ready_groups: int):
    """Replay holds ``max_ready_groups`` and no group is in flight: no lease can follow (nobody samples)."""
    return lambda: buf.info()["size_groups"] >= max_ready_groups and worker.stats.groups_in_flight == 0


def test_worker_streams_whole_scored_groups_until_backpressure():
    buf = TrajectoryBuffer(ReplayConfig())
    worker = make_worker(FakeReplay(buf), max_ready_groups=3)
    asyncio.run(run_until(worker, stopped_by_backpressure(worker, buf, 3), "backpressure at 3 ready groups"))
    info = buf.info()
    # Stops leasing once 3 groups wait (at most groups_in_flight more may already be in flight).
    assert 3 <= info["size_groups"] <= 3 + 2
    _, table = buf.sample(1, learner_version=0)
    row = table.to_pylist()[0]
    assert row["version_span_versions"] == [0, 1] and row["reward_fn_version"] == "rg-last-int-exact-v1"
    assert row["trajectory_id"] == f"{row['prompt_index']}-{row['sample_index']}-0"


def test_worker_retries_inserts_while_replay_is_down_and_loses_nothing():
    buf = TrajectoryBuffer(ReplayConfig())
    replay = FakeReplay(buf, fail_inserts=3)
    worker = make_worker(replay, max_ready_groups=2, groups_in_flight=1)
    asyncio.run(run_until(worker, stopped_by_backpressure(worker, buf, 2), "backpressure at 2 ready groups"))
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
    result = asyncio.run(worker.evaluate(EvalConfig(n_samples=0))).metrics
    assert result["heldout_correct"] == 2 and result["heldout_accuracy"] == 0.5


def make_spool_worker(replay, spool_dir, engine=None, **cfg):
    config = RolloutConfig.model_construct(
        engine=None, sampling=SamplingConfig(), group_size=2, groups_in_flight=cfg.get("groups_in_flight", 2),
        max_ready_groups=cfg.get("max_ready_groups", 1000), retry_backoff_s=0.01,
        num_workers=1, spool_dir=str(spool_dir), spool_max_groups=cfg.get("spool_max_groups", 5),
        spool_max_bytes=cfg.get("spool_max_bytes", 10**9))
    return RolloutWorker("r0", config, TASK, engine or FakeEngine(["7"]), replay, FakeTokenizer(), seed=3)


def test_spool_keeps_generating_while_inserts_fail_until_its_limit_then_flushes(tmp_path):
    buf = TrajectoryBuffer(ReplayConfig())
    replay = FakeReplay(buf, fail_inserts=10**9)  # replay leases prompts but acknowledges no insert
    worker = make_spool_worker(replay, tmp_path, spool_max_groups=5, groups_in_flight=1)
    asyncio.run(run_until(worker, lambda: worker.spool.full() and worker.stats.groups_in_flight == 0
                          and worker.stats.insert_retries > 0, "a full spool (inserts failing)"))
    # Generation did not wait for acks: it stopped at the spool limit (5 groups), not at the first insert.
    assert worker.stats.groups == 5 and buf.ledger.num_leased == 5
    assert worker.spool.stats().pending_groups == 5 and buf.info()["prompts_completed"] == 0
    assert worker.stats.insert_retries > 0 and worker.stats.as_dict(0)["spool_pending_groups"] == 5
    replay.fail_inserts = 0  # replay is back; a new incarnation on the same spool dir flushes first
    again = make_spool_worker(replay, tmp_path, spool_max_groups=5, groups_in_flight=1, max_ready_groups=7)
    asyncio.run(run_until(again, stopped_by_backpressure(again, buf, 7), "backpressure at 7 ready groups"))
    assert asyncio.run(again.flusher.drain(5.0)) == 0
    info = buf.info()
    assert info["prompts_completed"] == 5 + again.stats.groups and info["duplicates_total"] == 0
    assert again.stats.groups >= 2 and list(tmp_path.glob("*.arrow")) == []


def test_full_outage_groups_in_flight_land_in_spool_and_nothing_is_lost(tmp_path):
    from tests.fakes import OutageReplay, SlowEngine

    async def scenario(worker, replay):
        task = asyncio.create_task(worker.run())
        await until(lambda: buf.ledger.num_leased == 2, "two groups leased and generating")
        replay.down = True
        await until(lambda: len(engine.generated) >= 2 and worker.stats.groups_in_flight == 0,
                    "the groups leased before the outage to finish")
        in_outage = worker.spool.stats().pending_groups
        # the flusher's insert runs in an executor thread: lifting the outage before it ran raced it (flaky
        # under load: no retry counted); wait until it met the outage
        await until(lambda: worker.stats.insert_retries > 0, "the flusher to meet the outage")
        replay.down = False
        await until(lambda: len(engine.generated) >= 4, "leasing to resume after the outage")
        worker.stop()
        await task
        return in_outage, await worker.flusher.drain(5.0)

    buf = TrajectoryBuffer(ReplayConfig())
    replay, engine = OutageReplay(buf), SlowEngine(["7"], delay_s=0.3)
    worker = make_spool_worker(replay, tmp_path, engine=engine, groups_in_flight=2, spool_max_groups=50)
    in_outage, left = asyncio.run(scenario(worker, replay))
    assert in_outage == 2 and left == 0  # the groups leased before the outage finished into the spool
    generated = sorted(int(r.split("-")[0]) for r in engine.generated)
    _, table = buf.sample(buf.info()["size_groups"], learner_version=0)
    assert sorted(set(table.column("prompt_index").to_pylist())) == generated
    assert table.num_rows == 2 * len(generated) == len(set(table.column("trajectory_id").to_pylist()))
    assert worker.stats.insert_retries > 0 and len(generated) >= 4 and engine.generated[:2] == ["0-0@r0", "1-0@r0"]


def test_a_lockstep_rollout_accepts_a_version_offer_before_its_engine_loaded_any(tmp_path):
    """Lockstep engines start at version -1 and load each prompt's version themselves; the subscriber's
    offer must still count as taken (binding the engine's -1 to the logs raised, so the offer was
    reported refused and sent again)."""
    import threading

    from gyre.proto.lockstep import LockstepConfig
    from gyre.rollout.versions import LockstepVersions
    from gyre.services.common import logs
    from gyre.services.rollout.actor import RolloutActor

    engine = FakeEngine(["7"], version=-1)

    class LockstepWorker:  # the worker's weight path: offered versions are only noted
        versions = LockstepVersions(LockstepConfig(groups_per_step=2, weights_dir=str(tmp_path))).bind(engine)

        async def apply_weights(self, version, named_tensors, timeline=0):
            assert not self.versions.offer(version)

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    cls = RolloutActor.__ray_actor_class__  # the class under @ray.remote, without a Ray cluster
    actor = cls.__new__(cls)
    actor.engine, actor.worker, actor.loop, actor.journal = engine, LockstepWorker(), loop, None
    try:
        actor._on_version(3, [], 0)
        assert logs._policy_version == 3 and actor._version() == 3
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        logs._policy_version = None


class _ScriptedInserts:
    """A replay whose ``insert`` does what ``script`` says per call (an exception class to raise, a
    ``threading.Event`` to block on, or ``None`` to acknowledge); the last entry repeats."""

    def __init__(self, *script) -> None:
        self.script, self.calls = list(script), 0

    def insert(self, table):
        import threading

        step = self.script[min(self.calls, len(self.script) - 1)]
        self.calls += 1
        if isinstance(step, threading.Event):
            step.wait(30)
            raise ConnectionError("replay answered too late")
        if step is not None:
            raise step("scripted")


def test_insert_retry_waits_double_up_to_the_cap_and_logs_each_retry(monkeypatch):
    from structlog.testing import capture_logs

    from gyre.rollout import worker as rollout_worker

    monkeypatch.setattr(rollout_worker, "INSERT_BACKOFF_CAP_S", 0.04)
    replay = _ScriptedInserts(ConnectionError, ConnectionError, ConnectionError, ConnectionError, None)
    worker = make_worker(replay)  # retry_backoff_s=0.01
    with capture_logs() as logs:
        asyncio.run(worker._insert_with_retry(None))
    assert replay.calls == 5 and worker.stats.insert_retries == 4
    assert [(e["event"], e["rollout"], e["retry_in_s"]) for e in logs] == [
        ("insert_retry", "r0", w) for w in (0.01, 0.02, 0.04, 0.04)]


def test_insert_raises_a_non_connection_error_at_once():
    replay = _ScriptedInserts(ValueError)
    worker = make_worker(replay)
    with pytest.raises(ValueError, match="scripted"):  # a retrying insert would time out here instead
        asyncio.run(asyncio.wait_for(worker._insert_with_retry(None), 10))
    assert replay.calls == 1 and worker.stats.insert_retries == 0


@pytest.mark.parametrize("phase", ["backoff", "in_flight"])
def test_stopping_the_worker_ends_an_insert_retry_at_once(phase):
    """Without a spool a group's slot waits for its insert: ``stop()`` must end the backoff wait (60 s here), and
    an insert in flight without sending it again (its retry must not swallow the cancellation)."""
    import threading

    buf, released = TrajectoryBuffer(ReplayConfig()), threading.Event()
    replay = _ScriptedInserts(ConnectionError if phase == "backoff" else released)
    replay.lease_prompts = lambda consumer, count, *args, **kwargs: buf.lease_prompts(consumer, count)
    replay.info = FakeReplay(buf).info
    worker = make_worker(replay, groups_in_flight=1)
    worker.config = worker.config.model_copy(update={"retry_backoff_s": 60.0})
    reached = (lambda: worker.stats.insert_retries == 1) if phase == "backoff" else (lambda: replay.calls == 1)

    async def stop_during_the_insert():
        task = asyncio.create_task(worker.run())
        try:
            await until(reached, f"the insert's {phase}")
            worker.stop()
            await asyncio.wait_for(task, 30)  # well inside the 60 s backoff
        except TimeoutError:
            raise AssertionError(f"run() still going 30 s after stop() during the insert's {phase}") from None
        finally:
            released.set()  # the blocked insert thread ends (asyncio.run waits for its executor)
    asyncio.run(stop_during_the_insert())
    assert replay.calls == 1 and worker.stats.insert_retries == (phase == "backoff")


def test_a_stopped_worker_generates_again_with_another_run():
    """``stop()`` ends the run it was meant for only: the next ``run()`` leases and generates again, and a ``stop()``
    right after ``create_task(worker.run())`` (before the loop first ran) still stops that run."""
    buf = TrajectoryBuffer(ReplayConfig())
    worker = make_worker(FakeReplay(buf), max_ready_groups=1000)

    async def lifecycle():
        await run_until(worker, lambda: worker.stats.groups >= 2, "two groups in the first run")
        first = worker.stats.groups
        await run_until(worker, lambda: worker.stats.groups >= first + 2, "two more groups after a restart")
        assert worker.stats.groups >= first + 2, "the second run() ended at once: the first one's stop() stuck"
        task = asyncio.create_task(worker.run())
        worker.stop()  # before the task's first step
        await asyncio.wait_for(task, 10)
        with pytest.raises(RuntimeError, match="still generating"):
            task = asyncio.create_task(worker.run())
            await asyncio.sleep(0)
            worker.run()
        worker.stop()
        await task

    asyncio.run(lifecycle())


def test_the_rollout_actor_starts_again_after_pause_and_drain():
    """The actor's ``start`` after ``pause`` or ``drain`` generates again (drain's no-more-leases is lifted), and
    ``start`` after ``stop`` raises instead of generating on a shut-down engine."""
    import threading

    from gyre.services.common.replay_links import TrackedReplay
    from gyre.services.rollout.actor import RolloutActor

    buf = TrajectoryBuffer(ReplayConfig())
    replay = TrackedReplay(FakeReplay(buf), connect=lambda address: None)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    cls = RolloutActor.__ray_actor_class__  # the class under @ray.remote, without a Ray cluster
    actor = cls.__new__(cls)
    actor.rollout_id, actor.loop, actor.replay, actor.task, actor.stopped = "r0", loop, replay, None, False
    actor.worker = make_worker(replay, max_ready_groups=1000)
    run = lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=60)  # noqa: E731

    def generates(what: str) -> None:
        before = actor.worker.stats.groups
        run(actor.start())
        run(until(lambda: actor.worker.stats.groups >= before + 2, what))

    try:
        generates("groups after the first start")
        run(actor.pause())
        generates("groups after a start that followed pause")
        # (a group the pause cancelled keeps its lease counted as undelivered: drain waits out its 1 s for it)
        run(actor.drain(1.0))
        assert replay.draining and actor.task is None
        generates("groups after a start that followed drain")
        run(actor.pause())
        actor.stopped = True  # what stop() sets before shutting the engine down
        with pytest.raises(RuntimeError, match="r0 was stopped"):
            run(actor.start())
        assert actor.task is None
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
