"""The placement group of a multi-rank learner (``placement.learner.world_size > 1``).

One bundle per DeepSpeed rank (``services.control.orchestration.placement.LearnerPlacement.bundles``), reserved with the recipe's strategy (PACK,
SPREAD, STRICT_*), detached and named ``gyre:{run}:learner-pg`` so it outlives the driver and a restarted
learner lands in the same reservation. Rank ``r`` runs in bundle ``r``; rank 0 is the ``learner`` service
(``LearnerActor``), ranks >= 1 are ``learner-rank-{r}`` (``LearnerRankActor``; names: ``services.common.names``).
The torch.distributed rendezvous is a free port on bundle 0's node, found by a zero-CPU task placed there; a
group start whose rank 0 finds that port taken is retried on a new one (``start_on_rendezvous`` says why).
"""

from __future__ import annotations

import socket
from typing import Callable, TypeVar

import ray
import structlog
from ray.util.placement_group import PlacementGroup, get_placement_group, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_attempt

log = structlog.get_logger("supervisor")

READY_TIMEOUT_S = 300.0
"""How long the reservation may take (a cluster autoscaler may have to add learner nodes)."""

RENDEZVOUS_ATTEMPTS = 3
"""Rendezvous ports a multi-rank learner start tries, in all, while rank 0 finds each one taken."""

T = TypeVar("T")


@ray.remote(num_cpus=0)
def _free_port() -> tuple[str, int]:
    """(this node's IP, a free TCP port on it) for the rendezvous of rank 0."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        port = sock.getsockname()[1]
    return ray.util.get_node_ip_address(), port


class LearnerGroup:
    """Get or create the run's learner placement group and wait until it is reserved.

    Raises:
        TimeoutError: the bundles were not reserved within ``READY_TIMEOUT_S`` seconds (the message names
            the bundles and strategy, e.g. more GPUs asked for than the cluster has).
    """

    def __init__(self, recipe) -> None:
        placement = recipe.placement.learner
        self.name = f"gyre:{recipe.name}:learner-pg"
        self.world_size = placement.world_size
        self.group = self._get()
        if self.group is not None and self.group.bundle_count != self.world_size:  # the recipe's world size changed
            log.warning("learner_group_resized", name=self.name, was=self.group.bundle_count, now=self.world_size)
            remove_placement_group(self.group)
            self.group = None
        if self.group is None:
            self.group = placement_group(placement.bundles(), strategy=placement.strategy, name=self.name,
                                         lifetime="detached")
        try:
            ray.get(self.group.ready(), timeout=READY_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError as exc:
            raise TimeoutError(
                f"learner placement group {self.name}: bundles {placement.bundles()} ({placement.strategy}) not "
                f"reserved within {READY_TIMEOUT_S:.0f} s; the cluster has {ray.cluster_resources()}") from exc
        log.info("learner_group_ready", name=self.name, world_size=self.world_size, strategy=placement.strategy)

    def _get(self) -> PlacementGroup | None:
        try:
            return get_placement_group(self.name)
        except ValueError:  # none yet
            return None

    def bundle(self, rank: int) -> PlacementGroupSchedulingStrategy:
        """Scheduling strategy that puts an actor in bundle ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"learner rank {rank} outside 0..{self.world_size - 1}")
        return PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=rank)

    def rendezvous(self) -> tuple[str, int]:
        """``(MASTER_ADDR, MASTER_PORT)``: a free port on the node of bundle 0 (where rank 0 runs)."""
        return tuple(ray.get(_free_port.options(scheduling_strategy=self.bundle(0)).remote(), timeout=60))


def port_taken(exc: BaseException) -> bool:
    """Whether ``exc`` (a rank's own error, or Ray's error wrapping it, which quotes it) says that a port could
    not be bound because it is in use: rank 0's torch ``DistNetworkError ... EADDRINUSE``."""
    text = str(exc)
    return "EADDRINUSE" in text or "address already in use" in text.lower()


def start_on_rendezvous(rendezvous: Callable[[], tuple[str, int]], start: Callable[[str, int], T],
                        attempts: int = RENDEZVOUS_ATTEMPTS) -> T:
    """``start(master_addr, master_port)`` on a fresh ``rendezvous()``; when it fails because the port was taken
    (``port_taken``), again on a new one, ``attempts`` times in all. ``start`` must leave nothing behind when it
    fails (``ServiceFactory.learner`` kills every rank it created).

    Why a retry rather than rank 0 binding port 0 and publishing the port: every rank needs ``MASTER_PORT``
    when it starts, before rank 0's actor has finished starting — its DeepSpeed init is a collective with the
    other ranks, so its ``__init__`` returns only once they joined, and a Ray actor can report nothing before
    ``__init__`` returns. Hosting the store in a separate actor on port 0 would add a process whose death breaks
    the group (the store is used after init: new groups, barriers). So the port is found free on bundle 0's node
    moments before rank 0 binds it; a process that takes it in between makes rank 0 fail at once with
    EADDRINUSE, and the whole group starts again on another port, without spending a supervisor restart.

    Raises:
        ValueError: ``attempts`` < 1.
        Exception: what ``start`` raised — at once unless the port was taken, else on the last attempt.
    """
    if attempts < 1:
        raise ValueError(f"attempts ({attempts}) must be at least 1")
    def warn(state: RetryCallState) -> None:
        log.warning("learner_rendezvous_port_taken", attempt=state.attempt_number, attempts=attempts,
                    error=str(state.outcome.exception())[:200])

    retrying = Retrying(retry=retry_if_exception(port_taken), stop=stop_after_attempt(attempts), reraise=True,
                        before_sleep=warn)
    return retrying(lambda: start(*rendezvous()))


def remove(recipe) -> None:
    """Release the run's learner placement group, if it has one (end of run)."""
    try:
        remove_placement_group(get_placement_group(f"gyre:{recipe.name}:learner-pg"))
    except ValueError:
        pass
