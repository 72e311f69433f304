"""Transport security for every gyre gRPC service: TLS (certificates from files) and a shared bearer token.

``SecurityConfig`` is validated at construction; ``TokenAuthInterceptor`` guards a server;
``server_credentials`` / ``channel_credentials`` / ``TokenClientInterceptor`` are what
``services.common.grpc_common`` uses to bind ports and open channels. The token is never stored in the
config (only where to read it), never logged and never echoed in an error.

Authentication is the ``authorization: Bearer <token>`` metadata of gRPC's access-token credentials
(RFC 6750 syntax), compared in constant time. The standard health service (``grpc.health.v1.Health``
``Check`` and ``Watch``) is exempt so liveness probes work without the secret; it answers only
SERVING/NOT_SERVING per service name. With TLS on, health still needs TLS (and a client certificate
under mTLS): the exemption is from the token, not from the transport.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from pathlib import Path

import grpc
import structlog
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

log = structlog.get_logger("security")

MIN_TOKEN_BYTES = 16
"""Shortest shared token accepted (bytes); ``openssl rand -hex 32`` gives 64."""

EXEMPT_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})
"""Full gRPC method names served without a token (liveness probes)."""

_PEM_MARKERS = {"cert_file": b"-----BEGIN CERTIFICATE-----", "ca_file": b"-----BEGIN CERTIFICATE-----",
                "key_file": b"PRIVATE KEY-----"}


class SecurityConfig(BaseModel):
    """How a gyre service binds and authenticates; the ``security:`` section of a cluster recipe.

    One section serves both ends: a server binds ``bind_host`` with ``cert_file``/``key_file`` and
    checks the token; a client trusts ``ca_file`` and sends the token (and, under mTLS, presents
    ``cert_file``/``key_file`` as its client certificate, so that certificate needs both the
    serverAuth and clientAuth key usages, or none). Files must exist at the same path on every host.

    Raises:
        pydantic.ValidationError: a missing file, a file that is not PEM, ``tls`` without
            ``cert_file``/``key_file``, a token shorter than ``MIN_TOKEN_BYTES`` or not printable
            ASCII, both or neither token sources where one is needed, or a non-loopback
            ``bind_host`` without TLS and authentication (unless ``allow_insecure_remote``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    bind_host: str = "127.0.0.1"
    """Interface servers bind. Loopback unless set; ``0.0.0.0`` / ``::`` (every interface) or a host
    address requires ``tls`` and a token (or ``require_client_cert``)."""
    tls: bool = False
    """Serve and connect over TLS."""
    cert_file: str | None = None
    """PEM certificate chain this process presents (the server's; under mTLS also the client's)."""
    key_file: str | None = None
    """PEM private key of ``cert_file``."""
    ca_file: str | None = None
    """PEM CA bundle. Clients verify the server against it (``None``: the system roots); with
    ``require_client_cert`` the server verifies clients against it (mTLS)."""
    require_client_cert: bool = False
    """Mutual TLS: the server refuses a client without a certificate signed by ``ca_file``."""
    server_name: str | None = None
    """Name clients expect in the server certificate when it differs from the address's host
    (``grpc.ssl_target_name_override``)."""
    token_file: str | None = None
    """File holding the shared token (surrounding whitespace ignored). Never put the token itself
    in a recipe."""
    token_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """Name of the environment variable holding the shared token (the alternative to ``token_file``)."""
    allow_insecure_remote: bool = False
    """Permit a non-loopback ``bind_host`` (or client address) without TLS and a token; logs a warning.
    Only for private networks you fully trust."""
    auto_token: bool = True
    """Off loopback with TLS and no token source (``token_file``, ``token_env``, ``require_client_cert``): each run
    generates its own shared token (``services.common.run_token``: ``{run_dir}/security/run.token`` on the driver's
    node, handed to the services over Ray), so TLS certificates alone give an authenticated deployment. ``false``
    refuses such a recipe instead."""

    @field_validator("cert_file", "key_file", "ca_file", "token_file")
    @classmethod
    def _file_exists(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            return None
        path = Path(value)
        if not path.is_file():
            raise ValueError(f"{info.field_name}: file '{value}' does not exist (or is not a regular file)")
        marker = _PEM_MARKERS.get(info.field_name)
        if marker is not None and marker not in path.read_bytes():
            raise ValueError(f"{info.field_name}: '{value}' is not PEM (no '{marker.decode()}' line)")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> "SecurityConfig":
        if self.tls and (self.cert_file is None or self.key_file is None):
            missing = [f for f in ("cert_file", "key_file") if getattr(self, f) is None]
            raise ValueError(f"tls is true but {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                             "not set: TLS needs a PEM certificate and its private key")
        if not self.tls:
            for name in ("cert_file", "key_file", "ca_file", "server_name"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} is set but tls is false: set tls: true or remove {name}")
        if self.require_client_cert and (not self.tls or self.ca_file is None):
            raise ValueError("require_client_cert needs tls: true and a ca_file to verify client certificates")
        if self.token_file is not None and self.token_env is not None:
            raise ValueError("token_file and token_env are both set: choose one source for the shared token")
        if self.has_token:
            self.token()  # validates length and characters now, not at the first RPC
        self.check_remote(self.bind_host, "bind_host")
        return self

    @property
    def has_token(self) -> bool:
        """True when a shared token is configured (``token_file`` or ``token_env``)."""
        return self.token_file is not None or self.token_env is not None

    @property
    def needs_run_token(self) -> bool:
        """True when the run must generate the shared token (``auto_token``): TLS off loopback, no token source."""
        return self.auto_token and self.tls and not self.authenticates and not is_loopback(self.bind_host)

    @property
    def authenticates(self) -> bool:
        """True when peers must prove who they are: a token, or client certificates under mTLS."""
        return self.has_token or self.require_client_cert

    def token(self) -> str:
        """Read the shared token (each call re-reads, so a restart picks up a rotated secret).

        Raises:
            ValueError: no source configured, the env variable is unset, or the token is shorter than
                ``MIN_TOKEN_BYTES`` bytes or holds characters outside printable ASCII (gRPC metadata).
        """
        if self.token_file is not None:
            source, raw = f"token_file '{self.token_file}'", Path(self.token_file).read_bytes()
        elif self.token_env is not None:
            source, value = f"token_env ${self.token_env}", os.environ.get(self.token_env)
            if value is None:
                raise ValueError(f"token_env: environment variable {self.token_env} is not set")
            raw = value.encode("utf-8", "surrogateescape")
        else:
            raise ValueError("no shared token configured: set token_file or token_env")
        token = raw.strip()
        if len(token) < MIN_TOKEN_BYTES:
            raise ValueError(f"{source}: token is {len(token)} bytes; at least {MIN_TOKEN_BYTES} expected")
        bad = next((i for i, b in enumerate(token) if not 0x21 <= b <= 0x7E), None)
        if bad is not None:
            raise ValueError(f"{source}: token byte {bad} is not printable ASCII (0x21-0x7e expected)")
        return token.decode("ascii")

    def check_remote(self, host: str, what: str) -> None:
        """Refuse plaintext or unauthenticated traffic to/from a non-loopback ``host``.

        Raises:
            ValueError: ``host`` is not loopback, TLS or authentication is off, and
                ``allow_insecure_remote`` is false (with it true, logs a warning instead); or a token
                is configured without TLS (never sent in plaintext off the host, whatever the flag).
        """
        if is_loopback(host) or (self.tls and (self.authenticates or self.auto_token)):
            return
        if self.has_token and not self.tls:
            raise ValueError(f"{what} '{host}' is not loopback: the shared token would cross the network in "
                             "plaintext; set tls: true (a token without TLS is allowed only on loopback)")
        lacking = " and ".join(x for x, ok in (("tls", self.tls), ("authentication", self.authenticates)) if not ok)
        if not self.allow_insecure_remote:
            raise ValueError(f"{what} '{host}' is not loopback and has no {lacking}: set tls: true with cert_file and "
                             "key_file (the run then generates its token; or give token_file/token_env, or "
                             "require_client_cert), or allow_insecure_remote: true on a network you fully trust")
        log.warning("insecure_remote_allowed", host=host, what=what, lacking=lacking)


def is_loopback(host: str) -> bool:
    """True for ``localhost``, ``127.0.0.0/8`` and ``::1`` (with or without brackets); a hostname is not."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_of(address: str) -> str:
    """The host of a gRPC target ``host:port`` / ``[v6]:port`` / ``dns:///host:port``; ``unix:`` targets
    give ``localhost``."""
    if address.startswith("unix:"):
        return "localhost"
    target = address.split("///", 1)[-1] if "///" in address else address
    if target.startswith("["):
        return target[1:target.index("]")]
    return target.rsplit(":", 1)[0] if target.count(":") == 1 else target


def _read(path: str | None) -> bytes | None:
    return None if path is None else Path(path).read_bytes()


def server_credentials(security: SecurityConfig) -> grpc.ServerCredentials:
    """TLS server credentials from ``cert_file``/``key_file``; clients verified against ``ca_file`` under mTLS."""
    return grpc.ssl_server_credentials(
        [(_read(security.key_file), _read(security.cert_file))],
        root_certificates=_read(security.ca_file) if security.require_client_cert else None,
        require_client_auth=security.require_client_cert)


def channel_credentials(security: SecurityConfig) -> grpc.ChannelCredentials:
    """TLS channel credentials trusting ``ca_file`` (presenting ``cert_file`` under mTLS), composed with
    ``grpc.access_token_call_credentials`` when a token is configured."""
    mtls = security.require_client_cert
    creds = grpc.ssl_channel_credentials(root_certificates=_read(security.ca_file),
                                         private_key=_read(security.key_file) if mtls else None,
                                         certificate_chain=_read(security.cert_file) if mtls else None)
    if security.has_token:
        creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(security.token()))
    return creds


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Server side: every RPC except ``EXEMPT_METHODS`` needs ``authorization: Bearer <token>``.

    Covers unary and streaming RPCs alike: the check runs once per call, before the servicer, so a
    bidi Insert or a server-streaming Subscribe ends with UNAUTHENTICATED without a message handled. Compares with ``hmac.compare_digest``; the message names what was missing or
    wrong, never the token.
    """

    def __init__(self, token: str) -> None:
        self._expected = token.encode("ascii")

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method in EXEMPT_METHODS:
            return continuation(handler_call_details)
        problem = self._problem(handler_call_details.invocation_metadata or ())
        if problem is None:
            return continuation(handler_call_details)
        log.warning("rpc_unauthenticated", method=method, problem=problem)
        return _refusal(continuation(handler_call_details), f"{method}: {problem}")

    def _problem(self, metadata) -> str | None:
        values = [m.value for m in metadata if m.key == "authorization"]
        if not values:
            return ("missing 'authorization' metadata: this server requires 'Bearer <token>' with the "
                    "shared token (security.token_file / token_env)")
        scheme, _, token = values[0].partition(" ")
        if len(values) > 1 or scheme.lower() != "bearer" or not token:
            return "'authorization' metadata is not a single 'Bearer <token>' value"
        if not hmac.compare_digest(token.strip().encode("utf-8", "surrogateescape"), self._expected):
            return "bearer token does not match this server's shared token"
        return None


def _refusal(handler: grpc.RpcMethodHandler | None, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind as ``handler`` that ends the call with UNAUTHENTICATED.
    An unknown method is refused the same way, so an unauthenticated peer cannot probe which exist."""

    def refuse(_request_or_iterator, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return _like(handler, refuse)


def _like(handler: grpc.RpcMethodHandler | None, behaviour) -> grpc.RpcMethodHandler:
    """A handler running ``behaviour`` with ``handler``'s streaming kind and (de)serializers (unary without one)."""
    if handler is None:
        return grpc.unary_unary_rpc_method_handler(behaviour)
    make = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    return make[(handler.request_streaming, handler.response_streaming)](
        behaviour, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)


class AioTokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """``TokenAuthInterceptor`` for a ``grpc.aio`` server (``services.common.aio_server``): the same check, the
    same exemptions and messages; a refused call ends with UNAUTHENTICATED before the servicer runs."""

    def __init__(self, token: str) -> None:
        self._check = TokenAuthInterceptor(token)

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        problem = (None if method in EXEMPT_METHODS
                   else self._check._problem(handler_call_details.invocation_metadata or ()))
        handler = await continuation(handler_call_details)
        if problem is None:
            return handler
        log.warning("rpc_unauthenticated", method=method, problem=problem)
        return _aio_refusal(handler, f"{method}: {problem}")


def _aio_refusal(handler: grpc.RpcMethodHandler | None, message: str) -> grpc.RpcMethodHandler:
    """``_refusal`` for ``grpc.aio``: a coroutine handler (any streaming kind may be one) that aborts."""

    async def refuse(_request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return _like(handler, refuse)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, details: grpc.ClientCallDetails, metadata: list[tuple[str, str]]) -> None:
        self.method, self.timeout, self.metadata = details.method, details.timeout, metadata
        self.credentials, self.wait_for_ready = details.credentials, details.wait_for_ready
        self.compression = getattr(details, "compression", None)


class TokenClientInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                             grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Client side without TLS: adds ``authorization: Bearer <token>`` to every call (loopback only;
    ``grpc_common.channel`` enforces that). Over TLS, ``channel_credentials`` does this instead."""

    def __init__(self, token: str) -> None:
        self._header = ("authorization", f"Bearer {token}")

    def _details(self, details: grpc.ClientCallDetails) -> _CallDetails:
        return _CallDetails(details, list(details.metadata or ()) + [self._header])

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)
