"""Policy-version timelines (``proto.timeline``, issue #21 finding 3): after a learner resumes from an older
checkpoint, rollouts drop the crashed learner's weights and take the new learner's, even under a lower or
the same version number; and the final evaluation waits for the learner's timeline, not just its number."""

import asyncio
import threading
import time

import pyarrow as pa
import torch

from gyre.learner.publisher import WeightPublisher
from gyre.proto.timeline import SHARED, is_new
from gyre.replay.buffer import TrajectoryBuffer
from gyre.replay.config import ReplayConfig
from gyre.services.learner import weight_server
from gyre.services.rollout.transport.subscriber import WeightSubscriber
from tests.fakes import FakeEngine, FakeReplay, SlowEngine, until
from tests.unit.rollout.test_rollout_worker import make_worker

DEAD, LIVE = 111, 222  # the crashed learner's timeline, the resumed learner's


def _weights(v: float, timeline: int):
    return [("w", torch.full((8,), float(v) + timeline / 1000.0))]


def _wait(cond, what: str, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.02)


def test_offer_rule():
    assert is_new(3, DEAD, 2, DEAD) and not is_new(2, DEAD, 2, DEAD) and not is_new(1, DEAD, 2, DEAD)
    assert is_new(1, LIVE, 2, DEAD) and is_new(2, LIVE, 2, DEAD)  # another timeline: whatever the number
    assert is_new(0, SHARED, -1, SHARED) and not is_new(0, SHARED, 0, SHARED)


def test_republished_versions_and_the_last_version_reach_a_subscriber_holding_the_dead_timeline():
    """The crashed learner published 1..3 (3 the last, then it crashed); the resumed one (checkpoint 1)
    publishes 1, 2, 3 again under its own timeline: each must replace what the subscriber holds."""
    dead = WeightPublisher()
    server, port = weight_server.serve(dead)
    got: list[tuple[int, int, torch.Tensor]] = []
    on_version = lambda v, tensors, tl: got.append((v, tl, tensors[0][1].clone()))  # noqa: E731
    sub = WeightSubscriber(f"127.0.0.1:{port}", on_version, name="r0", backoff_s=0.1).start()
    for v in (1, 2, 3):
        dead.publish(v, _weights(v, DEAD), timeline=DEAD)
    _wait(lambda: got and got[-1][:2] == (3, DEAD), "the dead learner's last version")
    sub.stop()
    server.stop(0).wait()

    live = WeightPublisher()  # the resumed learner: a new process, a new server (set_weights_address)
    server, port = weight_server.serve(live)
    sub = WeightSubscriber(f"127.0.0.1:{port}", on_version, have_version=sub.have_version,
                           have_timeline=sub.have_timeline, name="r0", backoff_s=0.1).start()
    try:
        live.publish(1, _weights(1, LIVE), timeline=LIVE)  # lower than the 3 it holds
        _wait(lambda: got[-1][:2] == (1, LIVE), "the resumed learner's republished version 1")
        live.publish(2, _weights(2, LIVE), timeline=LIVE)
        _wait(lambda: got[-1][:2] == (2, LIVE), "version 2 of the live timeline")
        live.publish(3, _weights(3, LIVE), timeline=LIVE)  # the number the dead learner ended on
        _wait(lambda: got[-1][:2] == (3, LIVE), "the live timeline's last version")
    finally:
        sub.stop()
        server.stop(0)
    assert torch.equal(got[-1][2], _weights(3, LIVE)[0][1])  # the final weights are the live learner's
    assert (sub.have_version, sub.have_timeline) == (3, LIVE)


def test_worker_switches_timeline_down_cancelling_dead_groups_then_moves_forward_only():
    buf = TrajectoryBuffer(ReplayConfig())
    engine = SlowEngine(["7"], delay_s=60.0)  # groups stay in flight until cancelled
    worker = make_worker(FakeReplay(buf), engine=engine, groups_in_flight=2)

    async def scenario():
        await worker.apply_weights(3, [], DEAD)
        task = asyncio.create_task(worker.run())
        await until(lambda: worker.stats.groups_in_flight == 2, "two groups in flight on the dead weights")
        await worker.apply_weights(2, [], LIVE)  # the resumed learner's first version: lower
        assert (engine.version, worker.timeline) == (2, LIVE) and worker.stats.groups_dropped_on_switch == 2
        await until(lambda: worker.stats.groups_in_flight == 2, "new groups on the live weights")
        for v in (2, 1):  # same or older on the live timeline: ignored
            await worker.apply_weights(v, [], LIVE)
        await worker.apply_weights(3, [], LIVE)  # the dead timeline's number, the live weights
        worker.stop()
        await task

    asyncio.run(scenario())
    assert engine.updates == [3, 2, 3] and worker.stats.timeline_switches == 2  # SHARED→DEAD, DEAD→LIVE
    assert worker.serves(3, LIVE) and not worker.serves(3, DEAD) and buf.info()["inserted_total"] == 0


def test_final_evaluation_waits_for_the_learners_timeline_not_its_number():
    """Crash after the last publish: the rollout holds version 3 of the dead timeline, the resumed learner
    ends on version 3 of its own. Waiting for "version 3" must not accept the dead weights."""
    from gyre.services.rollout.actor import RolloutActor

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    cls = RolloutActor.__ray_actor_class__  # the class under @ray.remote, without a Ray cluster
    actor = cls.__new__(cls)
    engine = FakeEngine(["7"])
    actor.engine, actor.loop, actor.journal = engine, loop, None
    actor.worker = make_worker(FakeReplay(TrajectoryBuffer(ReplayConfig())), engine=engine)
    run = lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=30)  # noqa: E731
    try:
        actor._on_version(3, [], DEAD)
        assert run(actor.wait_for_version(3, 0.3, DEAD)) == 3
        assert run(actor.wait_for_version(3, 0.3, LIVE)) == -1  # the dead weights do not count
        actor._on_version(3, [], LIVE)
        assert run(actor.wait_for_version(3, 0.3, LIVE)) == 3 and engine.updates == [3, 3]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)


def test_learner_publishes_version_0_shared_and_later_versions_under_its_incarnation(tmp_path):
    from gyre.learner.config import LearnerConfig
    from gyre.learner.loop import LearnerLoop, LearnerLoopConfig
    from tests.tiny_model import SMOLLM2_DIR

    class Engine:  # what publish_current reads
        step = version = 0

        def capture_weights(self):
            return [("w", torch.full((2,), float(self.version)))]

    def loop():
        cfg = LearnerLoopConfig(engine=LearnerConfig(model=str(SMOLLM2_DIR)), groups_per_step=2)
        return LearnerLoop(cfg, Engine(), FakeReplay(TrajectoryBuffer(ReplayConfig())), WeightPublisher(),
                           pad_token_id=0)

    first, second = loop(), loop()
    assert first.timeline != second.timeline and SHARED not in (first.timeline, second.timeline)
    first.publish_current()
    assert first.publisher.latest() == (0, SHARED)
    first.engine.version = 4
    first.publish_current()
    assert first.publisher.latest() == (4, first.timeline)


def test_worker_labels_each_trajectory_with_the_timeline_of_the_weights_that_sampled_it():
    buf = TrajectoryBuffer(ReplayConfig())
    engine = FakeEngine(["7"])  # spans [v, v + 1]: version 0 samples a newest span of version 1
    worker = make_worker(FakeReplay(buf), engine=engine, groups_in_flight=1, max_ready_groups=1000)

    async def scenario():
        await worker.apply_weights(3, [], DEAD)
        task = asyncio.create_task(worker.run())
        await until(lambda: buf.info()["prompts_completed"] >= 1, "a group on the dead timeline")
        await worker.apply_weights(2, [], LIVE)
        done = buf.info()["prompts_completed"]
        await until(lambda: buf.info()["prompts_completed"] > done, "a group on the live timeline")
        worker.stop()
        await task

    asyncio.run(scenario())
    _, table = buf.sample(buf.info()["size_groups"], learner_version=0)
    seen = {(t, v[-1]) for t, v in zip(table.column("policy_timeline").to_pylist(),
                                        table.column("version_span_versions").to_pylist())}
    assert (DEAD, 4) in seen and (LIVE, 3) in seen and seen <= {(DEAD, 4), (LIVE, 3)}


def test_resumed_learner_rejoins_with_its_timeline_and_counts_dead_rows_it_still_gets(tmp_path):
    from gyre.learner.config import LearnerConfig
    from gyre.learner.loop import LearnerLoop, LearnerLoopConfig
    from gyre.learner.step_metrics import dead_timeline_rows
    from tests.fakes import group_table
    from tests.tiny_model import SMOLLM2_DIR

    class Engine:
        step = version = 0

        def capture_weights(self):
            return [("w", torch.zeros(2))]

    buf = TrajectoryBuffer(ReplayConfig(max_staleness=10))
    buf.rejoin("learner", 0, timeline=DEAD)  # the crashed learner, cold-started earlier
    buf.insert(group_table(0, version=6, timeline=DEAD))
    cfg = LearnerLoopConfig(engine=LearnerConfig(model=str(SMOLLM2_DIR)), groups_per_step=2, resume="none")
    loop = LearnerLoop(cfg, Engine(), FakeReplay(buf), WeightPublisher(), pad_token_id=0)
    loop.resume()
    loop.engine.version = loop.start_version = 4  # as if resumed from the step-4 checkpoint
    loop.rejoin_replay()
    assert buf.info()["stored_groups"] == 0 and buf.info()["dead_timeline_total"] == 4
    rows = pa.concat_tables([group_table(1, version=6, timeline=DEAD), group_table(2, version=3, timeline=DEAD),
                      group_table(3, version=6, timeline=loop.timeline), group_table(4, version=0)])
    assert dead_timeline_rows(rows, loop.timeline, loop.start_version) == 4.0  # only prompt 1's rows
