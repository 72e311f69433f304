"""A sharded replay (``replay.shards: 3``) through the client rollouts and the learner use: three real replay gRPC
servers, each with its own directory; prompts leased across them complete exactly once each, groups land in their
prompt's shard, the learner's batches are whole groups from several shards acked by one lease id, a shard restarted
from its directory carries on, and a one-address replay still gets the plain client."""

import time

import pytest

from gyre.replay.buffer import TrajectoryBuffer
from gyre.replay.config import ReplayConfig
from gyre.services.common import replay_shards
from gyre.services.common.replay_client import ReplayClient, ReplayUnavailableError
from gyre.services.common.replay_links import replay_connector
from gyre.services.common.replay_shards import ShardedReplayClient, join_addresses, split_lease_id
from gyre.services.replay import server as replay_server
from tests.fakes import group_table

K = 3


class Shards:
    """K durable replay shards served over gRPC, each restartable from its own directory."""

    def __init__(self, root, **config):
        self.root, self.config = root, config
        self.buffers, self.servers, self.ports = [None] * K, [None] * K, [0] * K
        for k in range(K):
            self.start(k)

    def start(self, k):
        cfg = ReplayConfig(shards=K, shard=k, dir=str(self.root / f"shard-{k}"), **self.config)
        self.buffers[k] = TrajectoryBuffer(cfg)
        self.servers[k], self.ports[k] = replay_server.serve(self.buffers[k], port=0)

    def stop(self, k):
        self.servers[k].stop(0).wait()
        self.buffers[k].close()

    @property
    def address(self):
        return join_addresses([f"127.0.0.1:{p}" for p in self.ports])

    def close(self):
        for k in range(K):
            self.stop(k)


@pytest.fixture
def shards(tmp_path):
    s = Shards(tmp_path, num_prompts=12, groups_per_step=3, max_staleness=1, work_budget_margin_steps=2)
    yield s
    s.close()


def test_a_sharded_address_gets_the_sharded_client_and_one_address_the_plain_one(shards):
    client = replay_connector()(shards.address)
    assert isinstance(client, ShardedReplayClient) and client.address == shards.address
    assert isinstance(replay_connector()("127.0.0.1:1"), ReplayClient)
    with pytest.raises(ValueError, match="one host:port per shard"):
        replay_shards.split_addresses("127.0.0.1:1,,127.0.0.1:2")
    client.close()


def test_prompts_complete_once_each_in_their_shards_and_batches_span_shards(shards):
    client = replay_connector()(shards.address)
    leased = []
    for rollout in ("rollout-0", "rollout-1", "rollout-2", "rollout-3"):
        leased += client.lease_prompts(rollout, 4)
    # the work budget (ceil((1 + 2) x 3 / 3) = 3 per shard) caps the fleet at 9 of the 12 prompts
    assert len(leased) == 9 and len({p for p, _ in leased}) == 9
    for k in range(K):
        assert {p for p, _ in leased if p % K == k} and shards.buffers[k].info()["prompts_leased"] == 3
    for p, attempt in leased:
        assert client.insert(group_table(p, attempt=attempt)).accepted == 4
    assert client.insert(group_table(leased[0][0])).duplicates == 4  # a retry: deduplicated in its shard
    for k in range(K):
        stored = [g.table.column("prompt_index")[0].as_py() for g in shards.buffers[k].capture().groups]
        assert stored and {p % K for p in stored} == {k}
    info = client.info()
    assert info.size_groups == 9 and info.prompts_completed == 9 and info.inserted_total == 36

    lease_id, batch = client.sample(5, learner_version=0, timeout_s=5.0, consumer="learner", request_id="step-1")
    groups = batch.column("group_id").unique().to_pylist()
    assert len(groups) == 5 and batch.num_rows == 20  # whole groups
    assert len({k for k, _ in split_lease_id(lease_id)}) >= 2  # from several shards, one lease id
    assert client.ack([lease_id]) == 5 and client.info().size_groups == 4  # groups acked
    assert client.ack([lease_id]) == 0  # idempotent per shard
    assert client.sample(5, learner_version=0, timeout_s=0.3, consumer="learner") is None  # 4 left: not enough
    assert client.info().leased_groups == 0  # a short try leaves nothing leased
    client.close()


def test_lockstep_batches_keep_the_order_asked_for(shards):
    client = replay_connector()(shards.address)
    for p, attempt in client.lease_prompts("rollout-0", 9):
        client.insert(group_table(p, attempt=attempt))
    lease_id, batch = client.sample(4, learner_version=0, timeout_s=5.0, prompt_indices=[4, 0, 2, 1])
    order = [p for i, p in enumerate(batch.column("prompt_index").to_pylist()) if i % 4 == 0]
    assert order == [4, 0, 2, 1] and client.release([lease_id]) == 4
    client.close()


def test_a_shard_down_is_unavailable_and_after_its_restart_the_run_carries_on(shards):
    client = replay_connector()(shards.address)
    leased = client.lease_prompts("rollout-0", 9)
    for p, attempt in leased:
        client.insert(group_table(p, attempt=attempt))
    shards.stop(1)
    # the other shards go on: batches come from them, prompts are leased from them, their groups are stored
    lease_id, batch = client.sample(4, learner_version=0, timeout_s=5.0, consumer="learner")
    got = set(batch.column("prompt_index").to_pylist())
    assert len(got) == 4 and {p % K for p in got} <= {0, 2}
    assert client.insert(group_table(3, attempt=0)).duplicates == 4
    client.lease_prompts("rollout-1", 9)  # passes the dead shard over (the others' budgets are spent: none)
    with pytest.raises(ReplayUnavailableError):  # a group of the dead shard's prompt: retried by the rollout
        client.insert(group_table(4, attempt=0))
    t0 = time.monotonic()
    with pytest.raises(ReplayUnavailableError):  # too few without the dead shard: at once, not after the timeout, so
        client.sample(3, learner_version=0, timeout_s=30.0)  # the learner retries through the rerouted address
    assert time.monotonic() - t0 < 10
    with pytest.raises(ReplayUnavailableError):  # a lockstep batch that needs the dead shard
        client.sample(2, learner_version=0, timeout_s=1.0, prompt_indices=[1, 0])
    shards.start(1)  # restored from its own WAL/snapshot, on a new port (as a new actor)
    assert shards.buffers[1].info()["stored_groups"] == 3
    client = replay_connector()(shards.address)  # the supervisor's reroute: the new address
    assert client.ack([lease_id]) == 4
    lease_id, batch = client.sample(5, learner_version=0, timeout_s=5.0, consumer="learner")
    assert sorted(set(batch.column("prompt_index").to_pylist()) | got) == sorted(p for p, _ in leased)
    assert client.ack([lease_id]) == 5 and client.info().stored_groups == 0
    for k in range(K):  # nothing leased is left anywhere
        assert shards.buffers[k].info()["leased_groups"] == 0
    client.close()


def test_bad_lease_ids_and_group_ids_are_named():
    client = ShardedReplayClient([ReplayClient("127.0.0.1:1"), ReplayClient("127.0.0.1:2")])
    with pytest.raises(ValueError, match="'abc'.*'<shard>:<lease id>'"):
        client.ack(["abc"])
    with pytest.raises(ValueError, match="names shard 5; this replay has 2"):
        client.release(["5:x"])
    with pytest.raises(ValueError, match="group id 'g7'"):
        client.update_priorities(["g7"], [1.0])
    with pytest.raises(ValueError, match="needs >= 2 shards"):
        ShardedReplayClient([ReplayClient("127.0.0.1:1")])
    client.close()


def test_info_sums_the_shards_and_keeps_the_newest_learner_version():
    from gyre.proto import replay_pb2

    a = replay_pb2.InfoResponse(size_groups=2, learner_version=3, inserts_per_s=1.5, staleness_at_sample={0: 2})
    b = replay_pb2.InfoResponse(size_groups=5, learner_version=4, inserts_per_s=0.5, staleness_at_sample={0: 1, 1: 3})
    merged = replay_shards.merge_info([a, b])
    assert merged.size_groups == 7 and merged.learner_version == 4 and merged.inserts_per_s == 2.0
    assert dict(merged.staleness_at_sample) == {0: 3, 1: 3}


def test_a_batch_is_split_in_proportion_to_what_each_shard_holds():
    """Taking the fullest shard first left the others' groups waiting until they aged past the staleness gate."""
    from types import SimpleNamespace

    class Ready:
        def __init__(self, n):
            self.address, self.timeout_s, self.n = f"s:{n}", 1.0, n

        def info(self):
            if self.n is None:
                raise ReplayUnavailableError("down")
            return SimpleNamespace(size_groups=self.n)

        def close(self):
            pass

    client = ShardedReplayClient([Ready(10), Ready(6)])
    assert client._split(8) == ({0: 5, 1: 3}, None)
    assert client._split(16) == ({0: 10, 1: 6}, None) and client._split(17)[0] == {}
    split, down = ShardedReplayClient([Ready(9), Ready(None), Ready(3)])._split(4)
    assert split == {0: 3, 2: 1} and isinstance(down, ReplayUnavailableError)
