"""A recipe's ``faults`` section arms fault points per incarnation of a service: validated when the recipe
loads (naming the key and the value), and passed by the supervisor's ``ServiceFactory`` as ``GYRE_FAULT_POINT``
in the actor's ``runtime_env`` — spec i to the i-th actor created for that service name, none after the list
ends, and a re-attached actor does not count as an incarnation."""

import time

import pytest

from gyre import faults
from gyre.services.common.logs import LOG_DIR_ENV
from gyre.services.control.orchestration import supervisor
from gyre.services.control.recipe.schema import RecipeError, load_recipe
from gyre.services.control.orchestration.supervisor import ServiceFactory

RECIPE = "deploy/recipes/tiny-test.yaml"
BASE_ENV = {"PYTHONPATH": "/repo", "TOKENIZERS_PARALLELISM": "false"}


def recipe_with(fault_section):
    return load_recipe(RECIPE, {"faults": fault_section, "run_dir": "/tmp/gyre-unit-runs"})


class FakeHandle:
    """What ``ActorClass.options(**opts).remote(...)`` returns: remembers the options it was created with."""

    def __init__(self, opts: dict) -> None:
        self.opts = opts


class FakeActorClass:
    """Test double of a Ray actor class: records every ``options(...)`` call."""

    def __init__(self) -> None:
        self.created: list[dict] = []

    def options(self, **opts):
        outer = self

        class _Remote:
            def remote(self, *args, **kwargs):
                outer.created.append(opts)
                return FakeHandle(opts)
        return _Remote()


def env_of(handle: FakeHandle) -> dict:
    return handle.opts["runtime_env"]["env_vars"]


def test_recipe_faults_are_normalised_per_service():
    recipe = recipe_with({"learner": ["learner.ckpt.mid_write#2", "learner.publish.mid_stream"],
                          "replay": "replay.wal.before_fsync#40", "rollout-3": ["", "rollout.spool.flush:EIO"]})
    assert recipe.faults == {"learner": ["learner.ckpt.mid_write#2", "learner.publish.mid_stream"],
                             "replay": ["replay.wal.before_fsync#40"], "rollout-3": ["", "rollout.spool.flush:EIO"]}
    assert load_recipe(RECIPE).faults == {}


@pytest.mark.parametrize("section, message", [
    ({"trainer": ["learner.ckpt.mid_write"]},
     "faults: unknown service 'trainer'; expected 'replay', 'learner', 'rollout-<i>' or 'reward_model'"),
    ({"rollout": ["rollout.apply_weights"]}, "unknown service 'rollout'"),
    ({"rollout-01": ["rollout.apply_weights"]}, "unknown service 'rollout-01'"),
    ({"learner": ["learner.ckpt.mid_write", "learner.ckpt.midwrite"]},
     "faults.learner[1]: fault point 'learner.ckpt.midwrite' (in 'learner.ckpt.midwrite') is not one of"),
    ({"replay": ["replay.wal.before_fsync#0"]},
     "faults.replay[0]: fault point 'replay.wal.before_fsync#0': hit count '0' must be a positive integer"),
    ({"replay": ["replay.wal.before_write:ENOPE"]}, "faults.replay[0]: fault point 'replay.wal.before_write:ENOPE'"),
    ({"learner": ["learner.ckpt.before_rename", "replay.wal.before_fsync#3"]},
     "faults.learner[1]: 'replay.wal.before_fsync#3' arms replay.wal.before_fsync, which learner never reaches; "
     "expected 'learner.*' points"),
    ({"rollout-0": ["rollout.spool.flush,learner.publish.mid_stream"]},
     "arms learner.publish.mid_stream, which rollout-0 never reaches; expected 'rollout.*' points"),
    ({"replay": [3]}, "faults.replay[0]: expected a fault spec string like 'replay....#2', got 3"),
    ({"replay": {"a": 1}}, "faults.replay: expected a list of fault specs (one per incarnation), got {'a': 1}"),
    (["replay.wal.before_fsync"], "faults must map a service name to a list of fault specs, got ['replay"),
])
def test_bad_fault_sections_are_named(section, message):
    with pytest.raises(RecipeError) as err:
        recipe_with(section)
    assert message in str(err.value)
    assert "faults" in str(err.value)


def test_each_incarnation_gets_its_own_fault_spec():
    recipe = recipe_with({"learner": ["learner.ckpt.mid_write#2", "learner.publish.mid_stream"],
                          "rollout-1": ["", "rollout.apply_weights"]})
    factory = ServiceFactory(recipe, dict(BASE_ENV), "fp")
    cls = FakeActorClass()
    log = str(recipe.out_dir.resolve() / "faults_fired.jsonl")
    base = {**BASE_ENV, LOG_DIR_ENV: str(recipe.out_dir.resolve() / "logs")}  # every service logs into the run dir
    learners = [factory._create(cls, "learner", "learner") for _ in range(3)]
    assert [env_of(h) for h in learners] == [
        {**base, faults.ENV: "learner.ckpt.mid_write#2", faults.LOG_ENV: log, faults.SERVICE_ENV: "learner",
         faults.INCARNATION_ENV: "0"},
        {**base, faults.ENV: "learner.publish.mid_stream", faults.LOG_ENV: log, faults.SERVICE_ENV: "learner",
         faults.INCARNATION_ENV: "1"},
        base,  # the third learner runs clean
    ]
    rollouts = [factory._create(cls, "rollout", "rollout-1") for _ in range(3)]
    assert [env_of(h) for h in rollouts] == [base, {
        **base, faults.ENV: "rollout.apply_weights", faults.LOG_ENV: log, faults.SERVICE_ENV: "rollout-1",
        faults.INCARNATION_ENV: "1"}, base]
    # services without a faults entry, and the factory's own env, are never armed
    assert env_of(factory._create(cls, "replay", "replay")) == base
    assert env_of(factory._create(cls, "rollout", "rollout-0")) == base
    assert factory.env == base
    assert factory.incarnations == {"learner": 3, "rollout-1": 3, "replay": 1, "rollout-0": 1}


def test_a_reattached_actor_is_not_an_incarnation(monkeypatch):
    recipe = recipe_with({"replay": ["replay.wal.after_roll#3", "replay.snapshot.before_rename"]})
    factory = ServiceFactory(recipe, dict(BASE_ENV), "fp")
    live = object()
    monkeypatch.setattr(supervisor.ray, "get_actor", lambda name, namespace: live)
    assert factory.attach("replay") is live  # an earlier driver's replay: it keeps whatever env it had
    assert factory.incarnations == {}
    first = factory._create(FakeActorClass(), "replay", "replay")
    assert env_of(first)[faults.ENV] == "replay.wal.after_roll#3"
    assert env_of(first)[faults.INCARNATION_ENV] == "0"


def test_a_name_still_held_by_a_killed_actor_is_retried_as_the_same_incarnation(monkeypatch):
    recipe = recipe_with({"replay": ["replay.wal.after_roll#3", "replay.snapshot.before_rename"]})
    factory = ServiceFactory(recipe, dict(BASE_ENV), "fp")
    monkeypatch.setattr(time, "sleep", lambda s: None)
    calls = []

    class NameTakenOnce(FakeActorClass):
        def options(self, **opts):
            calls.append(opts)
            if len(calls) == 1:
                raise ValueError("The name gyre:tiny-test:replay (namespace=gyre) is already taken")
            return super().options(**opts)

    handle = factory._create(NameTakenOnce(), "replay", "replay")
    assert len(calls) == 2 and env_of(handle)[faults.ENV] == "replay.wal.after_roll#3"
    assert env_of(handle)[faults.INCARNATION_ENV] == "0"
    assert factory.incarnations == {"replay": 1}


def test_creating_gives_up_on_a_name_held_past_the_patience_and_raises_other_errors_at_once(monkeypatch):
    from gyre.services.control.orchestration import factory as factory_module

    monkeypatch.setattr(factory_module, "NAME_TAKEN_POLL_S", 0.01)
    monkeypatch.setattr(factory_module, "NAME_TAKEN_PATIENCE_S", 0.1)
    factory = ServiceFactory(recipe_with({}), dict(BASE_ENV), "fp")

    class Refusing(FakeActorClass):
        def __init__(self, message):
            super().__init__()
            self.message, self.calls = message, 0

        def options(self, **opts):
            self.calls += 1
            if self.calls > 1000:
                raise RuntimeError("still retrying after 1000 calls")
            raise ValueError(self.message)

    held = Refusing("The name gyre:tiny-test:replay (namespace=gyre) is already taken")
    with pytest.raises(ValueError, match="already taken"):
        factory._create(held, "replay", "replay")
    assert held.calls >= 2  # it did wait for the name
    bad = Refusing("invalid num_gpus")
    with pytest.raises(ValueError, match="invalid num_gpus"):
        factory._create(bad, "replay", "replay")
    assert bad.calls == 1
