"""Shared gRPC plumbing: server construction with the standard health service, channel options, and
(optionally) TLS plus shared-token auth from a ``services.common.security.SecurityConfig``.

Every function takes ``security=None``, which keeps plaintext on 127.0.0.1 with no auth; pass the
same ``SecurityConfig`` to ``make_server`` (installs the token check) and ``start`` (binds TLS).
"""

from __future__ import annotations

from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gyre.services.common.security import (SecurityConfig, TokenAuthInterceptor, TokenClientInterceptor, channel_credentials,
                               host_of, server_credentials)

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
"""Largest gRPC message either side accepts (bytes); payload limits are enforced per service below it."""

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
]

SERVER_OPTIONS = [
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.so_reuseport", 0),
]
"""Server-only options. SO_REUSEPORT off: gRPC sets it on Linux by default, so a server binding a port another
gRPC server holds would succeed and the kernel would split connections between the two; off, ``start`` fails."""


def make_server(max_workers: int = 16,
                security: SecurityConfig | None = None) -> tuple[grpc.Server, health.HealthServicer]:
    """A threaded gRPC server with the standard health-checking service registered.

    With a token in ``security``, every RPC but health Check/Watch needs it (``TokenAuthInterceptor``).

    Raises:
        ValueError: the configured token cannot be read or is too short.
    """
    interceptors = [TokenAuthInterceptor(security.token())] if security is not None and security.has_token else []
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers),
        interceptors=interceptors,
        options=CHANNEL_OPTIONS + SERVER_OPTIONS,
    )
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    return server, health_servicer


def bind_host(host: str | None, security: SecurityConfig | None) -> str:
    """The host a server binds: ``host`` if given, else ``security.bind_host``, else 127.0.0.1."""
    if host is not None:
        return host
    return security.bind_host if security is not None else "127.0.0.1"


def start(server: grpc.Server, health_servicer: health.HealthServicer, service_name: str,
          host: str | None = None, port: int = 0, security: SecurityConfig | None = None) -> int:
    """Bind ``host:port`` (``host`` per ``bind_host``), start, mark ``service_name`` SERVING; returns the bound
    port. ``port`` 0 lets the OS pick a free one, bound here at once: a caller that needs a fresh port passes 0
    and reads it back, never a port found free earlier (another process may have taken it since). With
    ``security.tls`` the port is TLS (``add_secure_port``).

    Raises:
        RuntimeError: the address could not be bound (e.g. the port is taken, by another gRPC server too:
            ``SERVER_OPTIONS`` turns SO_REUSEPORT off).
        ValueError: ``security`` is given and ``host`` is not loopback without TLS and a token
            (unless ``allow_insecure_remote``).
    """
    host = bind_host(host, security)
    address = f"{host}:{port}"
    if security is None:
        bound = server.add_insecure_port(address)
    else:
        security.check_remote(host, "bind host")
        bound = (server.add_secure_port(address, server_credentials(security)) if security.tls
                 else server.add_insecure_port(address))
    if bound == 0:
        raise RuntimeError(f"could not bind gRPC server to {address}")
    server.start()
    for name in ("", service_name):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return bound


def channel(address: str, security: SecurityConfig | None = None) -> grpc.Channel:
    """A channel to ``host:port`` with gyre's message-size and keepalive options.

    ``security=None``: plaintext, no token (as before). With ``security.tls``: a secure channel
    trusting ``ca_file`` and carrying the token as access-token call credentials. Without TLS, a token
    is added by a client interceptor, and only to a loopback address.

    Raises:
        ValueError: plaintext to a non-loopback ``address`` without ``allow_insecure_remote``, or an
            unreadable token.
    """
    if security is None:
        return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    security.check_remote(host_of(address), "address")
    if security.tls:
        options = CHANNEL_OPTIONS + ([("grpc.ssl_target_name_override", security.server_name)]
                                     if security.server_name else [])
        return grpc.secure_channel(address, channel_credentials(security), options=options)
    plain = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    return grpc.intercept_channel(plain, TokenClientInterceptor(security.token())) if security.has_token else plain


def check_health(address: str, service_name: str = "", timeout_s: float = 2.0,
                 security: SecurityConfig | None = None) -> bool:
    """True if the server at ``address`` answers SERVING within ``timeout_s`` seconds (health needs no
    token, but does need TLS when the server uses it)."""
    with channel(address, security) as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service_name), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return resp.status == health_pb2.HealthCheckResponse.SERVING
