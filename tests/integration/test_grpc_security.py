"""TLS + shared-token auth on real gRPC servers (port 0) with certificates generated at test time:
authenticated unary, server-streaming and bidi calls work; a missing or wrong token, a plaintext
client, a client that does not trust the CA and a client without a certificate under mTLS are refused;
health answers without a token."""

import ipaddress
import time

import grpc
import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gyre.learner.publisher import WeightPublisher
from gyre.proto import replay_pb2, replay_pb2_grpc, weights_pb2, weights_pb2_grpc
from gyre.proto.trajectory import SCHEMA_VERSION, to_ipc
from gyre.replay.buffer import TrajectoryBuffer
from gyre.replay.config import ReplayConfig
from gyre.services.common import grpc_common
from gyre.services.common.security import SecurityConfig
from gyre.services.learner import weight_server
from gyre.services.replay import server as replay_server
from gyre.services.rollout.transport.subscriber import WeightSubscriber
from tests.fakes import group_table
from tests.pki import issue, write

TOKEN = "tok-" + "a1b2c3d4" * 4
WRONG = "tok-" + "ffffeeee" * 4


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """CA, server cert (SAN 127.0.0.1 + localhost), client cert, an unrelated CA, and token files."""
    d = tmp_path_factory.mktemp("pki")
    out = {}
    for ca_name in ("ca", "rogue_ca"):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = issue(f"gyre test {ca_name}", key, None, key, ca=True)
        out[ca_name], _ = write(d / ca_name, cert)
        out[f"{ca_name}_obj"] = (cert.subject, key)
    ca_name, ca_key = out.pop("ca_obj")
    out.pop("rogue_ca_obj")
    for name, sans, usages in (
            ("server", [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
             [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            ("client", [], [ExtendedKeyUsageOID.CLIENT_AUTH])):
        key = ec.generate_private_key(ec.SECP256R1())
        out[name], out[f"{name}_key"] = write(d / name, issue(f"gyre {name}", key, ca_name, ca_key,
                                                                 sans=sans, usages=usages), key)
    for name, value in (("token", TOKEN), ("wrong_token", WRONG)):
        (d / name).write_text(value + "\n")
        (d / name).chmod(0o600)
        out[name] = str(d / name)
    return out


def _server_cfg(pki, **kw) -> SecurityConfig:
    return SecurityConfig(tls=True, cert_file=pki["server"], key_file=pki["server_key"], token_file=pki["token"], **kw)


def _client_cfg(pki, ca="ca", token="token", **kw) -> SecurityConfig:
    """A client's copy of the cluster's security section (it carries the cluster cert/key too; a client
    presents a certificate only under ``require_client_cert``)."""
    kw = {"cert_file": pki["server"], "key_file": pki["server_key"], **kw}
    return SecurityConfig(tls=True, ca_file=pki[ca], token_file=pki[token] if token else None, **kw)


def _weights(v):
    return [("w", torch.full((300,), float(v), dtype=torch.bfloat16)), ("b", torch.arange(4.0) + v)]


@pytest.fixture(scope="module")
def tls_weights(pki):
    pub = WeightPublisher()
    pub.publish(3, _weights(3))
    server, port = weight_server.serve(pub, security=_server_cfg(pki))
    yield f"127.0.0.1:{port}"
    server.stop(0)


def _latest(address, security, timeout=5.0) -> int:
    with grpc_common.channel(address, security) as ch:
        return weights_pb2_grpc.WeightServiceStub(ch).Latest(weights_pb2.LatestRequest(), timeout=timeout).version


def _subscribe_first_version(address, security) -> list[weights_pb2.WeightChunk]:
    with grpc_common.channel(address, security) as ch:
        call = weights_pb2_grpc.WeightServiceStub(ch).Subscribe(weights_pb2.SubscribeRequest(have_version=-1),
                                                               timeout=10)
        chunks = []
        for chunk in call:
            chunks.append(chunk)
            if chunk.last_of_version:
                call.cancel()
                return chunks
    raise AssertionError("stream ended before a whole version")


def _rpc_error(fn, *args) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        fn(*args)
    return err.value


def test_authenticated_unary_and_server_streaming(tls_weights, pki):
    client = _client_cfg(pki)
    assert _latest(tls_weights, client) == 3
    chunks = _subscribe_first_version(tls_weights, client)
    assert [(c.version, c.name) for c in chunks] == [(3, "w"), (3, "b")]
    got = []
    sub = WeightSubscriber(tls_weights, lambda v, t, _tl: got.append((v, t)), name="tls", security=client).start()
    deadline = time.monotonic() + 10
    while not got and time.monotonic() < deadline:
        time.sleep(0.05)
    sub.stop()
    assert got and got[0][0] == 3 and torch.equal(got[0][1][0][1], _weights(3)[0][1]) and sub.errors == 0


@pytest.mark.parametrize("call", [_latest, _subscribe_first_version], ids=["unary", "server_stream"])
def test_missing_or_wrong_token_is_unauthenticated(tls_weights, pki, call):
    err = _rpc_error(call, tls_weights, _client_cfg(pki, token=None))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "missing 'authorization' metadata" in err.details() and "WeightService" in err.details()
    err = _rpc_error(call, tls_weights, _client_cfg(pki, token="wrong_token"))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "bearer token does not match this server's shared token" in err.details()
    assert TOKEN not in err.details() and WRONG not in err.details()


def test_unknown_method_is_refused_before_it_is_revealed(tls_weights, pki):
    with grpc_common.channel(tls_weights, _client_cfg(pki, token=None)) as ch:
        err = _rpc_error(ch.unary_unary("/gyre.nope.v1.Nope/Probe"), b"", 5)
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED


def test_plaintext_client_and_untrusting_client_fail(tls_weights, pki):
    assert _rpc_error(_latest, tls_weights, None).code() == grpc.StatusCode.UNAVAILABLE
    assert _rpc_error(_latest, tls_weights, _client_cfg(pki, ca="rogue_ca")).code() == grpc.StatusCode.UNAVAILABLE
    assert not grpc_common.check_health(tls_weights, weight_server.SERVICE_NAME)
    assert not grpc_common.check_health(tls_weights, security=_client_cfg(pki, ca="rogue_ca"))


def test_health_needs_tls_but_no_token(tls_weights, pki):
    no_token = _client_cfg(pki, token=None)
    assert grpc_common.check_health(tls_weights, weight_server.SERVICE_NAME, security=no_token)
    with grpc_common.channel(tls_weights, no_token) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()


def test_bidi_insert_needs_the_token(pki):
    """Replay's Insert (bidi stream) on the real ReplayServicer behind a TLS + token server."""
    buf = TrajectoryBuffer(ReplayConfig())
    server, health_servicer = grpc_common.make_server(security=_server_cfg(pki))
    replay_pb2_grpc.add_ReplayServiceServicer_to_server(replay_server.ReplayServicer(buf), server)
    port = grpc_common.start(server, health_servicer, replay_server.SERVICE_NAME, security=_server_cfg(pki))
    req = replay_pb2.InsertRequest(schema_version=SCHEMA_VERSION, batch_id=7, arrow_ipc=to_ipc(group_table(0)))

    def insert(security):
        with grpc_common.channel(f"127.0.0.1:{port}", security) as ch:
            return list(replay_pb2_grpc.ReplayServiceStub(ch).Insert(iter([req]), timeout=10))

    try:
        for token in (None, "wrong_token"):
            assert _rpc_error(insert, _client_cfg(pki, token=token)).code() == grpc.StatusCode.UNAUTHENTICATED
        assert buf.info()["inserted_total"] == 0  # refused before the servicer stored anything
        [resp] = insert(_client_cfg(pki))
        assert (resp.batch_id, resp.accepted) == (7, 4) and buf.info()["inserted_total"] == 4
    finally:
        server.stop(0)


def test_mutual_tls_refuses_a_client_without_a_certificate(pki):
    pub = WeightPublisher()
    pub.publish(0, _weights(0))
    server, port = weight_server.serve(pub, security=_server_cfg(pki, ca_file=pki["ca"], require_client_cert=True))
    address = f"127.0.0.1:{port}"
    try:
        mtls = _client_cfg(pki, cert_file=pki["client"], key_file=pki["client_key"], require_client_cert=True)
        assert _latest(address, mtls) == 0
        assert _rpc_error(_latest, address, _client_cfg(pki)).code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(0)


def test_token_without_tls_on_loopback(pki):
    pub = WeightPublisher()
    pub.publish(1, _weights(1))
    security = SecurityConfig(token_file=pki["token"])
    server, port = weight_server.serve(pub, security=security)
    address = f"127.0.0.1:{port}"
    try:
        assert _latest(address, security) == 1
        assert [c.name for c in _subscribe_first_version(address, security)] == ["w", "b"]
        assert _rpc_error(_latest, address, None).code() == grpc.StatusCode.UNAUTHENTICATED
        assert _rpc_error(_subscribe_first_version, address, None).code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        server.stop(0)
    with pytest.raises(ValueError, match="address '10.1.2.3' is not loopback: the shared token would cross"):
        grpc_common.channel("10.1.2.3:50051", security)


def test_start_refuses_a_public_bind_without_tls():
    server, health_servicer = grpc_common.make_server()
    with pytest.raises(ValueError, match="bind host '0.0.0.0' is not loopback and has no tls and authentication"):
        grpc_common.start(server, health_servicer, "x", host="0.0.0.0", security=SecurityConfig())


def test_tls_certificates_alone_give_an_authenticated_run(pki, tmp_path):
    """A recipe that binds every interface with TLS and no token (``auto_token``): its services get the run's own
    token (``services.common.run_token``) and talk to each other with it; a client with the right CA and no token
    is refused. Before, such a recipe was refused for lacking authentication."""
    from gyre.services.common.actor_env import security_config
    from gyre.services.common.run_token import service_security

    recipe = SecurityConfig(bind_host="0.0.0.0", tls=True, cert_file=pki["server"], key_file=pki["server_key"],
                            ca_file=pki["ca"])
    fields = service_security(recipe, tmp_path / "run")  # the driver, once per run
    pub = WeightPublisher()
    pub.publish(5, _weights(5))
    server, port = weight_server.serve(pub, host="0.0.0.0", security=security_config(fields))  # a service
    try:
        assert _latest(f"127.0.0.1:{port}", security_config(fields)) == 5  # another service of the run
        err = _rpc_error(_latest, f"127.0.0.1:{port}", recipe)  # TLS, the run's CA, no token
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        server.stop(0)
