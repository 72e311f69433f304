"""A one-node Slurm on loopback for the sbatch test: slurmctld + slurmd from Debian's ``slurm-wlm`` with a
generated ``slurm.conf`` in a temp dir, both in one PID namespace (stopping it ends every job step and
every Ray process a job started).

Authentication is ``auth/none`` + ``cred/none`` (no munge daemon): the cluster is one host on 127.0.0.1
and exists only for the test. Process tracking is ``proctrack/linuxproc`` and no task plugin, so neither
cgroups nor systemd is needed.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

from tests.deploy.system import free_ports, in_namespace, stop_process, tail_file

PACKAGES = {"/usr/sbin/slurmctld": "slurm-wlm", "/usr/sbin/slurmd": "slurm-wlm", "sbatch": "slurm-wlm"}
"""Binary → Debian package the Slurm test needs."""


class LoopbackSlurm:
    """slurmctld + slurmd for one node (this host, all its CPUs) on free ports. Use as a context manager.

    Attributes:
        root: temp dir with ``slurm.conf``, state, spool and both daemons' logs.
        env: environment for ``sbatch``/``squeue`` (``SLURM_CONF`` points at the generated file).
    """

    def __init__(self, root: Path):
        self.root = Path(root)
        self.conf = self.root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 60) -> None:
        """Write the config, start both daemons and wait until the node is idle.

        Raises:
            RuntimeError: a daemon exited or the node was not idle within ``timeout_s`` seconds (logs attached).
        """
        for sub in ("state", "spool"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.conf.write_text(self._config())
        script = (f"/usr/sbin/slurmctld -D -i -f {self.conf} & "
                  f"/usr/sbin/slurmd -D -f {self.conf} -N {socket.gethostname()} & wait")
        with open(self.root / "daemons.log", "wb") as log:
            self._proc = subprocess.Popen(in_namespace(["sh", "-c", script]), stdout=log, stderr=log,
                                          stdin=subprocess.DEVNULL, env=self.env)
        deadline, state = time.monotonic() + timeout_s, ""
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                break
            state = self.sinfo_state()
            if state in ("idle", "mixed"):
                return
            time.sleep(1)
        raise RuntimeError(f"one-node Slurm not idle within {timeout_s} s (node state {state!r}):\n"
                           f"{self.logs()}")

    def sinfo_state(self) -> str:
        """The node's state as ``sinfo`` reports it (``idle``, ``down``, …; '' if slurmctld is unreachable)."""
        proc = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=self.env, capture_output=True, text=True,
                              timeout=30)
        return proc.stdout.strip() if proc.returncode == 0 else ""

    def logs(self, n: int = 15) -> str:
        return "\n".join(f"--- {name}\n{tail_file(self.root / name, n)}"
                         for name in ("daemons.log", "slurmctld.log", "slurmd.log"))

    def stop(self) -> None:
        if self._proc is not None:
            stop_process(self._proc, timeout_s=5)  # the daemons do not need a graceful shutdown

    def __enter__(self) -> "LoopbackSlurm":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _config(self) -> str:
        host = socket.gethostname()
        ctl_port, node_port = free_ports(2)
        r = self.root
        return "\n".join([
            "ClusterName=gyretest",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ctl_port}",
            f"SlurmdPort={node_port}",
            "AuthType=auth/none",
            "CredType=cred/none",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'slurmd.pid'}",
            f"SlurmctldLogFile={r / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SchedulerType=sched/builtin",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "MpiDefault=none",
            "ReturnToService=2",
            f"NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN",
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
            "",
        ])
