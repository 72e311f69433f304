"""How an ops command joins a run's Ray cluster: the record the controller writes and the auth settings it
carries.

Ray 2.60 turns token auth on for every private ``ray.init()`` head unless ``RAY_AUTH_MODE`` is set (and
writes ``~/.ray/auth_token`` if no token exists), but a driver joining an explicit address uses token auth
only if told to. So the controller records its address, auth mode and token file (never the token) in
``{run_dir}/{run}/ray_connection.json`` (``record_connection``), and ``gyre status / scale / restart /
checkpoint`` join with the same settings (``join``).
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

import ray


class OpsError(RuntimeError):
    """An ops command that cannot be carried out; the message says why and what was expected."""


CONNECTION_FILE = "ray_connection.json"
"""``{run_dir}/{run}/ray_connection.json``: how the run's driver joined Ray (``RayConnection``), JSON."""
AUTH_MODES = ("token", "disabled")
"""Values of Ray's ``RAY_AUTH_MODE`` a record may hold."""
MODE_ENV, TOKEN_ENV, TOKEN_PATH_ENV = "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"
REACH_TIMEOUT_S = 5.0
"""TCP connect timeout of the check that a ``host:port`` address has a listener before ``ray.init``, which
retries a dead address for minutes. (A token Ray refuses fails ``ray.init`` after its 20 tries, ~20 s.)"""


@dataclass(frozen=True)
class RayConnection:
    """How to join a run's Ray cluster: its address and Ray's token auth as the run's driver had it."""

    address: str
    """GCS ``host:port``, or ``auto``."""
    auth_mode: str | None = None
    """``token`` or ``disabled`` (``RAY_AUTH_MODE`` as the driver ran); ``None``: not recorded (``--address``,
    a run from before the record), join with token auth when a token is found."""
    token_path: str | None = None
    """Absolute path of the token file Ray read, with ``token`` auth; ``None`` when the driver had its token
    in ``RAY_AUTH_TOKEN`` (the token itself is never recorded)."""
    source: str | None = field(default=None, compare=False)
    """The record file this was read from, for error messages (not written)."""

    def to_json(self) -> str:
        return json.dumps({"address": self.address, "auth_mode": self.auth_mode, "token_path": self.token_path})


def current_connection() -> RayConnection:
    """How this driver joined Ray (call after ``ray.init``): the GCS address, Ray's auth mode, and with token
    auth the file Ray's token loader reads (``RAY_AUTH_TOKEN_PATH``, else ``~/.ray/auth_token``; ``None``
    when ``RAY_AUTH_TOKEN`` holds the token, which Ray prefers to both)."""
    from ray._private.authentication.authentication_token_setup import _get_default_token_path
    from ray._private.authentication.authentication_utils import get_authentication_mode_name
    from ray._raylet import get_authentication_mode

    mode = get_authentication_mode_name(get_authentication_mode())
    path = None
    if mode == "token" and not os.environ.get(TOKEN_ENV):
        path = str(Path(os.environ.get(TOKEN_PATH_ENV) or _get_default_token_path()).absolute())
    return RayConnection(ray.get_runtime_context().gcs_address, mode, path)


def record_connection(run_dir: Path) -> Path:
    """Write ``current_connection()`` to ``{run_dir}/ray_connection.json`` (atomically); returns its path."""
    path, tmp = run_dir / CONNECTION_FILE, run_dir / f".{CONNECTION_FILE}.tmp"
    tmp.write_text(current_connection().to_json() + "\n")
    tmp.replace(path)
    return path


def read_connection(path: Path) -> RayConnection:
    """The ``RayConnection`` recorded in ``path``.

    Raises:
        OpsError: the file is unreadable or not JSON, has no address, or an unknown ``auth_mode`` or a
            ``token_path`` that is not an absolute path.
    """
    def bad(problem: str) -> OpsError:
        return OpsError(f"Ray connection record {path}: {problem}; expected JSON {{\"address\": \"host:port\", "
                        f"\"auth_mode\": \"token\" or \"disabled\", \"token_path\": path or null}} as "
                        "`gyre run` writes it (delete the file if the run is not running)")

    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad(f"unreadable ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, dict):
        raise bad(f"got {type(data).__name__} {data!r:.80}")
    address, mode, token_path = data.get("address"), data.get("auth_mode"), data.get("token_path")
    if not isinstance(address, str) or not address.strip():
        raise bad(f"address {address!r} is not a non-empty string")
    if mode not in AUTH_MODES:
        raise bad(f"auth_mode {mode!r} is unknown")
    if token_path is not None and not (isinstance(token_path, str) and Path(token_path).is_absolute()):
        raise bad(f"token_path {token_path!r} is not an absolute path")
    return RayConnection(address.strip(), mode, token_path, source=str(path))


def connection_for(run: str, run_dir: str | Path = "runs", address: str | None = None) -> RayConnection:
    """How to join ``run``'s cluster: the record in ``{run_dir}/{run}/ray_connection.json`` (with ``address``
    given, only if it names that address); else ``address``; else the legacy ``ray_address`` file; else
    ``auto``. The last three carry no auth settings.

    Raises:
        OpsError: the record is bad (see ``read_connection``).
    """
    record = Path(run_dir) / run / CONNECTION_FILE
    if record.exists():
        recorded = read_connection(record)
        if address is None or address == recorded.address:
            return recorded
    if address:
        return RayConnection(address)
    legacy = Path(run_dir) / run / "ray_address"
    return RayConnection(legacy.read_text().strip() if legacy.is_file() else "auto")


def auth_env(conn: RayConnection, environ=os.environ) -> dict[str, str]:
    """The ``RAY_AUTH_*`` variables to add to ``environ`` so that ``ray.init`` joins ``conn``'s cluster the
    way its driver did: ``RAY_AUTH_MODE`` as recorded, and with token auth ``RAY_AUTH_TOKEN_PATH`` = the
    recorded file. A variable already in ``environ`` wins and is never replaced; so do ``RAY_AUTH_TOKEN`` /
    ``RAY_AUTH_TOKEN_PATH`` over the recorded file. Nothing for an unrecorded ``conn``.

    Raises:
        OpsError: token auth is recorded with a token file that is missing or empty, or with the token in
            ``RAY_AUTH_TOKEN``, which this process does not have.
    """
    if conn.auth_mode is None:
        return {}
    out = {} if MODE_ENV in environ else {MODE_ENV: conn.auth_mode}
    mode = environ.get(MODE_ENV, conn.auth_mode).lower()
    if mode != "token" or environ.get(TOKEN_ENV) or environ.get(TOKEN_PATH_ENV):
        return out
    if conn.token_path is None:
        raise OpsError(f"Ray connection record {conn.source}: the run's Ray takes its token from {TOKEN_ENV}, "
                       f"which is not set here; expected {TOKEN_ENV} or {TOKEN_PATH_ENV} with the run's token")
    token = Path(conn.token_path)
    if not token.is_file() or token.stat().st_size == 0:
        raise OpsError(f"Ray connection record {conn.source}: token file {token} is missing or empty; expected "
                       f"the token file the run's Ray was started with (or set {TOKEN_PATH_ENV})")
    out[TOKEN_PATH_ENV] = str(token)
    return out


def _use_auth(conn: RayConnection) -> None:
    """Put ``conn``'s auth settings into ``os.environ`` and make Ray re-read them (it caches its config at
    import, ``ray._raylet.Config``). Unrecorded: token auth if a token is found, as Ray itself does for
    ``address="auto"`` (``maybe_enable_token_auth_if_token_available``, minus its warning) but not for an
    explicit address; a token-auth driver also joins an auth-disabled cluster.

    Raises:
        OpsError: see ``auth_env``; or ``RAY_AUTH_TOKEN_PATH`` is set to a missing or empty file.
    """
    from ray._raylet import AuthenticationTokenLoader, Config

    updates = auth_env(conn)
    if conn.auth_mode is None and MODE_ENV not in os.environ:
        try:
            if AuthenticationTokenLoader.instance().has_token(ignore_auth_mode=True):
                updates[MODE_ENV] = "token"
        except ray.exceptions.AuthenticationError as exc:
            raise OpsError(str(exc).split(". Note:")[0]) from None
    if updates:
        os.environ.update(updates)
        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()


def _auth_described() -> str:
    """This process's Ray auth settings in words (for an error message; never the token)."""
    if os.environ.get(MODE_ENV, "").lower() != "token":
        return f"{MODE_ENV}={os.environ.get(MODE_ENV, '(unset)')}: no token sent"
    path = os.environ.get(TOKEN_PATH_ENV)
    source = TOKEN_ENV if os.environ.get(TOKEN_ENV) else f"{TOKEN_PATH_ENV}={path}" if path else "~/.ray/auth_token"
    return f"{MODE_ENV}=token, token from {source}"


def _check_reachable(address: str, namespace: str, run: str) -> None:
    host, sep, port = address.rpartition(":")
    if "://" in address or not sep or not port.isdigit():
        return  # auto, or a Ray Client / URL address: ray.init resolves it
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=REACH_TIMEOUT_S).close()
    except OSError as exc:
        raise OpsError(f"no running gyre run named {run} in namespace {namespace}: no Ray cluster at {address} "
                       f"({exc.strerror or type(exc).__name__})") from None


def join(conn: RayConnection, namespace: str, run: str) -> None:
    """Join ``conn``'s cluster unless this process already has Ray.

    Raises:
        OpsError: a bad record or token setting (``_use_auth``); nothing listens at the address; the cluster
            refused this process's token (after Ray's ~20 s of tries); no Ray cluster there.
    """
    if ray.is_initialized():
        return
    _use_auth(conn)
    _check_reachable(conn.address, namespace, run)
    try:
        ray.init(address=conn.address, namespace=namespace, log_to_driver=False, logging_level="ERROR")
    except ray.exceptions.AuthenticationError as exc:
        raise OpsError(f"cannot join the Ray cluster at {conn.address}: {str(exc).split('. Note:')[0]}") from None
    except (ConnectionError, RuntimeError) as exc:
        if "InvalidAuthToken" in f"{exc} {exc.__cause__}":
            raise OpsError(f"the Ray cluster at {conn.address} refused this process's token (InvalidAuthToken; "
                           f"{_auth_described()}); expected the token run {run}'s Ray was started with") from None
        raise OpsError(f"no running gyre run named {run} in namespace {namespace}: "
                       f"no Ray cluster at {conn.address} ({str(exc)[:200]})") from None
