"""Server processes started by tests and benches bind port 0 and report the port they got: they still start when
every port released after a bind to port 0 is taken at once by another socket (``tests.fakes.PortThief``, as
another process on a busy machine might take it), where picking a "free" port, closing it and passing it to the
server fails."""

from bench.replay import replay_config
from bench.replay_parts import Server
from gyre.services.common.replay_client import ReplayClient
from tests.fakes import PortThief
from tests.fault.replay_proc import ReplayProcess


def test_a_replay_process_serves_though_every_released_port_is_taken(tmp_path, monkeypatch):
    thief = PortThief().install(monkeypatch)
    proc = ReplayProcess({}, tmp_path / "replay")
    try:
        proc.wait_serving()
        client = ReplayClient(proc.address)
        assert client.info().stored_trajectories == 0
        client.close()
    finally:
        proc.kill()
        thief.release()


def test_a_bench_replay_server_serves_though_every_released_port_is_taken(tmp_path, monkeypatch):
    thief = PortThief().install(monkeypatch)
    server = Server("replay", tmp_path / "main", replay_config("fsync"))
    try:
        client = ReplayClient(server.address)
        assert client.info().stored_trajectories == 0
        client.close()
    finally:
        server.stop()
        thief.release()
