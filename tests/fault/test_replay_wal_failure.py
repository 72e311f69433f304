"""A WAL that cannot be written (disk full, I/O error): the replay server goes NOT_SERVING, every
change answers UNAVAILABLE naming the error, nothing acknowledged is lost, and it stays NOT_SERVING
until a restart, which restores what was acknowledged and serves again.

Errors are injected at the ``replay.wal.before_write`` / ``replay.wal.before_fsync`` fault points (``replay.faults``), which raise
the ``OSError`` the system call would, just before it."""

import errno
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import generate_latest

from gyre.proto import replay_pb2, replay_pb2_grpc
from gyre.proto.trajectory import SCHEMA_VERSION, to_ipc
from gyre import faults
from gyre.replay.buffer import TrajectoryBuffer
from gyre.replay.config import ReplayConfig
from gyre.replay.wal import WalError
from gyre.services.common import grpc_common
from gyre.services.replay import server as replay_server
from gyre.services.common.replay_client import ReplayClient, ReplayUnavailableError
from gyre.services.replay.metrics import registry_for
from tests.fakes import group_table

REPO = Path(__file__).resolve().parents[2]
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def config(tmp_path) -> ReplayConfig:
    return ReplayConfig(dir=str(tmp_path), seed=0, snapshot={"interval_s": None, "wal_bytes": None})


def health(port: int) -> list[int]:
    with grpc_common.channel(f"127.0.0.1:{port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        return [stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status
                for name in ("", replay_server.SERVICE_NAME)]


@pytest.fixture
def served(tmp_path):
    started = []

    def start():
        buf = TrajectoryBuffer(config(tmp_path))
        server, port = replay_server.serve(buf)
        client = ReplayClient(f"127.0.0.1:{port}", timeout_s=10)
        started.append((buf, server, client))
        return buf, client, port

    yield start
    faults.clear_errors()
    for buf, server, client in started:
        client.close()
        server.stop(0)
        buf.close()


def stored_prompts(buf: TrajectoryBuffer) -> list[int]:
    return sorted(g.prompt_index for g in buf.state.store.groups.values())


@pytest.mark.parametrize("point,code,text", [("replay.wal.before_write", errno.ENOSPC, "No space left on device"),
                                             ("replay.wal.before_fsync", errno.EIO, "Input/output error")])
def test_wal_failure_means_not_serving_and_unavailable_until_restart(served, point, code, text):
    buf, client, port = served()
    assert client.insert(group_table(0)).accepted == 4
    assert health(port) == [SERVING, SERVING]

    faults.inject_error(point, code)
    with pytest.raises(ReplayUnavailableError, match=f"UNAVAILABLE: replay cannot persist: .*{text}"):
        client.insert(group_table(1))
    assert health(port) == [NOT_SERVING, NOT_SERVING]
    assert buf.durability.failure is not None and text in buf.durability.failure

    faults.clear_errors()  # the disk works again, but a failed log is never written again
    for call in (lambda: client.insert(group_table(2)), lambda: client.sample(1, 0, timeout_s=1),
                 lambda: client.lease_prompts("r0", 1)):
        with pytest.raises(ReplayUnavailableError, match=text):
            call()
    assert health(port) == [NOT_SERVING, NOT_SERVING]
    assert client.info().stored_groups >= 1  # Info still answers (for the operator)

    with pytest.raises(WalError, match=text):  # in-process callers get the same error
        buf.insert(group_table(3))

    restarted, client2, port2 = served()  # a restart restores what was acknowledged and serves again
    assert health(port2) == [SERVING, SERVING]
    assert 0 in stored_prompts(restarted)  # acknowledged before the failure: kept
    assert not {2, 3} & set(stored_prompts(restarted))  # refused after it: never logged
    assert client2.insert(group_table(4)).accepted == 4
    lease_id, table = client2.sample(1, learner_version=0, timeout_s=1)
    assert table.num_rows == 4 and client2.ack([lease_id]) == 1


def test_listener_registered_after_the_failure_is_told_at_once(tmp_path):
    buf = TrajectoryBuffer(config(tmp_path))
    assert "gyre_replay_wal_failed 0.0" in generate_latest(registry_for(buf)).decode()
    faults.inject_error("replay.wal.before_write", errno.ENOSPC)
    try:
        with pytest.raises(WalError, match="No space left on device"):
            buf.insert(group_table(0))
    finally:
        faults.clear_errors()
    assert "gyre_replay_wal_failed 1.0" in generate_latest(registry_for(buf)).decode()
    told = []
    buf.durability.add_failure_listener(told.append)
    assert len(told) == 1 and "No space left on device" in told[0] and str(tmp_path) in told[0]
    assert buf.info()["stored_groups"] == 0  # the refused insert changed nothing
    buf.close()


def test_grpc_status_of_a_refused_insert_is_unavailable(served):
    _, client, port = served()
    faults.inject_error("replay.wal.before_write", errno.ENOSPC)
    with grpc_common.channel(f"127.0.0.1:{port}") as ch:
        req = replay_pb2.InsertRequest(schema_version=SCHEMA_VERSION, batch_id=7, arrow_ipc=to_ipc(group_table(0)))
        with pytest.raises(grpc.RpcError) as err:
            list(replay_pb2_grpc.ReplayServiceStub(ch).Insert(iter([req]), timeout=10))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    details = err.value.details()
    assert "No space left on device" in details and "injected at fault point 'replay.wal.before_write'" in details


_SCRIPT = """
import sys
from gyre.replay.buffer import TrajectoryBuffer
from gyre.replay.config import ReplayConfig
from gyre.replay.wal import WalError
from tests.fakes import group_table
buf = TrajectoryBuffer(ReplayConfig(dir=sys.argv[1], snapshot={"interval_s": None, "wal_bytes": None}))
print("accepted:", buf.insert(group_table(0)).accepted)
try:
    buf.insert(group_table(1))
except WalError as exc:
    print("refused:", exc)
"""


def test_environment_arms_an_errno_at_the_nth_hit(tmp_path):
    env = {**os.environ, "GYRE_FAULT_POINT": "replay.wal.before_write#2:ENOSPC"}
    out = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path)], env=env, cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = [x for x in out.stdout.splitlines() if x.startswith(("accepted:", "refused:"))]  # not the logs
    assert lines[0] == "accepted: 4"  # the first hit passes
    assert lines[1].startswith("refused: WAL append to ") and "No space left on device" in lines[1]
