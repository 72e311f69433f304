"""deploy/prometheus: the alert rules are well-formed and use only metric names gyre exports."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from gyre.replay.buffer import TrajectoryBuffer
from gyre.replay.config import ReplayConfig
from gyre.rollout.spool import Spool
from gyre.rollout.stats import RolloutStats
from gyre.services.common.observability import LearnerMetrics, RolloutMetrics
from gyre.services.replay.metrics import replay_registry
from tests.fakes import group_table
from tests.unit.services.test_observability import learner_row

PROM_DIR = Path(__file__).resolve().parents[3] / "deploy" / "prometheus"
PROMETHEUS_BUILTIN = {"up"}
"""Series Prometheus itself writes for every target."""
_PROMQL_WORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring",
                 "group_left", "group_right", "inf", "nan"}


def rules() -> list[dict]:
    doc = yaml.safe_load((PROM_DIR / "alerts.yml").read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers that are not functions, keywords, label names
    (inside ``{}`` or ``by (...)``-style lists), durations (``[5m]``) or strings."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr):
        rest = expr[m.end():].lstrip()
        if not rest.startswith("(") and m.group().lower() not in _PROMQL_WORDS:
            names.add(m.group())
    return names


def test_metric_name_extraction():
    assert metric_names('max by (run_id) (a_total{service="x"}) - on (run_id) group_right b > 4') == {"a_total", "b"}
    assert metric_names("rate(gyre_learner_steps_total[5m]) == 0 and up") == {"gyre_learner_steps_total", "up"}


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> set[str]:
    """Every sample name the learner, rollout and replay registries expose once fed."""
    learner = LearnerMetrics("r")
    learner.observe_step(learner_row(1, kl_to_ref=0.1, entropy=1.0, checkpoint_s=1.0))
    spool = Spool(tmp_path_factory.mktemp("spool"), max_bytes=1 << 30, max_groups=8)
    spool.put(group_table(0))
    rollout = RolloutMetrics("r", "rollout-0")
    rollout.observe({**RolloutStats(spool=spool).as_dict(0), "groups_in_flight": 1, "learner_version": 2,
                     "reward_errors": 0})
    buffer = TrajectoryBuffer(ReplayConfig(dir=str(tmp_path_factory.mktemp("replay"))))
    try:
        buffer.snapshot()
        registries = [learner.registry, rollout.registry, replay_registry(buffer, "r")]
        names = {s.name for reg in registries for family in reg.collect() for s in family.samples}
    finally:
        buffer.close()
    assert {"checkpoint_last_save_seconds_ago", "runtime_state_age_seconds", "rollout_queue_length",
            "gyre_replay_wal_failed"} <= names
    return names


def test_every_rule_is_complete():
    found = rules()
    assert len(found) >= 8
    for rule in found:
        assert isinstance(rule.get("alert"), str) and re.fullmatch(r"[A-Z][A-Za-z0-9]+", rule["alert"]), rule
        assert isinstance(rule.get("expr"), str) and rule["expr"].strip(), rule
        assert re.fullmatch(r"\d+[smh]", str(rule.get("for"))), rule
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, rule
        assert rule["annotations"]["summary"].strip(), rule
    assert len({r["alert"] for r in found}) == len(found)


def test_the_issue_s_alerts_are_there():
    exprs = {r["alert"]: r["expr"] for r in rules()}
    used = set().union(*(metric_names(e) for e in exprs.values()))
    assert {"up", "gyre_learner_steps_total", "checkpoint_last_save_seconds_ago", "gyre_policy_version",
            "rollout_queue_length", "gyre_replay_wal_failed"} <= used


def test_every_metric_name_in_an_expr_is_exported(exported):
    for rule in rules():
        unknown = metric_names(rule["expr"]) - exported - PROMETHEUS_BUILTIN
        assert not unknown, f"{rule['alert']} uses {sorted(unknown)}, which no gyre registry exports"


def test_scrape_config_loads_the_rules_and_scrapes_every_service():
    config = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
    assert config["rule_files"] == ["alerts.yml"]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"gyre-replay", "gyre-learner", "gyre-rollout"}
    for job in jobs.values():
        for target in job["static_configs"][0]["targets"]:
            assert re.fullmatch(r"[\w.-]+:\d+", target), target
