"""A process that imports gyre forks children with gRPC's fork handlers off (grpc/grpc#43055).

With the handlers on, a child ``subprocess`` forks (``preexec_fn``: a real ``fork()``, as ``gyre sweep`` starts its
runs) while the parent's channels are live can abort before ``exec`` (seen: a sweep run's child exiting -6 after
``ev_epoll1_linux.cc ... epoll_wait error: Bad file descriptor``). The abort is rare, so the test watches what gRPC
core logs on each fork instead: with the handlers on, a fork during a call logs ``skipping fork() handlers``
(about 9 forks in 10 here); with them off, nothing.
"""

import os
import subprocess
import sys

CHILD = """
import sys, threading
import gyre  # first, as every gyre entry point
from concurrent import futures
import grpc, subprocess
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

server = grpc.server(futures.ThreadPoolExecutor(4))
health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
port = server.add_insecure_port("127.0.0.1:0")
server.start()
stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
stop = threading.Event()
def calls():
    while not stop.is_set():
        stub.Check(health_pb2.HealthCheckRequest())
threads = [threading.Thread(target=calls, daemon=True) for _ in range(2)]
[t.start() for t in threads]
failed = sum(subprocess.run(["true"], preexec_fn=lambda: None).returncode != 0 for _ in range(100))
stop.set()
server.stop(0)
print("failed", failed)
"""


def test_gyre_turns_grpc_fork_handlers_off_before_grpc_starts():
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}  # as a fresh shell has it
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "failed 0" in out.stdout, out.stdout + out.stderr[-2000:]
    assert "fork() handlers" not in out.stderr, out.stderr[-2000:]
