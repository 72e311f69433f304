"""Child side of ``rollout.rewards.sandbox``: runs untrusted code under limits, then prints a verdict.

Started as ``python -I -S _sandbox_child.py`` (isolated mode, no site-packages: stdlib only) with a
JSON request on stdin: ``{"nonce": str, "code": str, "verdict_fd": int, "rlimits": {"RLIMIT_CPU": [soft, hard], ...}}``.
Order matters: read the request, set the rlimits, install the audit hook, and only then compile and
run the code, so the code never runs without its limits.

The verdict, one line written to ``verdict_fd`` (a file of its own, so a program that fills stdout up
to ``RLIMIT_FSIZE`` cannot hide it), is ``"{nonce} {status} {detail}"`` with status ``ok`` (the code ran to the end),
``failed`` (it raised, e.g. an ``AssertionError`` from the tests), ``memory`` (``MemoryError``) or
``forbidden`` (the audit hook refused an event; the first one is named even when the code caught the
error). The nonce stops a completion that exits early (``os._exit(0)``) from reading as a pass; a
program that inspects this runner's frames could still forge it: this layer contains damage, it is
not a proof against a determined adversary. Stdlib only: this file must import nothing from gyre.
"""

import json
import os
import resource
import sys

# Events refused outright (CPython audit events, https://docs.python.org/3/library/audit_events.html).
_DENY = frozenset({
    "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
    "os.kill", "os.killpg", "os.setuid", "os.setgid", "os.chroot", "ctypes.dlopen", "ctypes.dlsym",
    "ctypes.cdata", "pty.spawn",
})
# Modules whose import alone gives a way around the hook (raw fork/exec, foreign calls).
_DENY_IMPORT = frozenset({"_ctypes", "ctypes", "_posixsubprocess", "_xxsubinterpreters", "_multiprocessing"})
# Events whose path arguments must stay inside the working directory.
_PATH_EVENTS = frozenset({
    "os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.symlink", "os.link",
    "os.truncate", "os.utime", "os.chdir", "shutil.rmtree", "shutil.move", "shutil.copyfile",
})
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


class SandboxViolation(PermissionError):
    """Raised inside the sandboxed program when it attempts a refused operation."""


def _inside(root: str, path) -> bool:
    if isinstance(path, int):
        return True  # an already-open descriptor was checked when it was opened
    try:
        full = os.path.realpath(os.fsdecode(path))
    except (TypeError, ValueError):
        return False
    return full == root or full.startswith(root + os.sep)


def _make_hook(root: str, violations: list):
    def deny(event: str, why: str):
        violations.append(f"{event}: {why}")
        raise SandboxViolation(f"sandbox refused {event} ({why})")

    def hook(event, args):
        if event in _DENY or event.startswith("socket."):
            deny(event, "not allowed in the reward sandbox")
        elif event == "import" and args and str(args[0]).split(".")[0] in _DENY_IMPORT:
            deny(event, f"module {args[0]!r}")
        elif event == "open" and len(args) >= 3:
            path, mode, flags = args[0], args[1], args[2]
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & _WRITE_FLAGS)
            if writing and not _inside(root, path):
                deny(event, f"write outside the sandbox dir: {path!r}")
        elif event in _PATH_EVENTS:
            for arg in args:
                if isinstance(arg, (str, bytes, os.PathLike)) and not _inside(root, arg):
                    deny(event, f"path outside the sandbox dir: {arg!r}")
    return hook


def main() -> None:
    request = json.loads(sys.stdin.read())
    nonce, code = request["nonce"], request["code"]
    verdict_fd = request["verdict_fd"]
    for name, (soft, hard) in request["rlimits"].items():
        resource.setrlimit(getattr(resource, name), (soft, hard))
    violations: list[str] = []
    sys.addaudithook(_make_hook(os.path.realpath(os.getcwd()), violations))
    status, detail = "ok", ""
    try:
        exec(compile(code, "<sandboxed>", "exec"), {"__name__": "__main__"})
    except MemoryError:
        status, detail = "memory", "MemoryError"
    except BaseException as exc:  # the program's own failure is the verdict, whatever it raised
        status, detail = "failed", f"{type(exc).__name__}: {exc}"[:500]
    if violations:
        status, detail = "forbidden", violations[0][:500]
    try:
        sys.stdout.flush()
    except BaseException:  # a closed or over-limit stdout must not hide the verdict
        pass
    os.write(verdict_fd, f"\n{nonce} {status} {' '.join(detail.split())}\n".encode("utf-8", "replace"))
    os._exit(0)


if __name__ == "__main__":
    main()
