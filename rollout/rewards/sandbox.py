"""Run untrusted Python (policy-written code) in a separate, limited process.

Layers, outermost first:

- **Process.** ``subprocess.Popen`` (fork+exec, safe after gRPC was used; no ``preexec_fn``, which the
  Python docs call unsafe in a threaded process, and no ``multiprocessing``) of ``sys.executable -I -S``
  in its own process group, with an empty environment and a fresh temp dir as cwd and ``HOME``.
  The dir is removed afterwards in every case, timeout included.
- **No network.** A new network namespace (``unshare --net --map-root-user``: only a downed loopback)
  when the kernel allows it; probed once per process and cached (``isolation()``).
- **rlimits**, set by the child before the code runs: ``RLIMIT_CPU`` (seconds), ``RLIMIT_AS``
  (bytes), ``RLIMIT_NPROC`` (fork guard; the kernel does not apply it to root, which the probe
  detects and reports), ``RLIMIT_FSIZE`` (bytes), ``RLIMIT_NOFILE``, ``RLIMIT_CORE`` = 0.
- **Audit hook** (PEP 578), always installed before the code: refuses sockets, fork/exec/spawn,
  ``subprocess``, ``ctypes`` and writes or deletes outside the temp dir. It is the fork and network
  guard of last resort (root, no user namespaces); a determined program can get around an audit hook,
  the kernel layers above are the real walls where they are available.
- **Wall clock.** After ``timeout_s`` the whole process group is killed (SIGKILL).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import structlog
from pydantic import BaseModel, ConfigDict, Field

log = structlog.get_logger("rollout.sandbox")

CHILD = Path(__file__).with_name("_sandbox_child.py")
Status = Literal["ok", "failed", "timeout", "memory", "forbidden", "error"]


class SandboxConfig(BaseModel):
    """Limits of one sandboxed run."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    timeout_s: float = Field(5.0, gt=0)
    """Wall-clock limit in seconds; then the process group is killed (status ``timeout``)."""
    cpu_s: int = Field(5, ge=1)
    """CPU-time limit in seconds (``RLIMIT_CPU``; SIGXCPU, status ``timeout``)."""
    memory_bytes: int = Field(1 << 30, ge=64 << 20)
    """Address-space limit in bytes (``RLIMIT_AS``); a larger allocation raises ``MemoryError``."""
    max_processes: int = Field(1, ge=1)
    """``RLIMIT_NPROC``: 1 means the program cannot fork at all (the kernel counts per user)."""
    max_file_bytes: int = Field(16 << 20, ge=1 << 20)
    """Largest file the program may write, stdout/stderr included (``RLIMIT_FSIZE``), in bytes."""
    max_open_files: int = Field(64, ge=16)
    """``RLIMIT_NOFILE``."""
    network: Literal["auto", "netns", "audit"] = "auto"
    """``auto``: a network namespace when the kernel allows, else the audit hook alone; ``netns``:
    require the namespace (``SandboxError`` when unavailable); ``audit``: never use a namespace."""
    stderr_tail_chars: int = Field(2000, ge=0)
    """How much of the end of stderr the result keeps."""
    stdout_head_chars: int = Field(0, ge=0)
    """How much of the start of stdout the result keeps (``SandboxResult.stdout``; a tool's output); at most
    this many characters are read, however much the program printed."""


class SandboxError(RuntimeError):
    """The sandbox itself cannot run as configured (e.g. ``network="netns"`` where it is unavailable)."""


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one sandboxed run."""

    passed: bool
    """True iff ``status == "ok"``: the program ran to its end without raising."""
    status: Status
    """``ok | failed | timeout | memory | forbidden | error`` (``error``: the sandbox, not the program)."""
    detail: str
    """One line: the exception, refused event or limit that decided the status ("" when ok)."""
    stderr_tail: str
    """Last ``stderr_tail_chars`` characters of the program's stderr."""
    wall_s: float
    """Seconds from start to verdict, process start-up included."""
    isolation: tuple[str, ...]
    """Active layers, e.g. ``("process", "netns", "rlimits", "nproc", "audit")``."""
    workdir: str
    """The temp dir the program ran in (already removed)."""
    stdout: str = ""
    """The first ``stdout_head_chars`` characters of the program's stdout ("" when that is 0)."""
    stdout_cut: bool = False
    """stdout held more than ``stdout`` (it was cut)."""


@dataclass(frozen=True)
class Isolation:
    """What this kernel/user allows, probed once per process."""

    netns: bool
    """``unshare --net --map-root-user`` works and leaves no route out."""
    nproc: bool
    """The kernel enforces ``RLIMIT_NPROC`` for this user (not for root)."""


_PROBE_LOCK = threading.Lock()
_PROBED: Isolation | None = None
_NETNS_PREFIX = ["unshare", "--net", "--map-root-user"]
_NET_PROBE = ("import socket\ns = socket.socket()\ntry:\n    s.connect(('192.0.2.1', 9))\n"
              "except OSError:\n    print('isolated')\n")
_NPROC_PROBE = ("import os, resource\nresource.setrlimit(resource.RLIMIT_NPROC, (1, 1))\ntry:\n"
                "    pid = os.fork()\nexcept OSError:\n    print('enforced')\nelse:\n"
                "    if pid == 0:\n        os._exit(0)\n    os.waitpid(pid, 0)\n")


def _probe_ok(argv: list[str], expect: str) -> bool:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=20, env={}, cwd=tempfile.gettempdir())
    except (OSError, subprocess.SubprocessError):
        return False
    return out.returncode == 0 and out.stdout.strip() == expect


def isolation() -> Isolation:
    """Probe (once, cached) which kernel layers work here; later calls return the cached answer."""
    global _PROBED
    with _PROBE_LOCK:
        if _PROBED is None:
            py = [sys.executable, "-I", "-S", "-c"]
            netns = shutil.which("unshare") is not None and _probe_ok(_NETNS_PREFIX + py + [_NET_PROBE], "isolated")
            _PROBED = Isolation(netns=netns, nproc=_probe_ok(py + [_NPROC_PROBE], "enforced"))
            log.info("sandbox_isolation", netns=_PROBED.netns, nproc=_PROBED.nproc)
        return _PROBED


def _layers(config: SandboxConfig) -> tuple[list[str], tuple[str, ...]]:
    iso = isolation()
    use_netns = config.network == "netns" or (config.network == "auto" and iso.netns)
    if use_netns and not iso.netns:
        raise SandboxError("network='netns' but `unshare --net --map-root-user` does not work here; "
                           "use network='auto' or 'audit'")
    layers = ("process",) + (("netns",) if use_netns else ()) + ("rlimits",) + (("nproc",) if iso.nproc else ())
    return (_NETNS_PREFIX if use_netns else []), layers + ("audit",)


def _rlimits(config: SandboxConfig) -> dict[str, list[int]]:
    return {"RLIMIT_CPU": [config.cpu_s, config.cpu_s + 1], "RLIMIT_AS": [config.memory_bytes] * 2,
            "RLIMIT_NPROC": [config.max_processes] * 2, "RLIMIT_FSIZE": [config.max_file_bytes] * 2,
            "RLIMIT_NOFILE": [config.max_open_files] * 2, "RLIMIT_CORE": [0, 0]}


def run_python(code: str, config: SandboxConfig | None = None) -> SandboxResult:
    """Run ``code`` (Python source) in the sandbox and classify the outcome; never raises for the
    program's behaviour (only ``SandboxError`` for an impossible configuration)."""
    config = config or SandboxConfig()
    prefix, layers = _layers(config)
    root = Path(tempfile.mkdtemp(prefix="gyre-sandbox-"))
    start = time.monotonic()
    try:
        home = root / "home"
        home.mkdir()
        nonce = secrets.token_hex(16)
        rc, timed_out = _run_child(prefix + [sys.executable, "-I", "-S", str(CHILD)], root, home, config.timeout_s,
                                   {"nonce": nonce, "code": code, "rlimits": _rlimits(config)})
        wall = time.monotonic() - start
        out = (root / "verdict").read_bytes().decode("utf-8", "replace")
        err = (root / "stderr").read_bytes().decode("utf-8", "replace")
        stdout, cut = _head(root / "stdout", config.stdout_head_chars)
    except OSError as exc:
        return SandboxResult(False, "error", f"sandbox could not run: {exc}", "", time.monotonic() - start,
                             layers, str(root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    status, detail = _classify(out, err, nonce, rc, timed_out, config)
    tail = err[-config.stderr_tail_chars:] if config.stderr_tail_chars else ""
    return SandboxResult(status == "ok", status, detail, tail, wall, layers, str(root), stdout, cut)


def _head(path: Path, chars: int) -> tuple[str, bool]:
    """The first ``chars`` characters of a UTF-8 file (reads at most ``4 * chars + 4`` bytes) and whether it
    holds more."""
    if chars == 0:
        return "", path.stat().st_size > 0
    with open(path, "rb") as f:
        raw = f.read(4 * chars + 4)
        more = bool(f.read(1))
    text = raw.decode("utf-8", "replace")
    return text[:chars], more or len(text) > chars


def _run_child(argv: list[str], root: Path, home: Path, timeout_s: float, request: dict) -> tuple[int, bool]:
    """Start the child, wait up to ``timeout_s`` seconds, kill its process group; (returncode, timed_out)."""
    with open(root / "verdict", "wb") as verdict, open(root / "stdout", "wb") as stdout, \
            open(root / "stderr", "wb") as stderr:
        (root / "request.json").write_text(json.dumps({**request, "verdict_fd": verdict.fileno()}))
        with open(root / "request.json", "rb") as stdin:
            proc = subprocess.Popen(argv, stdin=stdin, stdout=stdout, stderr=stderr, cwd=home,
                                    env={"HOME": str(home)}, process_group=0, close_fds=True,
                                    pass_fds=(verdict.fileno(),))
        timed_out = False
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            try:  # the group outlives its leader while any member does: take every descendant down
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
    return proc.returncode, timed_out


def _classify(out: str, err: str, nonce: str, rc: int, timed_out: bool,
              config: SandboxConfig) -> tuple[Status, str]:
    """Status from, in order: the wall clock, the child's verdict line, the signal or exit status."""
    if timed_out:
        return "timeout", f"wall clock limit {config.timeout_s} s"
    verdict = next((line for line in reversed(out.splitlines()) if line.startswith(nonce + " ")), None)
    if verdict is not None:
        _, status, *detail = verdict.split(" ", 2)
        return status, (detail[0] if detail else "")  # type: ignore[return-value]
    if rc in (-signal.SIGXCPU, -signal.SIGKILL):
        return "timeout", f"CPU limit {config.cpu_s} s (signal {-rc})"
    if rc == -signal.SIGXFSZ:
        return "error", f"output exceeded {config.max_file_bytes} bytes"
    if err.startswith("unshare:"):  # the namespace could not be made (e.g. a user-namespace limit)
        return "error", err.splitlines()[0][:300]
    if rc == 0:
        return "failed", "exited before the program finished (no verdict)"
    return "failed", f"exit status {rc} without a verdict"
