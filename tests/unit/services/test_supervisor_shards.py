"""The supervisor over a sharded replay (``replay.shards: 3``): one service per shard (``replay``,
``replay-shard-1``, ``replay-shard-2``), the learner and rollouts created with the whole replay's address, a dead
shard restarted alone and the whole address, with its new part, pushed to every client; status and shutdown cover
every shard."""

from gyre.services.common.replay_shards import merge_info_dicts
from gyre.services.control.orchestration import supervisor
from tests.unit.services.supervisor_fakes import learner_info, pushes, unstarted


def test_each_shard_is_a_service_and_a_dead_one_restarts_alone(monkeypatch):
    sup = unstarted(monkeypatch, replay_shards=3)
    sup.start(2)
    sup.learner.info = learner_info()
    assert [s.name for s in sup.replay_shards()] == ["replay", "replay-shard-1", "replay-shard-2"]
    whole = "replay:1,replay:2,replay:3"
    assert sup.replay_address == whole
    assert sup.factory.replay_dialled == {"learner": whole, "rollout-0": whole, "rollout-1": whole}
    before = list(sup.services.values())
    for svc in before:
        svc.handle.calls.clear()
    shard1 = sup.services["replay-shard-1"].handle
    shard1.killed = True
    sup.tick()
    assert sup.factory.made["replay"] == 4 and sup.services["replay-shard-1"].restarts == 1
    assert not sup.services["replay"].handle.killed and not sup.services["replay-shard-2"].handle.killed
    assert sup.services["replay-shard-1"].handle is not shard1
    assert sup.replay_address == "replay:1,replay:4,replay:3"
    clients = [s for s in before if s.role in ("learner", "rollout")]
    assert pushes([*(s.handle for s in before), sup.services["replay-shard-1"].handle]) == {
        (c.name, "set_replay_address", ("replay:1,replay:4,replay:3",)) for c in clients}
    assert sup.status()["replay_shards"] == 3
    handles = [s.handle for s in sup.replay_shards()]
    monkeypatch.setattr(supervisor.learner_group, "remove", lambda recipe: None)  # no placement group here
    sup.shutdown()
    assert all(h.killed for h in handles) and not sup.replay_shards()


def test_the_shards_info_adds_up_for_the_run_summary():
    infos = [{"stored_groups": 2, "prompts_completed": 5, "learner_version": 3, "last_snapshot_age_s": 1.0,
              "staleness_at_sample": {0: 1}, "dir": "/a"},
             {"stored_groups": 1, "prompts_completed": 4, "learner_version": 4, "last_snapshot_age_s": 9.0,
              "staleness_at_sample": {0: 2, 1: 1}, "dir": "/b"}]
    merged = merge_info_dicts(infos)
    assert merged["stored_groups"] == 3 and merged["prompts_completed"] == 9 and merged["learner_version"] == 4
    assert merged["last_snapshot_age_s"] == 9.0 and merged["staleness_at_sample"] == {0: 3, 1: 1}
    assert merged["dir"] == "/a" and merged["shards"] == 2
