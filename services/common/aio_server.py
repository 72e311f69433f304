"""A ``grpc.aio`` server on its own event-loop thread, for services whose RPCs are long-lived streams.

gRPC's threaded server ties one pool thread to every open stream for its lifetime: with as many streams as
threads (``grpc_common.make_server``'s 16) every further call — the health ``Check`` included — waits in the
queue, the supervisor reads the timeout as a hung service and restarts it, and the streams reconnect to do it
again. On ``AioServer`` a stream is a coroutine suspended between messages, so open streams cost no thread, and
the standard health service (``grpc_health.v1.health.aio``) answers on the same loop between any two messages.

The server object lives on the loop thread (``grpc.aio`` objects must stay on the thread that made them);
``start``/``stop`` are called from any other thread. Servicer methods must be coroutines or async generators
that never block the loop: a wait for another thread goes through ``asyncio`` (``AsyncNotifier``).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Awaitable, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gyre.services.common.grpc_common import CHANNEL_OPTIONS, SERVER_OPTIONS, bind_host
from gyre.services.common.security import AioTokenAuthInterceptor, SecurityConfig, server_credentials

T = TypeVar("T")
START_TIMEOUT_S = 30.0
"""Seconds ``AioServer`` waits for its loop to create, bind or start the server before raising."""


class AioServer:
    """A ``grpc.aio.Server`` with the standard health service, run by a private event loop in a daemon thread.

    Args:
        security: TLS and token settings (``None``: plaintext on loopback, no token); with a token every RPC but
            health ``Check``/``Watch`` needs it (``AioTokenAuthInterceptor``).

    Raises:
        ValueError: the configured token cannot be read or is too short.
    """

    def __init__(self, security: SecurityConfig | None = None) -> None:
        self.security = security
        interceptors = ([AioTokenAuthInterceptor(security.token())]
                        if security is not None and security.has_token else [])
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="grpc-aio-server", daemon=True)
        self._thread.start()

        async def make() -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
            server = grpc.aio.server(interceptors=interceptors, options=CHANNEL_OPTIONS + SERVER_OPTIONS)
            servicer = health.aio.HealthServicer()
            health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
            return server, servicer

        self.server, self.health = self.run(make())

    def run(self, coro: Awaitable[T], timeout_s: float = START_TIMEOUT_S) -> T:
        """Run ``coro`` on the server's loop from another thread and return its result (``timeout_s`` seconds)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=timeout_s)

    def add_generic_rpc_handlers(self, handlers) -> None:
        """Register services (``grpc.method_handlers_generic_handler``) before ``start``."""
        self.server.add_generic_rpc_handlers(handlers)

    def start(self, service_name: str, host: str | None = None, port: int = 0) -> int:
        """Bind ``host:port`` (``grpc_common.bind_host`` rules; 0 = a free port, read back), start, mark
        ``service_name`` SERVING; returns the bound port.

        Raises:
            RuntimeError: the address could not be bound (the port is taken, by another gRPC server too).
            ValueError: ``security`` is given and ``host`` is not loopback without TLS and a token.
        """
        host = bind_host(host, self.security)
        address = f"{host}:{port}"
        if self.security is not None:
            self.security.check_remote(host, "bind host")

        async def bind_and_start() -> int:
            try:
                if self.security is not None and self.security.tls:
                    bound = self.server.add_secure_port(address, server_credentials(self.security))
                else:
                    bound = self.server.add_insecure_port(address)
            except RuntimeError as exc:  # grpc.aio raises where the threaded server returns 0
                raise RuntimeError(f"could not bind gRPC server to {address}: {exc}") from exc
            if bound == 0:
                raise RuntimeError(f"could not bind gRPC server to {address}")
            await self.server.start()
            for name in ("", service_name):
                await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
            return bound

        return self.run(bind_and_start())

    def stop(self, grace: float | None = None) -> threading.Event:
        """Stop serving (open streams get ``grace`` seconds, then are cancelled) and end the loop thread; returns
        an event set once both are done (the threaded server's ``stop`` contract: ``stop(g).wait()``)."""
        done = threading.Event()
        if not self._thread.is_alive():
            done.set()
            return done

        async def shutdown() -> None:
            try:
                await self.server.stop(grace)
            finally:
                self.loop.call_soon(self.loop.stop)

        future = asyncio.run_coroutine_threadsafe(shutdown(), self.loop)

        def finish() -> None:
            try:
                future.result()
            finally:
                self._thread.join()
                done.set()
        threading.Thread(target=finish, name="grpc-aio-stop", daemon=True).start()
        return done


class AsyncNotifier:
    """Wakes coroutines on one event loop when another thread changes something they wait for.

    ``notify()`` is thread-safe (``loop.call_soon_threadsafe``); ``wait(timeout_s)`` (on the loop) returns when a
    notification arrives after it started waiting, or after ``timeout_s`` seconds.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._event = asyncio.Event()

    def notify(self) -> None:
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self._event.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass

