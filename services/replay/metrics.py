"""Prometheus metrics of a replay buffer, read from ``buffer.info()`` at scrape time.

A custom collector instead of gauges the servicer would have to keep updating: every scrape sees the
buffer's current counters, and nothing runs between scrapes. Names are ``gyre_replay_*``:
size (pooled/stored groups, trajectories, bytes), inserts/s and samples/s, lease counts, WAL bytes and
fsyncs, last snapshot age, WAL failed (0/1), rate-limiter diff, and the staleness-at-sample histogram.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from gyre.services.common.observability import ReplayStateCollector

_GAUGES = {
    "size_groups": "Groups in the pool (sampleable)",
    "size_trajectories": "Trajectories in the pool (sampleable)",
    "stored_groups": "Groups stored (pooled + leased + excluded)",
    "stored_trajectories": "Trajectories stored (pooled + leased + excluded)",
    "stored_bytes": "Arrow bytes of the stored trajectories",
    "leased_groups": "Groups currently leased",
    "active_leases": "Sample leases outstanding",
    "excluded_groups": "Groups kept but excluded as too stale",
    "prompts_leased": "Prompt leases outstanding",
    "work_budget_left": "Groups the fleet may still lease (work budget - ready - leased; -1: no budget)",
    "dropped_stale_fraction": "Trajectories dropped as too stale / trajectories inserted",
    "learner_version": "Highest learner policy version seen",
    "inserts_per_s": "Accepted trajectories per second (10 s window)",
    "samples_per_s": "Sampled groups per second (10 s window)",
    "rl_diff": "Rate limiter diff: samples_per_insert * inserted - sampled",
    "wal_segments": "WAL segment files on disk",
    "last_snapshot_age_s": "Seconds since the newest snapshot (-1: none)",
    "insert_latency_p50_s": "Median seconds from an insert's receipt to its durable answer (last 4096)",
    "insert_latency_p99_s": "99th percentile seconds from an insert's receipt to its durable answer (last 4096)",
    "lease_prompts_latency_p50_s": "Median seconds a LeasePrompts call took (last 4096)",
    "lease_prompts_latency_p99_s": "99th percentile seconds a LeasePrompts call took (last 4096)",
}
_COUNTERS = {
    "inserted_total": "Trajectories accepted", "duplicates_total": "Trajectories refused as duplicates",
    "dropped_stale_total": "Trajectories dropped as too stale", "sampled_groups_total": "Groups leased",
    "acked_groups_total": "Groups acknowledged", "evicted_groups_total": "Groups evicted for capacity",
    "expired_groups_total": "Groups returned by expired leases", "wal_bytes": "Bytes appended to the WAL",
    "wal_fsyncs": "WAL fsync calls", "snapshots_written": "Snapshots committed",
}


class ReplayCollector:
    """Prometheus collector over a ``TrajectoryBuffer`` (anything with ``info() -> dict``)."""

    def __init__(self, buffer) -> None:
        self.buffer = buffer

    def collect(self):
        info = self.buffer.info()
        for key, doc in _GAUGES.items():
            if key in info:
                yield GaugeMetricFamily(f"gyre_replay_{key}", doc, value=float(info[key]))
        for key, doc in _COUNTERS.items():
            if key in info:
                yield CounterMetricFamily(f"gyre_replay_{key}", doc, value=float(info[key]))
        durability = getattr(self.buffer, "durability", None)
        if durability is not None:
            failed = float(durability.failure is not None)
            yield GaugeMetricFamily("gyre_replay_wal_failed", "1 once the WAL failed (disk full, I/O error): "
                                    "the service is NOT_SERVING until restarted", value=failed)
        lags = sorted(info.get("staleness_at_sample", {}).items())
        buckets, total = [], 0
        for lag, n in lags:
            total += n
            buckets.append((str(float(lag)), total))
        buckets.append(("+Inf", total))
        yield HistogramMetricFamily("gyre_replay_staleness_at_sample", "Policy lag of groups when sampled",
                                    buckets=buckets, sum_value=float(sum(lag * n for lag, n in lags)))


def registry_for(buffer) -> CollectorRegistry:
    """A fresh registry holding only the replay collector."""
    registry = CollectorRegistry()
    registry.register(ReplayCollector(buffer))
    return registry


def replay_registry(buffer, run_id: str, service: str = "replay") -> CollectorRegistry:
    """``registry_for(buffer)`` plus ``services.common.observability.ReplayStateCollector``
    (``runtime_state_age_seconds`` labelled ``service`` and ``run_id``): what ``ReplayActor`` serves."""
    registry = registry_for(buffer)
    registry.register(ReplayStateCollector(buffer, run_id, service))
    return registry


def serve_metrics(buffer, port: int, host: str = "127.0.0.1") -> int:
    """Expose ``/metrics`` over HTTP on ``host:port`` (0 = free port); returns the bound port."""
    server, _ = start_http_server(port, addr=host, registry=registry_for(buffer))
    return server.server_port
