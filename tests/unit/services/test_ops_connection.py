"""How the ops commands join a run's Ray: the ``ray_connection.json`` record the controller writes (address,
Ray's auth mode, the token file, never the token), the ``RAY_AUTH_*`` variables the commands derive from it,
and the one-line errors for a bad record, a missing token, a refused token and a dead address. Plain Python:
Ray's runtime context, auth mode and ``ray.init`` are stood in for."""

import json
import socket
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray._raylet

from gyre.services.control.commands import ops

from gyre.services.control.commands import ray_connection as rc
from gyre.services.control.commands.ray_connection import OpsError, RayConnection


def _record(tmp_path, data) -> Path:
    (tmp_path / "r").mkdir(exist_ok=True)
    path = tmp_path / "r" / rc.CONNECTION_FILE
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


@pytest.fixture
def no_auth_env(monkeypatch):
    for key in (rc.MODE_ENV, rc.TOKEN_ENV, rc.TOKEN_PATH_ENV):
        monkeypatch.delenv(key, raising=False)


@pytest.mark.parametrize("token_env, token_path_env, expected", [
    (None, None, "home"), (None, "tok", "tok"), ("secret", "tok", None)])
def test_the_record_names_the_token_file_ray_read_never_the_token(tmp_path, monkeypatch, no_auth_env,
                                                                  token_env, token_path_env, expected):
    monkeypatch.setenv("HOME", str(tmp_path))
    if token_env:
        monkeypatch.setenv(rc.TOKEN_ENV, token_env)
    if token_path_env:
        monkeypatch.setenv(rc.TOKEN_PATH_ENV, str(tmp_path / token_path_env))
    monkeypatch.setattr(rc.ray, "get_runtime_context", lambda: SimpleNamespace(gcs_address="10.0.0.1:6379"))
    monkeypatch.setattr(ray._raylet, "get_authentication_mode", lambda: ray._raylet.AuthenticationMode.TOKEN)
    (tmp_path / "r").mkdir()
    path = rc.record_connection(tmp_path / "r")
    token_path = {"home": str(tmp_path / ".ray" / "auth_token"), "tok": str(tmp_path / "tok"), None: None}[expected]
    assert json.loads(path.read_text()) == {"address": "10.0.0.1:6379", "auth_mode": "token", "token_path": token_path}
    assert "secret" not in path.read_text()
    assert rc.connection_for("r", tmp_path) == RayConnection("10.0.0.1:6379", "token", token_path)
    assert [p.name for p in (tmp_path / "r").iterdir()] == [rc.CONNECTION_FILE]  # no temp file left

    monkeypatch.setattr(ray._raylet, "get_authentication_mode", lambda: ray._raylet.AuthenticationMode.DISABLED)
    assert rc.current_connection() == RayConnection("10.0.0.1:6379", "disabled", None)


def test_the_record_is_used_for_its_own_address_only(tmp_path):
    _record(tmp_path, {"address": "10.0.0.1:6379", "auth_mode": "disabled", "token_path": None})
    (tmp_path / "r" / "ray_address").write_text("10.0.0.1:6379")
    recorded = RayConnection("10.0.0.1:6379", "disabled")
    assert rc.connection_for("r", tmp_path) == recorded
    assert rc.connection_for("r", tmp_path, "10.0.0.1:6379") == recorded
    assert rc.connection_for("r", tmp_path, "10.9.9.9:6379") == RayConnection("10.9.9.9:6379")


@pytest.mark.parametrize("content, problem", [
    ("{not json", "unreadable (JSONDecodeError: Expecting property name"),
    ("[1, 2]", "got list [1, 2]"),
    ({"auth_mode": "token", "token_path": None}, "address None is not a non-empty string"),
    ({"address": "10.0.0.1:6379", "auth_mode": "password", "token_path": None}, "auth_mode 'password' is unknown"),
    ({"address": "10.0.0.1:6379", "token_path": None}, "auth_mode None is unknown"),
    ({"address": "10.0.0.1:6379", "auth_mode": "token", "token_path": "auth_token"},
     "token_path 'auth_token' is not an absolute path"),
])
def test_a_bad_record_is_named_with_its_problem(tmp_path, content, problem):
    path = _record(tmp_path, content)
    with pytest.raises(OpsError) as err:
        rc.connection_for("r", tmp_path)
    message = str(err.value)
    assert message.startswith(f"Ray connection record {path}: {problem}")
    assert "expected JSON" in message and "\n" not in message


def test_an_unreadable_record_is_named(tmp_path):
    (tmp_path / "r" / rc.CONNECTION_FILE).mkdir(parents=True)  # a directory where the file should be
    with pytest.raises(OpsError, match=r"ray_connection.json: unreadable \(IsADirectoryError"):
        rc.connection_for("r", tmp_path)


def test_auth_env_joins_as_the_driver_did_unless_the_user_chose(tmp_path):
    token = tmp_path / "auth_token"
    token.write_text("t0ken")
    conn = RayConnection("10.0.0.1:6379", "token", str(token), source="runs/r/ray_connection.json")
    assert rc.auth_env(conn, {}) == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    assert rc.auth_env(RayConnection("a:1", "disabled"), {}) == {"RAY_AUTH_MODE": "disabled"}
    # what the user set wins: their mode, their token (from the environment or their own file)
    assert rc.auth_env(conn, {"RAY_AUTH_MODE": "disabled"}) == {}
    assert rc.auth_env(conn, {"RAY_AUTH_TOKEN": "x"}) == {"RAY_AUTH_MODE": "token"}
    assert rc.auth_env(conn, {"RAY_AUTH_TOKEN_PATH": "/mine"}) == {"RAY_AUTH_MODE": "token"}
    assert rc.auth_env(RayConnection("a:1"), {}) == {}  # not recorded: see _use_auth


def test_auth_env_refuses_a_token_it_cannot_have(tmp_path):
    source = "runs/r/ray_connection.json"
    missing = RayConnection("a:1", "token", str(tmp_path / "gone"), source=source)
    with pytest.raises(OpsError, match=f"^Ray connection record {source}: token file {tmp_path / 'gone'} is "
                                       "missing or empty; expected the token file the run's Ray was started with"):
        rc.auth_env(missing, {})
    (tmp_path / "empty").write_text("")
    with pytest.raises(OpsError, match="token file .*empty is missing or empty"):
        rc.auth_env(RayConnection("a:1", "token", str(tmp_path / "empty"), source=source), {})
    from_env = RayConnection("a:1", "token", None, source=source)
    with pytest.raises(OpsError, match="the run's Ray takes its token from RAY_AUTH_TOKEN, which is not set here"):
        rc.auth_env(from_env, {})
    assert rc.auth_env(from_env, {"RAY_AUTH_TOKEN": "x"}) == {"RAY_AUTH_MODE": "token"}


def test_a_refused_token_is_named_not_reported_as_no_cluster(monkeypatch):
    def refused(**kwargs):
        try:
            raise RuntimeError("Failed to connect to GCS. ... RPC error: InvalidAuthToken: Authentication token "
                               "is missing or incorrect.")
        except RuntimeError as cause:
            raise ConnectionError("Failed to connect to Ray cluster at 10.0.0.1:6379") from cause

    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", "/tmp/my_token")
    monkeypatch.setattr(rc.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(rc.ray, "init", refused)
    with pytest.raises(OpsError, match=r"^the Ray cluster at auto refused this process's token \(InvalidAuthToken; "
                                       r"RAY_AUTH_MODE=token, token from RAY_AUTH_TOKEN_PATH=/tmp/my_token\); "
                                       "expected the token run r's Ray was started with$"):
        ops.connect("r", "ns", RayConnection("auto"))


def test_a_dead_address_fails_at_once_without_ray_init(monkeypatch):
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
    address = f"127.0.0.1:{closed.getsockname()[1]}"
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setattr(rc.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(rc.ray, "init", lambda **kw: pytest.fail("ray.init retries a dead address for minutes"))
    t0 = time.monotonic()
    try:
        with pytest.raises(OpsError, match=f"^no running gyre run named r in namespace ns: no Ray cluster at "
                                           f"{address} \\(Connection refused\\)$"):
            ops.connect("r", "ns", RayConnection(address))
    finally:
        closed.close()
    assert time.monotonic() - t0 < rc.REACH_TIMEOUT_S
