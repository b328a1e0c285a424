"""Reading a shard's Prometheus metrics: the one reader `atoll up`, `atoll status`,
`atoll chaos --kubernetes`, the benches and the tests share."""

from __future__ import annotations

import urllib.request
from typing import NamedTuple

from prometheus_client.parser import text_string_to_metric_families


class Sample(NamedTuple):
    """One exposed sample: its name (with _total, _bucket ... as exposed), labels, value."""

    name: str
    labels: dict[str, str]
    value: float


def read_metrics(address: str, timeout: float) -> list[Sample]:
    """Every sample of `http://ADDRESS/metrics` (ADDRESS is host:port).

    Raises OSError (unreachable, timed out) or ValueError (not Prometheus text)."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout) as r:
        text = r.read().decode()
    return [
        Sample(s.name, dict(s.labels), float(s.value))
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]
