"""Ports of the deploy tests' daemons (``tests.deploy.system``): picked below the kernel's ephemeral range, where
no outgoing connection or bind to port 0 can take them between the pick and the daemon's bind; and sshd, whose
port may still be taken meanwhile, started again on a new one (``sshnode.LoopbackNode``). Fast: no Ray."""

import shutil
import socket
import tempfile
from pathlib import Path

import pytest

from tests.deploy import sshnode, system


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    low, high = system.port_pool()
    ports = system.free_ports(5)
    assert len(set(ports)) == 5 and all(low <= p < high for p in ports)
    ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert high <= max(ephemeral, system.PORT_POOL_LOW + 2048)
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_range_leaves_out_the_excluded_ports():
    low, high = system.port_pool()
    ports = system.free_ports(4)
    first = system.free_port_range(100, exclude=ports)
    assert low <= first and first + 100 <= high
    assert not set(range(first, first + 100)) & set(ports)


def test_sshd_whose_port_was_taken_meanwhile_starts_again_on_another(monkeypatch):
    missing = [b for b in (sshnode.SSHD, "/usr/bin/ssh", "/usr/bin/nc", "/usr/bin/ssh-keygen") if not Path(b).exists()]
    reason = (f"missing {missing}" if missing else None) or system.pid_namespace_problem()
    if reason:
        pytest.skip(reason)
    thief = socket.socket()  # another process took the picked port before sshd bound it (bound, not listening:
    thief.bind(("127.0.0.1", 0))  # a login attempt to it is refused at once)
    taken, picks, real = thief.getsockname()[1], [], sshnode.free_ports

    def free_ports(n, exclude=()):
        picks.append(list(exclude))
        return [taken] if len(picks) == 1 else real(n, exclude)
    monkeypatch.setattr(sshnode, "free_ports", free_ports)
    root = Path(tempfile.mkdtemp(prefix="gyre-node-", dir="/tmp"))
    node = sshnode.LoopbackNode(root)
    try:
        node.start()
        assert node.port != taken
        assert node.ssh("echo up").stdout.strip() == "up"
    finally:
        if node._proc is not None:  # SIGKILL: unshare --kill-child takes sshd along (``stop`` waits 30 s on SIGTERM)
            node._proc.kill()
            node._proc.wait()
        thief.close()
        shutil.rmtree(root, ignore_errors=True)
    assert picks == [[], [taken]]  # the first pick, then one more that avoids it
