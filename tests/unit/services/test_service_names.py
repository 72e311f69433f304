"""Service names are parsed once and formatted once (``services.common.names.ServiceName``)."""

import pytest

from gyre.services.common.names import ServiceName


@pytest.mark.parametrize("name, role, index", [("replay", "replay", 0), ("learner", "learner", 0),
                                               ("learner-rank-3", "learner", 3), ("rollout-0", "rollout", 0),
                                               ("rollout-12", "rollout", 12), ("replay-shard-2", "replay", 2)])
def test_a_name_round_trips(name, role, index):
    parsed = ServiceName.parse(name)
    assert (parsed.role, parsed.index) == (role, index) and str(parsed) == name


@pytest.mark.parametrize("name", ["rollout", "rollout-01", "rollout--1", "learner-rank-0", "replay-1", "replay-shard-0", "trainer",
                                  "rollout-1x", 3])
def test_anything_else_is_refused(name):
    with pytest.raises(ValueError):
        ServiceName.parse(name)


def test_rollouts_sort_by_number_and_bad_fields_are_refused():
    names = [ServiceName.parse(n) for n in ("rollout-10", "rollout-2", "rollout-0")]
    assert [str(n) for n in sorted(names)] == ["rollout-0", "rollout-2", "rollout-10"]
    for role, index in (("trainer", 0), ("reward_model", 1), ("replay", -1), ("rollout", -1)):
        with pytest.raises(ValueError):
            ServiceName(role, index)
