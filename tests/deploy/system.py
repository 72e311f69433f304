"""Machine set-up for the deploy tests: Debian packages, free loopback ports, PID namespaces, log tails.

Each helper returns a *reason string* instead of raising when the machine cannot do something (no apt,
no namespaces), so a test can ``pytest.skip(reason)`` with the precise cause.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
from collections.abc import Collection
from pathlib import Path

from filelock import FileLock

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
"""The venv running the tests; its ``ray`` and ``gyre`` scripts drive the clusters."""


APT_LOCK = Path("/tmp/gyre-tests-apt.lock")
"""Serialises the deploy tests' ``apt-get`` calls: two xdist workers installing at once (sshd for ``ray up``,
Slurm) made the second fail on dpkg's frontend lock and skip its test."""


def ensure_debian_packages(needed: dict[str, str], timeout_s: float = 600) -> str | None:
    """Install the Debian packages whose binary is missing, e.g. ``{"/usr/sbin/sshd": "openssh-server"}``.

    Idempotent: a package whose binary exists is not touched. Tries ``apt-get install`` first and, if that
    fails (stale lists), ``apt-get update`` and once more. Calls from this suite's processes run one at a time
    (``APT_LOCK``), and each waits up to ``timeout_s`` for dpkg's own lock (``DPkg::Lock::Timeout``) that any other
    apt on the machine holds. Returns ``None`` when every binary exists afterwards, else a reason naming the
    missing binaries and apt's last output lines.
    """
    missing = {binary: pkg for binary, pkg in needed.items() if not _has_binary(binary)}
    if not missing:
        return None
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return f"{sorted(missing.values())} not installed and apt-get is not usable here (need root on Debian)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    wait = f"DPkg::Lock::Timeout={int(timeout_s)}"
    install = ["apt-get", "-o", wait, "install", "-y", "--no-install-recommends", *sorted(set(missing.values()))]
    out = ""
    with FileLock(APT_LOCK):
        for attempt in (install, ["apt-get", "-o", wait, "update"], install):
            if attempt is install and not [b for b in missing if not _has_binary(b)]:
                break  # another test installed them while this one waited for the lock
            try:
                proc = subprocess.run(attempt, env=env, capture_output=True, text=True, timeout=timeout_s)
            except subprocess.TimeoutExpired:
                return f"`{' '.join(attempt)}` did not finish in {timeout_s:.0f} s"
            out = proc.stdout + proc.stderr
            if attempt is install and proc.returncode == 0:
                break
    still = [b for b in missing if not _has_binary(b)]
    if still:
        return f"could not install {sorted(missing.values())} (still missing {still}): {tail_text(out, 5)}"
    return None


def _has_binary(binary: str) -> bool:
    return Path(binary).is_file() if binary.startswith("/") else shutil.which(binary) is not None


PORT_POOL_LOW = 20000
"""Lowest port a deploy test's daemon is given (``port_pool``)."""


def port_pool() -> tuple[int, int]:
    """``[low, high)``: the ports ``free_ports`` and ``free_port_range`` pick from, ``PORT_POOL_LOW`` up to the
    kernel's ephemeral range (``net.ipv4.ip_local_port_range``: 32768 where unreadable). A daemon's port goes on
    its command line or in its config, so it is picked before the daemon binds it; the ephemeral range is where
    every outgoing connection and every bind to port 0 on the machine gets its port, so below it only another
    explicit picker can take a port in between. A daemon that can also retry its start on a collision does
    (``sshnode.LoopbackNode``)."""
    try:
        ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    return PORT_POOL_LOW, max(ephemeral, PORT_POOL_LOW + 2048)


def free_ports(n: int, exclude: Collection[int] = ()) -> list[int]:
    """``n`` distinct TCP ports, drawn at random from ``port_pool`` (not ``exclude``), that bind on 127.0.0.1
    right now (they are released: the caller's daemon binds them later).

    Raises:
        RuntimeError: fewer than ``n`` such ports among 1000 tried.
    """
    low, high = port_pool()
    ports: list[int] = []
    for port in random.sample(range(low, high), min(1000, high - low)):
        if port not in exclude and _bindable(port):
            ports.append(port)
            if len(ports) == n:
                return ports
    raise RuntimeError(f"no {n} free ports in [{low}, {high}) on 127.0.0.1")


def free_port_range(width: int, exclude: Collection[int] = ()) -> int:
    """A port ``p`` in ``port_pool`` such that ``p .. p+width-1`` all bind on 127.0.0.1 now and none is in
    ``exclude``; the search starts at a random port (two runs at once rarely pick the same range) and wraps.

    Raises:
        RuntimeError: no such range.
    """
    low, high = port_pool()
    start = random.randrange(low, high - width + 1)
    for first in (start, low):
        p = first
        while p + width <= (high if first == start else start + width):
            bad = next((q for q in range(p, p + width) if q in exclude or not _bindable(q)), None)
            if bad is None:
                return p
            p = bad + 1
    raise RuntimeError(f"no {width} consecutive free ports in [{low}, {high}) on 127.0.0.1")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def pid_namespace_problem() -> str | None:
    """``None`` if ``unshare --pid --mount`` works here (it needs CAP_SYS_ADMIN), else the reason."""
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is not installed"
    proc = subprocess.run(["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "--mount", "true"],
                          capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        return f"cannot create PID/mount namespaces here: {proc.stderr.strip() or proc.returncode}"
    return None


def in_namespace(argv: list[str]) -> list[str]:
    """``argv`` as PID 1 of a new PID + mount namespace, SIGKILLed with everything in it when the returned
    process dies (``--kill-child``). Ray's ``ray stop`` run inside can only see, and kill, that namespace."""
    return ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "--mount", *argv]


def stop_process(proc: subprocess.Popen, timeout_s: float = 30) -> None:
    """SIGTERM, then SIGKILL after ``timeout_s`` seconds; a process started by this test only."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout_s)


def tail_text(text: str, n: int = 40) -> str:
    """The last ``n`` lines of ``text``."""
    return "\n".join(text.splitlines()[-n:])


def tail_file(path: Path, n: int = 40) -> str:
    """The last ``n`` lines of a file, or a note that it does not exist."""
    path = Path(path)
    if not path.is_file():
        return f"({path} does not exist)"
    return tail_text(path.read_text(errors="replace"), n)


def ray_session_logs(temp_dir: Path, n: int = 15) -> str:
    """Tails of the newest Ray session's ``*.err`` and job-driver logs under ``temp_dir`` (for assertion
    messages; ``raylet.out``'s periodic state dumps are left out)."""
    latest = Path(temp_dir) / "session_latest" / "logs"
    if not latest.is_dir():
        return f"(no Ray session logs under {temp_dir})"
    picks = [p for p in sorted(latest.glob("*")) if p.is_file() and p.stat().st_size
             and (p.suffix == ".err" or p.name.startswith("job-driver-"))]
    return "\n".join(f"--- {p.name}\n{tail_file(p, n)}" for p in picks[-10:])
