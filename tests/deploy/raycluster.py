"""Ray clusters for the deploy tests: the checked-in ``deploy/local-cluster.yaml`` rendered for a loopback
node, a ``ray start --head --block`` head in its own PID namespace, and the Ray CLI run with timeouts.

Every head uses free ports (never Ray's defaults) and its own short ``--temp-dir``, so it cannot collide
with another user's private ``ray.init()`` head on the same machine.
"""

from __future__ import annotations

import getpass
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from tests.deploy.sshnode import LoopbackNode
from tests.deploy.system import REPO, VENV_BIN, free_port_range, free_ports, in_namespace, pid_namespace_problem

LOCAL_CLUSTER = REPO / "deploy" / "local-cluster.yaml"
WORKER_PORTS = 100
"""Width of the ``--min-worker-port .. --max-worker-port`` range (one port per Ray worker process)."""


@dataclass(frozen=True)
class HeadPorts:
    """Ports (TCP, 127.0.0.1) and temp dir of one Ray head."""

    gcs: int
    dashboard: int
    client_server: int
    agent_listen: int
    min_worker: int
    temp_dir: Path
    """Short on purpose: Ray's unix sockets live under it (108-byte path limit)."""

    @property
    def max_worker(self) -> int:
        return self.min_worker + WORKER_PORTS - 1

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gcs}"

    def start_flags(self) -> list[str]:
        """``ray start --head`` flags that keep this head off every default port and temp dir."""
        return ["--head", "--node-ip-address=127.0.0.1", f"--port={self.gcs}",
                f"--dashboard-port={self.dashboard}", f"--ray-client-server-port={self.client_server}",
                f"--dashboard-agent-listen-port={self.agent_listen}", f"--min-worker-port={self.min_worker}",
                f"--max-worker-port={self.max_worker}", f"--temp-dir={self.temp_dir}", "--disable-usage-stats"]


def pick_head_ports() -> HeadPorts:
    """Free ports right now and a fresh ``/tmp/gyre-ray-XXXX`` temp dir."""
    gcs, dashboard, client, agent = ports = free_ports(4)
    return HeadPorts(gcs, dashboard, client, agent, free_port_range(WORKER_PORTS, exclude=ports),
                     Path(tempfile.mkdtemp(prefix="gyre-ray-", dir="/tmp")))


def render_local_cluster(node: LoopbackNode, ports: HeadPorts, name: str, out: Path) -> Path:
    """Write ``deploy/local-cluster.yaml`` for ``node``: its repo path, ports, temp dir and cluster name
    substituted, and auth pointed at the node's key and port. Every substituted literal must occur in the
    checked-in file, so the test fails if the file drifts from what it exercises.

    Raises:
        AssertionError: a literal the template must contain is missing.
    """
    text = LOCAL_CLUSTER.read_text()
    subs = {"~/gyre": str(REPO), "--port=6390": f"--port={ports.gcs}", ":6390": f":{ports.gcs}",
            "--dashboard-port=8275": f"--dashboard-port={ports.dashboard}",
            "--ray-client-server-port=10011": f"--ray-client-server-port={ports.client_server}",
            "--dashboard-agent-listen-port=52375": f"--dashboard-agent-listen-port={ports.agent_listen}",
            "--min-worker-port=21000": f"--min-worker-port={ports.min_worker}",
            "--max-worker-port=21099": f"--max-worker-port={ports.max_worker}",
            "--temp-dir=/tmp/gyre-ray": f"--temp-dir={ports.temp_dir}"}
    for old, new in subs.items():
        assert old in text, f"{LOCAL_CLUSTER} no longer contains {old!r}; update the test's substitutions"
        text = text.replace(old, new)
    config = yaml.safe_load(text)
    config["cluster_name"] = name
    config["auth"] = {"ssh_user": "root", "ssh_private_key": str(node.key),
                      "ssh_proxy_command": node.proxy_command}
    out.write_text(yaml.safe_dump(config, sort_keys=False))
    return out


def ray_cli(args: list[str], timeout_s: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``<venv>/bin/ray ARGS`` from the repo root; a timeout becomes returncode 124 with its output."""
    argv = [str(VENV_BIN / "ray"), *args]
    try:
        return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or ""
        return subprocess.CompletedProcess(argv, 124, out, err + f"\n(timed out after {timeout_s:.0f} s)")


def forget_local_cluster(name: str) -> None:
    """Remove what the ``local`` provider and the ssh runner keep on the client for cluster ``name``."""
    from ray._common.utils import get_default_ray_temp_dir

    for suffix in ("state", "lock"):
        Path(get_default_ray_temp_dir(), f"cluster-{name}.{suffix}").unlink(missing_ok=True)
    for cached in Path(tempfile.gettempdir()).glob("ray-config-*"):  # `ray down` has no --no-config-cache
        if cached.is_file() and f'"{name}"' in cached.read_text(errors="replace"):
            cached.unlink(missing_ok=True)
    user = hashlib.sha256(getpass.getuser().encode()).hexdigest()[:10]
    shutil.rmtree(f"/tmp/ray_ssh_{user}/{hashlib.sha256(name.encode()).hexdigest()[:10]}", ignore_errors=True)


def head_env(auth_token: Path | None = None) -> dict:
    """Environment for a head started by a test and for the Ray CLI talking to it: gyre's venv first on
    PATH (job drivers run ``gyre``), the DeepSpeed op cache, and Ray's token auth pinned either way.

    Args:
        auth_token: a token file: token auth on (``RAY_AUTH_MODE=token``) with that token for the head, its
            drivers and the CLI. ``None``: auth off. Pinned because Ray 2.60 otherwise switches token auth
            on by itself whenever ``~/.ray/auth_token`` exists, which depends on the machine's history.
    """
    env = dict(os.environ)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("RAY_ADDRESS", None)
    env.pop("RAY_AUTH_TOKEN", None)
    if auth_token is None:
        env["RAY_AUTH_MODE"] = "disabled"
    else:
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(auth_token))
    return env


def start_blocking_head(ports: HeadPorts, log: Path, env: dict) -> subprocess.Popen:
    """``ray start --head --block``: stopping it (SIGTERM) stops every process of the head. Where the machine
    allows, it runs as PID 1 of a new PID namespace, so not even a leaked worker outlives it."""
    argv = [str(VENV_BIN / "ray"), "start", *ports.start_flags(), "--block"]
    if pid_namespace_problem() is None:
        argv = in_namespace(argv)
    with open(log, "wb") as f:
        return subprocess.Popen(argv, cwd=REPO, env=env, stdout=f, stderr=f, stdin=subprocess.DEVNULL)


def wait_for_job_api(address: str, proc: subprocess.Popen, env: dict, timeout_s: float) -> bool:
    """True once ``ray job list --address ADDRESS`` succeeds; False on timeout or if the head exited."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if ray_cli(["job", "list", "--address", address], timeout_s=60, env=env).returncode == 0:
            return True
        time.sleep(2)
    return False
