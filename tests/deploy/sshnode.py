"""A "remote" node on loopback for ``ray up``: OpenSSH's sshd on 127.0.0.1:<free port>, with a host key
and a client key generated into a temp dir, running as PID 1 of its own PID + mount namespace.

The namespace is what makes this safe on a shared machine and faithful to a real node:
- ``ray down`` runs a bare ``ray stop`` on the head, which kills every Ray process it can see; inside the
  namespace it sees only the head ``ray up`` started there, never other users' Ray instances.
- Inside, ``/etc/passwd`` is bind-mounted with root's home pointing at ``<root>/home``, so what Ray writes
  to the node's ``~`` (``ray_bootstrap_config.yaml``, ``ray_bootstrap_key.pem``, the ``ray submit``
  script, the cluster yaml's ``~/.bashrc`` line) lands in the temp dir; the real ``~`` and ``~/.ssh`` are
  never touched.
- Stopping the node kills sshd (PID 1), and the kernel kills everything left in the namespace.

Ray's SSH runner has no port option, so clients reach the port through ``auth.ssh_proxy_command``
(``nc 127.0.0.1 PORT``).
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from tests.deploy.system import free_ports, in_namespace, stop_process, tail_file

SSHD = "/usr/sbin/sshd"
PACKAGES = {SSHD: "openssh-server", "rsync": "rsync", "nc": "netcat-openbsd", "ssh-keygen": "openssh-client"}
"""Binary → Debian package the ``ray up`` test needs."""


class LoopbackNode:
    """sshd for ``root`` on 127.0.0.1, key-only, in a fresh PID/mount namespace. Use as a context manager.

    Attributes:
        root: temp dir holding keys, ``sshd_config``, ``sshd.log`` and the node's home (``root/home``).
        port: the TCP port sshd listens on (127.0.0.1 only).
        key: path of the private key authorised for root.
    """

    def __init__(self, root: Path):
        self.root = Path(root)
        self.home = self.root / "home"
        self.key = self.root / "client_key"
        self.log = self.root / "sshd.log"
        self.port = free_ports(1)[0]
        self._proc: subprocess.Popen | None = None

    @property
    def proxy_command(self) -> str:
        """The ``ProxyCommand`` (``auth.ssh_proxy_command``) that reaches this sshd."""
        return f"nc 127.0.0.1 {self.port}"

    def start(self, timeout_s: float = 30, attempts: int = 3) -> None:
        """Generate keys and config, start sshd and wait until ``ssh root@127.0.0.1 true`` succeeds. ``port`` was
        free when picked, not necessarily when sshd binds it: an sshd that exits because the port is in use is
        started again on a new port (``attempts`` starts in all).

        Raises:
            RuntimeError: sshd exited (its port taken on every attempt, or another reason) or no login worked
                within ``timeout_s`` seconds (sshd's log attached).
        """
        self.home.mkdir(parents=True, mode=0o700)
        (self.home / ".bashrc").touch()  # a fresh node's (empty) shell profile
        for name in ("host_key", "client_key"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"gyre-test-{name}",
                            "-f", str(self.root / name)], check=True, capture_output=True)
        (self.root / "authorized_keys").write_text((self.root / "client_key.pub").read_text())
        (self.root / "passwd").write_text(_passwd_with_root_home(self.home))
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation dir
        for attempt in range(1, attempts + 1):
            if self._start_sshd(timeout_s):
                return
            if attempt < attempts:
                self.port = free_ports(1, exclude=[self.port])[0]
        raise RuntimeError(f"sshd found its port taken {attempts} times: {tail_file(self.log)}")

    def _start_sshd(self, timeout_s: float) -> bool:
        """Start sshd on ``port`` and wait for a login: True once one works, False if sshd exited because the
        port is in use. Raises ``RuntimeError`` as ``start`` does otherwise."""
        (self.root / "sshd_config").write_text(self._sshd_config())
        script = (f"mount --bind {self.root / 'passwd'} /etc/passwd && "
                  f"exec {SSHD} -D -e -f {self.root / 'sshd_config'}")
        with open(self.log, "wb") as log:
            self._proc = subprocess.Popen(in_namespace(["sh", "-c", script]), stdout=log, stderr=log,
                                          stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                if "Address already in use" in self.log.read_text(errors="replace"):
                    return False
                raise RuntimeError(f"sshd exited with {self._proc.returncode}: {tail_file(self.log)}")
            if self.ssh("true", timeout_s=10).returncode == 0:
                return True
            time.sleep(0.5)
        raise RuntimeError(f"no ssh login to 127.0.0.1:{self.port} within {timeout_s} s: {tail_file(self.log)}")

    def ssh(self, command: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
        """Run ``command`` on the node as root (non-login shell); output captured as text."""
        argv = ["ssh", "-i", str(self.key), "-o", "IdentitiesOnly=yes", "-o", "StrictHostKeyChecking=no",
                "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR", "-o", "BatchMode=yes",
                "-o", f"ProxyCommand={self.proxy_command}", "root@127.0.0.1", command]
        try:
            return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            return subprocess.CompletedProcess(argv, 124, exc.stdout or "", f"timed out after {timeout_s} s")

    def stop(self) -> None:
        """Kill sshd and, with it, every process left in the node's namespace."""
        if self._proc is not None:
            stop_process(self._proc)

    def __enter__(self) -> "LoopbackNode":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _sshd_config(self) -> str:
        return "\n".join([
            f"Port {self.port}",
            "ListenAddress 127.0.0.1",
            f"HostKey {self.root / 'host_key'}",
            f"PidFile {self.root / 'sshd.pid'}",
            f"AuthorizedKeysFile {self.root / 'authorized_keys'}",
            "PermitRootLogin prohibit-password",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            "StrictModes no",
            "LogLevel VERBOSE",
            "Subsystem sftp internal-sftp",
            "",
        ])


def _passwd_with_root_home(home: Path) -> str:
    lines = []
    for line in Path("/etc/passwd").read_text().splitlines():
        fields = line.split(":")
        if fields[0] == "root" and len(fields) == 7:
            fields[5] = str(home)
        lines.append(":".join(fields))
    return "\n".join(lines) + "\n"
