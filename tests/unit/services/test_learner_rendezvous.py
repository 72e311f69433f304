"""``services.learner.group.start_on_rendezvous``: a multi-rank learner start whose rank 0 finds the rendezvous
port taken (another process bound it between "found free" and "bound by rank 0") starts again on a new port;
any other failure is raised at once."""

import pytest
import ray

from gyre.services.learner import group

# What Ray raises when rank 0's __init__ failed in torch's rendezvous (message shape of ray.exceptions.ActorDiedError
# quoting the creation task's error).
TAKEN = ("The actor died because of an error raised in its creation task, ray::LearnerActor.__init__() ...\n"
         "torch.distributed.DistNetworkError: The server socket has failed to listen on any local network address. "
         "port: 52891, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use")


class _Ports:
    def __init__(self) -> None:
        self.given: list[int] = []

    def __call__(self) -> tuple[str, int]:
        self.given.append(52891 + len(self.given))
        return "10.0.0.1", self.given[-1]


def test_a_start_whose_port_was_taken_runs_again_on_a_new_port():
    ports, started = _Ports(), []

    def start(addr, port):
        started.append((addr, port))
        if len(started) == 1:
            raise ray.exceptions.RayActorError(error_msg=TAKEN)
        return "service"

    assert group.start_on_rendezvous(ports, start) == "service"
    assert started == [("10.0.0.1", 52891), ("10.0.0.1", 52892)]


def test_other_failures_are_raised_at_once():
    ports = _Ports()

    def start(addr, port):
        raise ray.exceptions.RayActorError(error_msg="ValueError: model not found")

    with pytest.raises(ray.exceptions.RayActorError, match="model not found"):
        group.start_on_rendezvous(ports, start)
    assert ports.given == [52891]


def test_a_port_taken_every_time_is_raised_after_the_last_attempt():
    ports = _Ports()

    def start(addr, port):
        raise RuntimeError(TAKEN)

    with pytest.raises(RuntimeError, match="EADDRINUSE"):
        group.start_on_rendezvous(ports, start, attempts=3)
    assert len(ports.given) == 3


def test_no_attempt_is_refused_by_name():
    with pytest.raises(ValueError, match=r"^attempts \(0\) must be at least 1$"):
        group.start_on_rendezvous(_Ports(), lambda a, p: None, attempts=0)
