"""Who dials whom: the one table of a run's service topology.

Three roles serve gRPC and are dialled by others: replay (ReplayService, the trajectory buffer), the learner
(WeightService, the policy weights) and, in a run whose rewards name a model, the reward model
(RewardModelService). Rollouts serve nothing the others dial. ``TOPOLOGY`` says, per role,

* ``dials``: the servers (roles) it connects to; each one's address is passed when the service is created
  (the factory's ``replay_address`` / ``weights_address`` arguments) and pushed when it changes;
* ``serves``: when it is a server, the actor method that answers its address (``address_method``) and the
  actor method its clients take a new address with (``push_method``);
* ``optional``: a server only some runs have (the reward model); its clients are created with ``None`` as its
  address when the run has none, and nothing is pushed.

The supervisor reads it (``clients_of``, ``dialled_by``) in every path that hands addresses out: a restarted
server's new address goes to every running service whose role dials it, and a service that joins (re-attached
by a new driver, or a rollout that finished starting) is told the current address of every server it dials.
``tests/unit/services/test_ops_supervisor.py`` checks the supervisor's pushes and the actors' methods and
arguments against this table.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Endpoint:
    """A server role's gRPC endpoint, as its clients learn it."""

    address_method: str
    """The server actor's method answering ``host:port`` (called on a re-attached server)."""
    push_method: str
    """The client actors' method taking a new ``host:port`` of this server (idempotent for the same one)."""
    address_arg: str
    """The client actors' creation argument carrying this server's address (``LearnerActor.__init__``,
    ``RolloutActor.setup``)."""


@dataclass(frozen=True)
class Role:
    """One role's place in the topology."""

    dials: tuple[str, ...]
    """Server roles it connects to, in the order its address arguments come."""
    serves: Endpoint | None = None
    """Its endpoint when other roles dial it; ``None`` when none does."""
    optional: bool = False
    """Only runs that need it have one (``ServiceFactory.has``)."""


TOPOLOGY: dict[str, Role] = {
    "replay": Role(dials=(), serves=Endpoint("address", "set_replay_address", "replay_address")),
    "learner": Role(dials=("replay",), serves=Endpoint("weights_address", "set_weights_address", "weights_address")),
    "rollout": Role(dials=("replay", "learner", "reward_model")),
    "reward_model": Role(dials=(), serves=Endpoint("address", "set_reward_model_address", "reward_model_address"),
                         optional=True),
}
"""Role (``services.common.names.ROLES``) → its place; the ranks >= 1 of a multi-rank learner dial nothing
(rank 0 talks to replay and serves weights for the group)."""


def endpoint(server: str) -> Endpoint:
    """The endpoint of server role ``server``.

    Raises:
        KeyError: ``server`` is not a role others dial.
    """
    serves = TOPOLOGY[server].serves
    if serves is None:
        raise KeyError(f"no role dials {server!r}")
    return serves


def dialled_by(role: str) -> tuple[str, ...]:
    """The server roles ``role`` connects to."""
    return TOPOLOGY[role].dials


def clients_of(server: str) -> tuple[str, ...]:
    """The roles that dial ``server`` (get its new address pushed when it restarts)."""
    return tuple(role for role, place in TOPOLOGY.items() if server in place.dials)


def servers() -> tuple[str, ...]:
    """The roles others dial (``replay``, ``learner``, ``reward_model``)."""
    return tuple(role for role, place in TOPOLOGY.items() if place.serves is not None)
