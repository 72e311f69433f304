"""SecurityConfig validation: every refusal names the field and the problem; the token never leaks."""

import pytest
import structlog
from pydantic import ValidationError

from gyre.services.common.security import SecurityConfig, host_of, is_loopback

TOKEN = "s3cr3t-token-0123456789abcdef"
CERT = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
KEY = "-----BEGIN PRIVATE KEY-----\nMIIE\n-----END PRIVATE KEY-----\n"


@pytest.fixture
def files(tmp_path):
    paths = {}
    for name, text in (("cert", CERT), ("key", KEY), ("ca", CERT), ("token", TOKEN + "\n"), ("junk", "hello\n")):
        paths[name] = tmp_path / f"{name}.pem"
        paths[name].write_text(text)
    return {k: str(v) for k, v in paths.items()}


def _error(**kwargs) -> str:
    with pytest.raises(ValidationError) as err:
        SecurityConfig(**kwargs)
    return str(err.value)


def test_default_is_plaintext_loopback_without_token():
    cfg = SecurityConfig()
    assert (cfg.bind_host, cfg.tls, cfg.has_token, cfg.authenticates) == ("127.0.0.1", False, False, False)
    with pytest.raises(ValueError, match="no shared token configured: set token_file or token_env"):
        cfg.token()


def test_missing_and_non_pem_files_are_named(files, tmp_path):
    missing = str(tmp_path / "nope.pem")
    msg = _error(tls=True, cert_file=missing, key_file=files["key"])
    assert f"cert_file: file '{missing}' does not exist" in msg
    assert f"key_file: '{files['junk']}' is not PEM (no 'PRIVATE KEY-----' line)" in _error(
        tls=True, cert_file=files["cert"], key_file=files["junk"])
    assert "ca_file: file" in _error(tls=True, cert_file=files["cert"], key_file=files["key"], ca_file=missing)
    assert "token_file: file" in _error(token_file=missing)


def test_tls_needs_cert_and_key(files):
    assert "tls is true but cert_file and key_file are not set" in _error(tls=True)
    assert "tls is true but key_file is not set" in _error(tls=True, cert_file=files["cert"])


def test_tls_files_without_tls_and_mtls_without_ca_are_refused(files):
    assert "ca_file is set but tls is false" in _error(ca_file=files["ca"])
    assert "require_client_cert needs tls: true and a ca_file" in _error(
        tls=True, cert_file=files["cert"], key_file=files["key"], require_client_cert=True)


def test_token_length_and_characters(tmp_path):
    short = tmp_path / "short"
    short.write_text("tooshort123\n")
    msg = _error(token_file=str(short))
    assert "token is 11 bytes; at least 16 expected" in msg and "tooshort123" not in msg
    spaced = tmp_path / "spaced"
    spaced.write_text("0123456789 0123456789")
    msg = _error(token_file=str(spaced))
    assert "token byte 10 is not printable ASCII (0x21-0x7e expected)" in msg and "0123456789" not in msg


def test_token_file_strips_whitespace_and_env_source(files, monkeypatch):
    assert SecurityConfig(token_file=files["token"]).token() == TOKEN
    monkeypatch.delenv("GYRE_TEST_TOKEN", raising=False)
    assert "token_env: environment variable GYRE_TEST_TOKEN is not set" in _error(token_env="GYRE_TEST_TOKEN")
    monkeypatch.setenv("GYRE_TEST_TOKEN", TOKEN)
    assert SecurityConfig(token_env="GYRE_TEST_TOKEN").token() == TOKEN
    assert "token_file and token_env are both set" in _error(token_file=files["token"], token_env="GYRE_TEST_TOKEN")
    assert "token_env" in _error(token_env="not a name")


def test_token_never_appears_in_repr_or_dump(files):
    cfg = SecurityConfig(token_file=files["token"])
    for text in (repr(cfg), str(cfg), cfg.model_dump_json()):
        assert TOKEN not in text


def test_non_loopback_bind_needs_tls_and_auth(files):
    msg = _error(bind_host="0.0.0.0")
    assert "bind_host '0.0.0.0' is not loopback and has no tls and authentication" in msg
    assert "set tls: true with cert_file and key_file (the run then generates its token" in msg
    tls = dict(tls=True, cert_file=files["cert"], key_file=files["key"])
    assert SecurityConfig(bind_host="0.0.0.0", token_file=files["token"], **tls).bind_host == "0.0.0.0"
    mtls = SecurityConfig(bind_host="::", ca_file=files["ca"], require_client_cert=True, **tls)
    assert mtls.authenticates and not mtls.has_token


def test_allow_insecure_remote_warns_but_never_sends_a_token_in_plaintext(files):
    with structlog.testing.capture_logs() as logs:
        cfg = SecurityConfig(bind_host="0.0.0.0", allow_insecure_remote=True)
    assert cfg.bind_host == "0.0.0.0"
    assert [(e["event"], e["host"], e["lacking"]) for e in logs] == [
        ("insecure_remote_allowed", "0.0.0.0", "tls and authentication")]
    msg = _error(bind_host="0.0.0.0", allow_insecure_remote=True, token_file=files["token"])
    assert "the shared token would cross the network in plaintext; set tls: true" in msg


def test_unknown_key_is_refused():
    assert "token\n  Extra inputs are not permitted" in _error(token=TOKEN)


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.3.2.1", True), ("localhost", True), ("::1", True), ("[::1]", True),
    ("0.0.0.0", False), ("::", False), ("10.0.0.5", False), ("learner-0.cluster", False)])
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


@pytest.mark.parametrize("address, host", [
    ("127.0.0.1:5000", "127.0.0.1"), ("[::1]:5000", "::1"), ("dns:///learner-0:5000", "learner-0"),
    ("unix:/tmp/sock", "localhost"), ("learner-0", "learner-0")])
def test_host_of(address, host):
    assert host_of(address) == host


def test_tls_off_loopback_without_a_token_gets_the_runs_own(files, tmp_path):
    """``auto_token``: certificates alone give an authenticated deployment off loopback (before, such a recipe was
    refused for lacking authentication). The run's token lives in its run directory (0600), reaches the services
    inside their settings, and becomes a 0600 token file on each service's node; nothing else holds it."""
    import json
    import stat

    from gyre.services.common.actor_env import security_config
    from gyre.services.common.run_token import RUN_TOKEN_KEY, TOKEN_FILE, service_security

    tls = dict(tls=True, cert_file=files["cert"], key_file=files["key"])
    recipe = SecurityConfig(bind_host="0.0.0.0", **tls)
    assert recipe.needs_run_token and not recipe.has_token and TOKEN not in json.dumps(recipe.model_dump())
    fields = service_security(recipe, tmp_path)
    token = fields[RUN_TOKEN_KEY]
    stored = tmp_path / TOKEN_FILE
    assert stored.read_text().strip() == token and len(token) == 64
    assert stat.S_IMODE(stored.stat().st_mode) == 0o600
    assert service_security(recipe, tmp_path)[RUN_TOKEN_KEY] == token  # a re-attaching driver: the same token
    service = security_config(fields)  # on the service's node
    assert service.has_token and service.token() == token and service.authenticates
    assert stat.S_IMODE((tmp_path / service.token_file).stat().st_mode) == 0o600
    assert token not in repr(service) and token not in json.dumps(service.model_dump())
    # a given token, mTLS, loopback, or auto_token off: nothing generated
    for cfg in (SecurityConfig(bind_host="0.0.0.0", token_file=files["token"], **tls),
                SecurityConfig(bind_host="::", ca_file=files["ca"], require_client_cert=True, **tls),
                SecurityConfig(**tls)):
        assert not cfg.needs_run_token and RUN_TOKEN_KEY not in service_security(cfg, tmp_path / "other")
    msg = _error(bind_host="10.0.0.5", auto_token=False, **tls)
    assert "bind_host '10.0.0.5' is not loopback and has no authentication" in msg
