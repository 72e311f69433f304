"""Shared gRPC plumbing: server construction with the standard health service, channel options."""

from __future__ import annotations

from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
"""Largest gRPC message either side accepts (bytes); payload limits are enforced per service below it."""

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
]


def make_server(max_workers: int = 16) -> tuple[grpc.Server, health.HealthServicer]:
    """A threaded gRPC server with the standard health-checking service registered."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers),
        options=CHANNEL_OPTIONS + [("grpc.http2.min_ping_interval_without_data_ms", 5_000)],
    )
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    return server, health_servicer


def start(server: grpc.Server, health_servicer: health.HealthServicer, service_name: str,
          host: str = "127.0.0.1", port: int = 0) -> int:
    """Bind ``host:port`` (0 = any free port), start, mark ``service_name`` SERVING; returns the port.

    Raises:
        RuntimeError: the address could not be bound.
    """
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"could not bind gRPC server to {host}:{port}")
    server.start()
    for name in ("", service_name):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return bound


def channel(address: str) -> grpc.Channel:
    """An insecure channel to ``host:port`` with gyre's message-size and keepalive options."""
    return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)


def check_health(address: str, service_name: str = "", timeout_s: float = 2.0) -> bool:
    """True if the server at ``address`` answers SERVING within ``timeout_s`` seconds."""
    with channel(address) as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service_name), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return resp.status == health_pb2.HealthCheckResponse.SERVING
