"""A trace's maps served as Prometheus metrics (``ksim trace --prometheus HOST:PORT``).

As ebpf_exporter serves eBPF maps, with the official client library
(prometheus-client, the ``fleet`` extra): a custom Collector reads the latest
snapshot of every host's maps (published by the hosts' sessions about once a
second while they run, and once more at the end) and turns each map into one
metric family, each key into one sample:

    map kind        metric                                         samples
    count           counter   ksim_trace_NAME_total                one per key
    sum, int,       gauge     ksim_trace_NAME                      one per key
    min, max
    avg, stats      summary   ksim_trace_NAME_sum, _count          the total and the count
    hist, lhist     histogram ksim_trace_NAME_bucket{le=...},      cumulative buckets,
                              _sum, _count                         the samples' count

The metric's name is ``ksim_trace`` and the map's name without its ``@`` (``@`` alone is
``ksim_trace``), other characters than letters, digits and ``_`` as ``_``.  Labels:
``host`` (the fleet's label of the host: ``HOST:PORT`` of a live target, else the
target's spec) and one per part of the key, ``key0``, ``key1``, ... (bpftrace's keys
are positional), holding what the key prints as.  Maps whose values are not numbers
(strings, names) are not served.

A histogram's ``le`` of a bucket is its largest integer (bpftrace's buckets hold
integers: ``[4, 8)`` is ``le="7"``); the last bucket is ``+Inf``.  bpftrace's hist()
and lhist() keep counts only, not the samples' total: ``_sum`` is the sum over the
buckets of each bucket's smallest value times its count (the underflow bucket's
largest), a lower bound of the samples' total when none is negative.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from typing import Any

from .maps import HIST_BUCKETS, decode_extreme, scalar, signed
from .output import hist_rows, lhist_rows

PREFIX = "ksim_trace"


def metric_name(map_name: str) -> str:
    rest = re.sub(r"[^A-Za-z0-9_]", "_", map_name.lstrip("@"))
    return f"{PREFIX}_{rest}" if rest else PREFIX


def buckets(kind: str, values: list[int], lhist: tuple[int, int, int] | None
            ) -> tuple[list[tuple[str, float]], float, int]:
    """(cumulative (le, count) buckets ending with +Inf, _sum, _count) of a histogram's
    bucket words: every bucket of an lhist; a hist's from its first (negative) bucket
    to its largest, so that a series' buckets stay the same from scrape to scrape."""
    if kind == "lhist":
        assert lhist is not None
        lo, hi, step = lhist
        n = (hi - lo) // step + 2
        rows = lhist_rows([1] * n, lo, hi, step)
    else:
        n = HIST_BUCKETS
        rows = hist_rows([1] * n)
    out: list[tuple[str, float]] = []
    total = 0.0
    running = 0
    for i, (_, bounds, _) in enumerate(rows):
        count = values[i]
        running += count
        low = bounds.get("min", bounds.get("max", 0))
        total += low * count
        le = "+Inf" if i == len(rows) - 1 else str(bounds["max"])
        out.append((le, float(running)))
    return out, total, running


class MapCollector:
    """The Collector: every host's latest maps, as metric families (module doc)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        #: host label -> map name -> MapSnapshot
        self.latest: dict[str, dict[str, Any]] = {}

    def publish(self, host: str, snaps: dict[str, Any]) -> None:
        with self.lock:
            self.latest[host] = snaps

    def forget(self, host: str) -> None:
        with self.lock:
            self.latest.pop(host, None)

    def describe(self) -> list[Any]:
        return []       # the maps are known once a host attached: no check at register

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            Metric,
            SummaryMetricFamily,
        )

        with self.lock:
            latest = {h: dict(s) for h, s in self.latest.items()}
        names = sorted({n for snaps in latest.values() for n in snaps})
        for name in names:
            per_host = [(h, snaps[name]) for h, snaps in sorted(latest.items()) if name in snaps]
            first = per_host[0][1]
            kind = first.kind
            if kind is None or first.decoded:
                continue
            labels = [f"key{i}" for i in range(len(first.keys or ()))] + ["host"]
            metric = metric_name(name)
            doc = f"bpftrace map {name} ({'stats' if first.stats else kind})"
            family: Any
            if kind == "count":
                family = CounterMetricFamily(metric, doc, labels=labels)
            elif kind in ("hist", "lhist"):
                family = Metric(metric, doc, "histogram")
            elif kind == "avg":
                family = SummaryMetricFamily(metric, doc, labels=labels)
            else:
                family = GaugeMetricFamily(metric, doc, labels=labels)
            for host, snap in per_host:
                for key, values in sorted(snap.entries.items(), key=lambda kv: str(kv[0])):
                    if isinstance(values, str):
                        continue
                    label_values = [str(p) for p in key] + [host]
                    if kind in ("hist", "lhist"):
                        _histogram(family, dict(zip(labels, label_values, strict=True)),
                                   *buckets(kind, values, snap.lhist))
                    elif kind == "avg":
                        family.add_metric(label_values, count_value=values[1],
                                          sum_value=signed(values[0]))
                    elif kind in ("min", "max"):
                        family.add_metric(label_values, decode_extreme(kind, values[0]))
                    else:
                        family.add_metric(label_values, scalar(kind, values))
            yield family


def _histogram(family: Any, labels: dict[str, str], bks: list[tuple[str, float]],
               total: float, count: int) -> None:
    """A histogram's samples, ``_count`` and ``_sum`` included also when a bucket's
    ``le`` is negative (HistogramMetricFamily leaves both out then: bpftrace's hist()
    always has a bucket below 0, ``le="-1"``)."""
    for le, n in bks:
        family.add_sample(family.name + "_bucket", {**labels, "le": le}, n)
    family.add_sample(family.name + "_count", labels, float(count))
    family.add_sample(family.name + "_sum", labels, total)


class Exporter:
    """An HTTP endpoint serving a MapCollector's metrics (``/metrics``, and any path),
    from a registry of its own (not the process's default one)."""

    def __init__(self, address: str) -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        host, _, port = address.rpartition(":")
        self.collector = MapCollector()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)     # type: ignore[arg-type]
        self.server, self.thread = start_http_server(int(port), addr=host.strip("[]") or "0.0.0.0",
                                                     registry=self.registry)

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.server.server_address[:2]
        return str(host), int(port)

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://{host}:{port}/metrics"

    def publish(self, host: str, snaps: dict[str, Any]) -> None:
        self.collector.publish(host, snaps)

    def forget(self, host: str) -> None:
        self.collector.forget(host)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> Exporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def parse_address(text: str) -> str:
    """``HOST:PORT`` (PORT 0: any free port), as argparse's type."""
    import argparse

    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"expecting HOST:PORT, not {text!r}")
    return text


__all__ = ["Exporter", "MapCollector", "buckets", "metric_name", "parse_address"]
