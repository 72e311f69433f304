"""Inputs that take the replay process down or end the Insert stream with the wrong status, found by
mutating bytes of a valid Arrow IPC payload (1-4 random bytes, ~1 in 100 mutants). The server runs in
a child process so a segfault fails the test instead of killing pytest. Both were real bugs (a
segfault on bad list offsets, CANCELLED on an unimplemented type); replay now validates payloads fully
(``table.validate(full=True)``) and answers INVALID_ARGUMENT."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import grpc
import numpy as np
import pyarrow as pa
import pytest

from gyre.proto import replay_pb2, replay_pb2_grpc
from gyre.proto.trajectory import SCHEMA_VERSION, to_ipc
from gyre.services.common import grpc_common
from gyre.services.replay import server as replay_server
from tests.fakes import group_table
from tests.fuzz.bad_trajectories import raw_ipc
from tests.fuzz.replay_harness import NAMED_CODES

REPO = Path(__file__).resolve().parents[2]
SERVER = textwrap.dedent("""
    import resource
    import sys
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file if a poison payload crashes it
    from gyre.replay.buffer import TrajectoryBuffer
    from gyre.replay.config import ReplayConfig
    from gyre.services.replay import server as replay_server
    server, port = replay_server.serve(TrajectoryBuffer(ReplayConfig(max_batch_bytes=65536)))
    print(f"PORT={port}", flush=True)
    sys.stdin.read()  # serve until the test closes stdin
""")


def bad_offsets() -> bytes:
    """A 4-row group whose ``group_id`` offsets run backwards (row 2 ends at byte -1): IPC reading does
    not validate offsets, and ``pc.dictionary_encode`` in ``replay.groups._group_rows`` reads wild memory."""
    table = group_table(0)
    data = table.column("group_id").combine_chunks().buffers()[2]
    offsets = pa.py_buffer(np.array([0, 3, -1, 9, 12], np.int32).tobytes())
    broken = pa.Array.from_buffers(pa.utf8(), 4, [None, offsets, data])
    return raw_ipc(table.set_column(1, table.schema.field(1), broken))


def unsupported_type() -> bytes:
    """A valid payload with one schema byte changed so that Arrow reads an integer width it does not
    implement: ``ArrowNotImplementedError``, which ``_read_ipc`` does not catch."""
    good = to_ipc(group_table(0))
    schema_end = 8 + int.from_bytes(good[4:8], "little")
    for at in range(8, schema_end):
        for value in (0x80, 0xFF):
            mutant = good[:at] + bytes([value]) + good[at + 1:]
            try:
                pa.ipc.open_stream(mutant).read_all()
            except pa.ArrowNotImplementedError:
                return mutant
            except (pa.ArrowInvalid, OSError):
                continue
    raise AssertionError("no one-byte schema change gives ArrowNotImplementedError with this pyarrow")


@pytest.fixture
def child_replay():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env=env, cwd=REPO, text=True)  # no preexec_fn: it forces a fork after gRPC was used
    line = ""
    while not line.startswith("PORT="):  # structlog writes to stdout too
        line = proc.stdout.readline()
        assert line, "the replay child exited before serving"
    address = f"127.0.0.1:{int(line[5:])}"
    yield proc, address
    proc.stdin.close()
    proc.wait(timeout=30)


@pytest.mark.parametrize("payload", [
    pytest.param(bad_offsets, id="non-monotonic-offsets"),
    pytest.param(unsupported_type, id="unimplemented-int-width"),
])
def test_mutated_payload_is_refused_and_the_server_survives(child_replay, payload):
    proc, address = child_replay
    with grpc_common.channel(address) as channel:
        stub = replay_pb2_grpc.ReplayServiceStub(channel)
        request = replay_pb2.InsertRequest(schema_version=SCHEMA_VERSION, batch_id=1, arrow_ipc=payload())
        with pytest.raises(grpc.RpcError) as err:
            next(iter(stub.Insert(iter([request]), timeout=20)))
        assert proc.poll() is None, f"replay died with exit status {proc.returncode}"
        assert err.value.code() in NAMED_CODES, f"{err.value.code().name}: {err.value.details()}"
        assert grpc_common.check_health(address, replay_server.SERVICE_NAME)
        good = replay_pb2.InsertRequest(schema_version=SCHEMA_VERSION, batch_id=2, arrow_ipc=to_ipc(group_table(1)))
        assert next(iter(stub.Insert(iter([good]), timeout=20))).accepted == 4
