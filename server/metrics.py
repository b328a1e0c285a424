"""A shard's Prometheus metrics (docs/design.md §3: observability).

Each shard owns its own registry, so several shards in one process (tests, `atoll
bench`) never share counters. The shard records events as they happen; versions,
open-round sizes and live learners are read from the shard at scrape time, so they
are never stale.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import NamedTuple

import prometheus_client as prom

# Latency buckets from 50 µs (page-cache fsync) to 10 s (a slow disk under load).
_SECONDS = (
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    2.5e-2,
    5e-2,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    10.0,
)
_COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128)
_STALENESS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32)


class FragmentGauges(NamedTuple):
    version: int
    open_round: int  # contributions in the open round
    outer_steps_per_period: float | None  # None until two closes a known cadence apart


class ScrapeGauges(NamedTuple):
    fragments: dict[int, FragmentGauges]
    live: int  # learners whose lease is current
    grace: float  # seconds
    cadence: float | None  # the sync period learners keep, seconds
    owned: int = 0  # fragments this shard owns
    moving: int = 0  # of them, frozen for a move away
    map_version: int = 0  # the fragment map version this shard knows


Gauges = Callable[[], ScrapeGauges]


class ShardMetrics:
    """Counters and histograms of one shard, plus gauges read at scrape time."""

    def __init__(self, shard_index: int, gauges: Gauges | None = None):
        self.registry = prom.CollectorRegistry()
        self._gauges = gauges
        r = self.registry
        self.pushes = prom.Counter(
            "atoll_pushes",
            "Pushes answered, by decision reason "
            "(fresh, stale_discounted, duplicate, too_stale, already_in_round)",
            ["reason"],
            registry=r,
        )
        self.parts_dropped = prom.Counter(
            "atoll_push_parts_dropped",
            "Pushes in parts dropped before every part came in, none of them merged, by "
            "reason (expired: waited past --part-wait-leases; superseded: a newer push of "
            "the learner came; refused: judged at its last part and refused)",
            ["reason"],
            registry=r,
        )
        self.refused = prom.Counter(
            "atoll_refused_calls",
            "Calls refused with a gRPC status, by method and status code",
            ["method", "code"],
            registry=r,
        )
        self.staleness = prom.Histogram(
            "atoll_push_staleness",
            "Versions between a push's base and the fragment's version when it arrived",
            buckets=_STALENESS,
            registry=r,
        )
        self.round_size = prom.Histogram(
            "atoll_round_size",
            "Learners merged into each closed round",
            buckets=_COUNTS,
            registry=r,
        )
        self.compute_seconds = prom.Counter(
            "atoll_accepted_compute_seconds",
            "Learner compute carried by accepted pushes: inner steps x "
            "step seconds / fragments, so the sum over shards is learner-seconds of training that reach "
            "the global model (divide its rate by provisioned learners for goodput)",
            registry=r,
        )
        self.rounds = prom.Counter("atoll_rounds", "Rounds closed (outer steps taken)", registry=r)
        self.bytes_in = prom.Counter(
            "atoll_received_bytes", "Payload bytes received in pushes and inits", registry=r
        )
        self.bytes_out = prom.Counter("atoll_sent_bytes", "Payload bytes sent in pulls", registry=r)
        self.merge_seconds = prom.Histogram(
            "atoll_merge_seconds",
            "Closing a round: merge, outer step and publishing the delta",
            buckets=_SECONDS,
            registry=r,
        )
        self.fsync_seconds = prom.Histogram(
            "atoll_wal_fsync_seconds",
            "fsync of the write-ahead log before an acknowledgement",
            buckets=_SECONDS,
            registry=r,
        )
        self.push_seconds = prom.Histogram(
            "atoll_push_seconds",
            "Handling one push after its bytes arrived: decode, judge, log, merge",
            buckets=_SECONDS,
            registry=r,
        )
        self.snapshot_seconds = prom.Histogram(
            "atoll_snapshot_seconds", "Writing one snapshot", buckets=_SECONDS, registry=r
        )
        self._declare_moves(r)
        info = prom.Info("atoll_shard", "Which shard this is", registry=r)
        info.info({"shard_index": str(shard_index)})
        if gauges is not None:
            r.register(_ScrapeTime(gauges))

    def _declare_moves(self, r: prom.CollectorRegistry) -> None:
        """The metrics of fragments moved in and out (docs/resharding.md)."""
        self.moves = prom.Counter(
            "atoll_fragment_moves",
            "Fragments moved between shards: out (committed here) or in (adopted here)",
            ["direction"],
            registry=r,
        )
        self.moved_bytes = prom.Counter(
            "atoll_fragment_moved_bytes",
            "Bytes of fragment state moved: out (exported) or in (adopted)",
            ["direction"],
            registry=r,
        )
        self.frozen_seconds = prom.Histogram(
            "atoll_fragment_frozen_seconds",
            "How long a fragment being moved took no pushes: from its freeze to its commit "
            "(or unfreeze) on this shard",
            buckets=_SECONDS,
            registry=r,
        )

    def serve(self, port: int, host: str) -> int:
        """Serves /metrics over HTTP; returns the bound port (port 0 picks one)."""
        self._httpd, _ = prom.start_http_server(port, addr=host, registry=self.registry)
        return self._httpd.server_address[1]

    def stop(self) -> None:
        httpd = getattr(self, "_httpd", None)
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()

    def text(self) -> str:
        """The exposition text, as a scrape would see it."""
        return prom.generate_latest(self.registry).decode()


class _ScrapeTime:
    """Gauges computed from the shard's state when Prometheus scrapes."""

    def __init__(self, gauges: Gauges):
        self.gauges = gauges

    def describe(self) -> list[prom.metrics_core.Metric]:
        return []

    def collect(self) -> Iterator[prom.metrics_core.Metric]:
        g = self.gauges()
        version = prom.metrics_core.GaugeMetricFamily(
            "atoll_fragment_version", "Global version of each fragment", labels=["fragment"]
        )
        open_round = prom.metrics_core.GaugeMetricFamily(
            "atoll_open_round_size", "Learners in each fragment's open round", labels=["fragment"]
        )
        per_period = prom.metrics_core.GaugeMetricFamily(
            "atoll_outer_steps_per_period",
            "Outer steps each fragment took per sync period since the "
            "shard started (1 = one merge per period)",
            labels=["fragment"],
        )
        for p, f in sorted(g.fragments.items()):
            version.add_metric([str(p)], f.version)
            open_round.add_metric([str(p)], f.open_round)
            if f.outer_steps_per_period is not None:
                per_period.add_metric([str(p)], f.outer_steps_per_period)
        yield version
        yield open_round
        yield per_period
        live, grace = g.live, g.grace
        yield prom.metrics_core.GaugeMetricFamily(
            "atoll_live_learners", "Learners whose lease is current", value=live
        )
        yield prom.metrics_core.GaugeMetricFamily(
            "atoll_grace_window_seconds",
            "The grace window a round waits after its first push",
            value=grace,
        )
        for name, doc, value in (
            ("atoll_fragments_owned", "Fragments this shard owns", g.owned),
            ("atoll_fragments_moving", "Fragments frozen here for a move away", g.moving),
            (
                "atoll_fragment_map_version",
                "The fragment map version this shard knows",
                g.map_version,
            ),
        ):
            yield prom.metrics_core.GaugeMetricFamily(name, doc, value=value)
        if g.cadence is not None:
            yield prom.metrics_core.GaugeMetricFamily(
                "atoll_cadence_seconds",
                "The sync period learners are asked to keep: H steps of the fastest live learners",
                value=g.cadence,
            )
