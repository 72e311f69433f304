"""Prometheus metrics of the learner and rollout services (replay's are ``services.replay.metrics``).

One ``CollectorRegistry`` per service, served on its own ``/metrics`` port by ``serve``. Every metric
carries the labels ``service`` (``learner``, ``rollout-0``, ``replay``…) and ``run_id``. Names follow
Prometheus conventions (``gyre_`` prefix, ``_total`` counters, ``_seconds`` units) except the three
names the operators' dashboards already use, which are registered exactly as given:

- ``checkpoint_last_save_seconds_ago`` (learner): seconds since the last committed checkpoint,
  computed at scrape time.
- ``runtime_state_age_seconds`` (every service): seconds since the service's state was last made
  durable, i.e. the work a crash now would cost. Learner: seconds since the last committed checkpoint
  (same value as above). Rollout: age of the oldest spool entry replay has not acknowledged (0 when
  the spool is empty; absent without a spool). Replay: seconds since its newest snapshot (absent before
  the first one); inserts are durable in the WAL before their ack, so this bounds the WAL tail a
  restart replays, not lost data.
- ``rollout_queue_length`` (rollout): groups generating now plus groups in the spool awaiting replay's ack.

Policy lag across services is a PromQL join:
``max(gyre_policy_version{service="learner"}) - min(gyre_policy_version{service=~"rollout.*"})``.
"""

from __future__ import annotations

import math
import threading
import time
from numbers import Real
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LABELS = ("service", "run_id")
STALENESS_BUCKETS = 8
"""Must equal ``learner.step_metrics.STALENESS_BUCKETS`` (lag ``>= 8`` lands in ``+Inf``; a test checks)."""

_LEARNER_GAUGES = {  # row key -> (metric name, help)
    "version": ("gyre_policy_version", "Policy version the service holds (learner: last published)"),
    "step_s": ("gyre_learner_step_seconds", "Seconds of the last loop step (sample wait, train, publish, save)"),
    "step_time_s": ("gyre_learner_train_step_seconds", "Seconds of the last engine train_step (fwd/bwd/optim)"),
    "sample_wait_s": ("gyre_learner_sample_wait_seconds", "Seconds the last step waited for a replay batch"),
    "publish_s": ("gyre_learner_publish_seconds", "Seconds to publish the last policy version"),
    "tokens_per_s": ("gyre_learner_tokens_per_second", "Non-pad tokens per second of the last train_step"),
    "loss": ("gyre_learner_loss", "Total loss of the last step"),
    "grad_norm": ("gyre_learner_grad_norm", "Global gradient norm before clipping"),
    "is_ratio_mean": ("gyre_learner_is_ratio_mean", "Mean importance ratio pi_proximal / pi_behaviour"),
    "is_ratio_max": ("gyre_learner_is_ratio_max", "Largest importance ratio of the last step"),
    "tis_clip_frac": ("gyre_learner_tis_clip_fraction", "Fraction of tokens whose IS weight was truncated (TIS)"),
    "mis_masked_frac": ("gyre_learner_mis_masked_fraction", "Fraction of tokens masked by MIS"),
    "ppo_clip_frac": ("gyre_learner_ppo_clip_fraction", "Fraction of tokens clipped by the PPO ratio clip"),
    "is_ess_frac": ("gyre_learner_is_ess_fraction", "Kish effective sample size of the IS weights / N"),
    "approx_kl": ("gyre_learner_approx_kl", "k3 estimate of KL(behaviour || policy), token mean"),
    "kl_to_ref": ("gyre_learner_kl_to_ref", "KL to the reference policy, token mean (kl_coef > 0 only)"),
    "kl_coef": ("gyre_learner_kl_coef", "KL coefficient beta the last step used (kl_coef > 0 only; kl_ctrl)"),
    "entropy": ("gyre_learner_entropy_nats", "Token-mean policy entropy (nats)"),
    "reward_mean": ("gyre_learner_reward_mean", "Mean reward of the last batch"),
    "reward_std": ("gyre_learner_reward_std", "Reward standard deviation of the last batch"),
    "staleness_mean": ("gyre_learner_staleness_mean", "Mean policy lag (versions) of the last batch"),
    "staleness_max": ("gyre_learner_staleness_max", "Largest policy lag (versions) of the last batch"),
    "pending_leases": ("gyre_learner_pending_leases", "Replay leases trained on but not acked (awaiting a checkpoint)"),
}
_LEARNER_COUNTERS = {"tokens": ("gyre_learner_tokens", "Non-pad tokens trained on"),
                     "trajectories": ("gyre_learner_trajectories", "Trajectories trained on"),
                     "loss_spike": ("gyre_learner_loss_spikes", "Steps whose loss or grad norm spiked "
                                    "(learner.spike_save; each shortened the checkpoint interval)"),
                     "dead_timeline_rows": ("gyre_learner_dead_timeline_trajectories",
                                            "Trajectories trained on that a crashed learner's weights sampled after "
                                            "the version this learner resumed from"),
                     "staleness_negative": ("gyre_learner_negative_lag_trajectories",
                                            "Trajectories trained on whose version the learner had not reached "
                                            "(a crashed learner's weights after a rewind)")}


def _number(key: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"metrics row key {key!r} must be a number; got {value!r} ({type(value).__name__})")
    return float(value)


def _check_labels(run_id: str, service: str) -> None:
    for name, value in (("run_id", run_id), ("service", service)):
        if not isinstance(value, str) or not value:
            raise ValueError(f"{name} must be a non-empty string; got {value!r}")


class LearnerMetrics:
    """Prometheus metrics of one learner service, fed one ``LearnerLoop.step`` row at a time.

    Args:
        run_id, service: label values on every metric.
        async_save: the loop's ``config.async_save``. Decides how a commit is read off a row: async →
            the row carries ``checkpoint_write_s`` (capture-to-commit seconds) when a background save
            committed; sync → ``checkpoint_s > 0`` means the step committed one, taking that long.
            (Under async save an emergency SIGUSR1/SIGTERM save commits without ``checkpoint_write_s``
            and is not counted.)
        clock: unix seconds (``time.time``); injectable for tests.

    Before the first save seen, ``checkpoint_last_save_seconds_ago`` counts from construction (the
    service start) unless ``observe_resume`` gave the resumed checkpoint's commit time, so an alert on
    it also fires for a learner that never saves.

    Raises:
        ValueError: empty ``run_id`` or ``service``.
    """

    def __init__(self, run_id: str, service: str = "learner", async_save: bool = False,
                 clock: Callable[[], float] = time.time) -> None:
        _check_labels(run_id, service)
        self.registry = CollectorRegistry()
        self.async_save, self._clock = async_save, clock
        self._last_save = clock()
        self._labels = labels = (service, run_id)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, LABELS, registry=self.registry).labels(*labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, LABELS, registry=self.registry).labels(*labels)

        # parents: a gauge gets its labelled child (is exposed) once a row carried its key
        self._gauges = {key: Gauge(name, doc, LABELS, registry=self.registry)
                        for key, (name, doc) in _LEARNER_GAUGES.items()}
        self._counters = {key: counter(name, doc) for key, (name, doc) in _LEARNER_COUNTERS.items()}
        self.steps = counter("gyre_learner_steps", "Optimizer steps taken by this process")
        self.checkpoints = counter("gyre_checkpoints", "Checkpoints committed by this process")
        self.checkpoint_failures = counter("gyre_checkpoint_failures", "Background checkpoint writes that failed")
        self.save_duration = gauge("gyre_checkpoint_last_save_duration_seconds",
                                   "Seconds of the last committed save (sync: training blocked; async: "
                                   "capture to commit)")
        gauge("checkpoint_last_save_seconds_ago", "Seconds since the last committed checkpoint (scrape time)"
              ).set_function(self.seconds_since_save)
        gauge("runtime_state_age_seconds", "Seconds since the service's state was last made durable "
              "(learner: since the last committed checkpoint)").set_function(self.seconds_since_save)
        self.staleness = Histogram(
            "gyre_learner_trajectory_staleness", "Policy lag (versions) of trained trajectories; lag >= "
            f"{STALENESS_BUCKETS} is counted in +Inf (and as {STALENESS_BUCKETS} in the sum)", LABELS,
            registry=self.registry, buckets=[float(k) for k in range(STALENESS_BUCKETS)] + [math.inf],
        ).labels(*labels)

    def seconds_since_save(self) -> float:
        """Seconds since the last committed checkpoint (or the service start before any; see class doc)."""
        return max(self._clock() - self._last_save, 0.0)

    def observe_resume(self, version: int, saved_at: float | None = None) -> None:
        """After ``LearnerLoop.resume``: ``version`` is the engine's policy version; ``saved_at`` the
        resumed checkpoint's commit time (unix seconds, e.g. its ``metadata.json`` mtime; ``None`` on a
        cold start). Counts no checkpoint. Raises ``ValueError`` for a negative version."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"policy version must be an int >= 0; got {version!r}")
        self._gauges["version"].labels(*self._labels).set(version)
        if saved_at is not None:
            self._last_save = _number("saved_at", saved_at)

    def observe_checkpoint(self, duration_s: float, ok: bool = True) -> None:
        """Record a save outside ``observe_step`` (e.g. ``LearnerLoop.checkpoint()`` in ``finalize``):
        ``ok`` → committed now, taking ``duration_s`` seconds; else a failure."""
        if not ok:
            self.checkpoint_failures.inc()
            return
        duration = _number("duration_s", duration_s)
        if duration < 0:
            raise ValueError(f"checkpoint duration_s must be >= 0; got {duration_s!r}")
        self.checkpoints.inc()
        self.save_duration.set(duration)
        self._last_save = self._clock()

    def observe_step(self, row: dict) -> None:
        """Update every metric from one ``LearnerLoop.step()`` row (keys documented on
        ``LearnerEngine.train_step`` and ``LearnerLoop.step``). Keys absent from the row leave their
        gauge as it was (a gauge no row carried yet is not exposed, e.g. ``kl_to_ref`` without a KL
        term); ``staleness_hist_k`` counts (``k = 0..8``) feed the staleness histogram.

        Raises:
            ValueError: ``row`` is not a dict, lacks ``version``, or a known key is not a number /
                a staleness count is not a non-negative integer.
        """
        if not isinstance(row, dict) or "version" not in row:
            raise ValueError(f"expected a LearnerLoop.step() metrics row (dict with 'version'); got {row!r:.200}")
        values = {key: _number(key, row[key]) for key in (*_LEARNER_GAUGES, *_LEARNER_COUNTERS) if key in row}
        for key, gauge in self._gauges.items():
            if key in values:
                gauge.labels(*self._labels).set(values[key])
        for key, counter in self._counters.items():
            if key in values:
                counter.inc(values[key])
        self.steps.inc()
        self._observe_staleness(row)
        self._observe_save(row)

    def _observe_staleness(self, row: dict) -> None:
        for k in range(STALENESS_BUCKETS + 1):
            count = row.get(f"staleness_hist_{k}")
            if count is None:
                continue
            n = _number(f"staleness_hist_{k}", count)
            if n < 0 or n != int(n):
                raise ValueError(f"staleness_hist_{k} must be a non-negative integer count; got {count!r}")
            for _ in range(int(n)):
                self.staleness.observe(float(k))

    def _observe_save(self, row: dict) -> None:
        if row.get("checkpoint_failed"):
            self.observe_checkpoint(0.0, ok=False)
        if "checkpoint_write_s" in row:
            self.observe_checkpoint(row["checkpoint_write_s"])
        elif not self.async_save and _number("checkpoint_s", row.get("checkpoint_s", 0.0)) > 0:
            self.observe_checkpoint(row["checkpoint_s"])


_ROLLOUT_REQUIRED = ("version", "groups", "trajectories", "tokens", "tokens_per_s", "reward_mean",
                     "weight_updates", "last_update_s", "insert_retries")
_ROLLOUT_GAUGES = {
    "version": ("gyre_policy_version", "Policy version the service holds (rollout: last applied)"),
    "tokens_per_s": ("gyre_rollout_tokens_per_second", "Generated tokens per second since the service start"),
    "reward_mean": ("gyre_rollout_reward_mean", "Mean reward of the trajectories generated since start"),
    "last_update_s": ("gyre_rollout_last_weight_apply_seconds", "Seconds of the last in-flight weight apply"),
    "groups_in_flight": ("gyre_rollout_groups_in_flight", "Groups being generated now"),
    "spool_pending_groups": ("gyre_rollout_spool_pending_groups", "Spooled groups replay has not acked"),
    "spool_pending_bytes": ("gyre_rollout_spool_pending_bytes", "Bytes of the spooled groups not acked"),
    "env_calls_stuck": ("gyre_rollout_env_calls_stuck",
                        "Blocking environment calls abandoned at an episode's time budget and still running"),
}
_ROLLOUT_COUNTERS = {
    "groups": ("gyre_rollout_groups", "Groups generated"),
    "trajectories": ("gyre_rollout_trajectories", "Trajectories generated"),
    "tokens": ("gyre_rollout_tokens", "Tokens generated"),
    "weight_updates": ("gyre_rollout_weight_updates", "Policy versions applied in flight"),
    "insert_retries": ("gyre_rollout_insert_retries", "Inserts re-sent after replay did not ack"),
    "spool_quarantined": ("gyre_rollout_spool_quarantined", "Corrupt spool files moved to quarantine/"),
    "reward_errors": ("gyre_rollout_reward_errors", "Trajectories whose verifier reached no verdict"),
    "timeline_switches": ("gyre_rollout_timeline_switches", "Weight loads from another learner timeline (a rewind)"),
    "groups_dropped_on_switch": ("gyre_rollout_groups_dropped_on_switch",
                                 "Groups in generation cancelled because their weights' timeline died"),
    "env_calls_abandoned": ("gyre_rollout_env_calls_abandoned",
                            "Blocking environment calls abandoned at an episode's time budget"),
    "env_calls_refused": ("gyre_rollout_env_calls_refused",
                          "Environment calls refused while max_stuck_calls abandoned ones still ran"),
}


class RolloutMetrics:
    """Prometheus metrics of one rollout service, from ``RolloutStats.as_dict(version)`` (rollout/worker.py).

    A custom collector: each scrape serves the latest stats dict, pulled from ``source`` at scrape time
    when given (e.g. ``lambda: worker.stats.as_dict(engine.version)``; ``RolloutStats`` and ``Spool`` are
    safe to read from the scrape thread) or else the one last passed to ``observe``.

    Besides the ``as_dict`` keys the dict may carry ``groups_in_flight`` (generation tasks running),
    ``learner_version`` (→ ``gyre_rollout_policy_lag``) and ``reward_errors`` (a running count).
    ``rollout_queue_length`` counts ``groups_in_flight`` as 0 when the dict does not carry it.

    Args:
        run_id, service: label values (``service``: the rollout id, e.g. ``rollout-0``).
        source: optional ``() -> dict`` called at every scrape.
        clock: unix seconds; ages the oldest spool entry between ``observe`` and the scrape.

    Raises:
        ValueError: empty ``run_id`` or ``service``.
    """

    def __init__(self, run_id: str, service: str = "rollout", source: Callable[[], dict] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        _check_labels(run_id, service)
        self.labels = [service, run_id]
        self.source, self._clock = source, clock
        self._lock = threading.Lock()
        self._stats: dict[str, float] | None = None
        self._observed_at = 0.0
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def observe(self, stats: dict) -> None:
        """Keep ``stats`` for the next scrape.

        Raises:
            ValueError: not a dict, a required ``as_dict`` key missing, or a value not a number.
        """
        if not isinstance(stats, dict):
            raise ValueError(f"expected RolloutStats.as_dict(version) (a dict); got {stats!r:.200}")
        missing = [k for k in _ROLLOUT_REQUIRED if k not in stats]
        if missing:
            raise ValueError(f"rollout stats lack {missing}; expected the keys of RolloutStats.as_dict: "
                             f"{list(_ROLLOUT_REQUIRED)}")
        known = {*_ROLLOUT_GAUGES, *_ROLLOUT_COUNTERS, "learner_version", "spool_oldest_age_s"}
        values = {k: _number(k, v) for k, v in stats.items() if k in known and v is not None}
        with self._lock:
            self._stats, self._observed_at = values, self._clock()

    def collect(self):
        """Prometheus collector protocol: the families of the latest stats (none before the first)."""
        if self.source is not None:
            self.observe(self.source())
        with self._lock:
            stats, observed_at = self._stats, self._observed_at
        if stats is None:
            return
        for key, (name, doc) in _ROLLOUT_GAUGES.items():
            if key in stats:
                yield self._family(GaugeMetricFamily, name, doc, stats[key])
        for key, (name, doc) in _ROLLOUT_COUNTERS.items():
            if key in stats:
                yield self._family(CounterMetricFamily, name, doc, stats[key])
        if "learner_version" in stats:
            yield self._family(GaugeMetricFamily, "gyre_rollout_policy_lag", "Learner version minus the "
                               "version this rollout generates with", stats["learner_version"] - stats["version"])
        queue = stats.get("groups_in_flight", 0.0) + stats.get("spool_pending_groups", 0.0)
        yield self._family(GaugeMetricFamily, "rollout_queue_length", "Groups generating plus groups spooled "
                           "and not yet acked by replay", queue)
        if "spool_pending_groups" in stats:
            age = 0.0
            if stats["spool_pending_groups"] > 0:  # the same oldest entry, aged since the observation
                age = stats.get("spool_oldest_age_s", 0.0) + max(self._clock() - observed_at, 0.0)
            yield self._family(GaugeMetricFamily, "gyre_rollout_spool_oldest_pending_age_seconds",
                               "Age of the oldest spooled group replay has not acked", age)
            yield self._family(GaugeMetricFamily, "runtime_state_age_seconds", "Seconds since the service's "
                               "state was last made durable (rollout: oldest unacked spool entry)", age)

    def _family(self, cls, name: str, doc: str, value: float):
        family = cls(name, doc, labels=LABELS)
        family.add_metric(self.labels, value)
        return family


class ReplayStateCollector:
    """``runtime_state_age_seconds{service="replay"}`` from ``buffer.info()["last_snapshot_age_s"]``
    (absent while it is negative: no snapshot yet). Registered next to ``ReplayCollector`` by
    ``services.replay.metrics.replay_registry``."""

    def __init__(self, buffer, run_id: str, service: str = "replay") -> None:
        _check_labels(run_id, service)
        self.buffer, self.labels = buffer, [service, run_id]

    def collect(self):
        age = float(self.buffer.info().get("last_snapshot_age_s", -1))
        if age >= 0:
            family = GaugeMetricFamily("runtime_state_age_seconds", "Seconds since the service's state was last "
                                       "made durable (replay: newest snapshot; the WAL covers the rest)",
                                       labels=LABELS)
            family.add_metric(self.labels, age)
            yield family


_SERVERS: dict[int, object] = {}


def serve(registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0) -> int:
    """Serve ``registry`` as Prometheus text on ``http://host:port/metrics`` from a daemon thread;
    ``port`` 0 picks a free port. Returns the bound port (``stop(port)`` shuts it down).

    Raises:
        ValueError: ``port`` not in ``0..65535``.
        OSError: the address cannot be bound.
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"metrics port must be an int in 0..65535 (0 = any free port); got {port!r}")
    server, _thread = start_http_server(port, addr=host, registry=registry)
    bound = server.server_port
    _SERVERS[bound] = server
    return bound


def stop(port: int) -> None:
    """Shut down the server ``serve`` returned ``port`` for. Raises ``KeyError`` for an unknown port."""
    if port not in _SERVERS:
        raise KeyError(f"no metrics server started by serve() on port {port}; have {sorted(_SERVERS)}")
    server = _SERVERS.pop(port)
    server.shutdown()
    server.server_close()
