"""The shared token a run generates for itself (``SecurityConfig.auto_token``): TLS off loopback, no token given.

The driver creates ``{run_dir}/security/run.token`` once (32 random bytes, hex; mode 0600) and keeps it there, so a
driver that re-attaches to the run's live services (``gyre run`` again, ``--resume auto``) hands them the same one.
The services get it with their security settings over Ray (a control message, as every actor argument is: whoever
reaches the Ray cluster can run code on it anyway; the token keeps the network off gyre's gRPC ports), under
``RUN_TOKEN_KEY``; ``services.common.actor_env.security_config`` writes it to a 0600 file on the service's own node
and points ``token_file`` at it. Neither the recipe, ``recipe.json`` nor a log line holds it.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import tempfile
from pathlib import Path

from gyre.services.common.security import SecurityConfig

RUN_TOKEN_KEY = "_run_token"
"""Key of the generated token in the security dict that crosses Ray (``SecurityConfig`` itself never holds it)."""
TOKEN_FILE = Path("security") / "run.token"
"""Where the driver keeps the run's token, under the run directory."""


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by this user only (0600 from the start, replaced atomically)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def run_token(out_dir: Path) -> str:
    """The run's token: ``{out_dir}/security/run.token``, created (mode 0600) on the first call.

    Raises:
        ValueError: the file exists but does not hold a valid token (``SecurityConfig.token``'s checks).
    """
    path = Path(out_dir) / TOKEN_FILE
    if not path.is_file():
        _write_private(path, secrets.token_hex(32) + "\n")
    return SecurityConfig(token_file=str(path)).token()


def service_security(security: SecurityConfig, out_dir: Path) -> dict:
    """The security settings every service of the run gets (a plain dict for Ray): ``security``'s fields, plus the
    run's generated token under ``RUN_TOKEN_KEY`` when ``security.needs_run_token``."""
    fields = security.model_dump()
    if security.needs_run_token:
        fields[RUN_TOKEN_KEY] = run_token(out_dir)
    return fields


def materialize(fields: dict) -> dict:
    """``fields`` as ``SecurityConfig`` takes them: a generated token (``RUN_TOKEN_KEY``) written to a 0600 file in
    this node's temp directory (named by its hash, so services on one node share it) and named by ``token_file``."""
    fields = dict(fields)
    token = fields.pop(RUN_TOKEN_KEY, None)
    if token is None:
        return fields
    path = Path(tempfile.gettempdir()) / f"gyre-run-token-{hashlib.sha256(token.encode()).hexdigest()[:16]}"
    if not path.is_file():
        _write_private(path, token + "\n")
    return {**fields, "token_file": str(path)}
