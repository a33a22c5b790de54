"""A controller's metrics over HTTP (prometheus_client), for a Prometheus to scrape.

The families are made from the record after each look (:mod:`k3launch.render.controller_metrics`)
and served from memory; a scrape never waits for a look. The address is the inventory's
``monitoring.listen`` (default ``127.0.0.1:0``: this machine only, any free port); the bound
address is recorded in the record's ``supervisor.metrics`` so the deployment's target file names
it. A wildcard address (``0.0.0.0``) is recorded as this machine's host name.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from k3launch.errors import K3Error

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from k3launch.render.controller_metrics import Family


class Exporter:
    def __init__(self, listen: str) -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        host, _, port = listen.rpartition(":")
        self._lock = threading.Lock()
        self._families: list[Family] = []
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)  # a collector is anything with collect()
        try:
            self._server, self._thread = start_http_server(int(port), host, registry)
        except OSError as exc:
            raise K3Error("metrics-listen", f"cannot serve metrics on {listen}: {exc.strerror or exc}",
                          "set monitoring.listen in the inventory to a free ADDRESS:PORT of this machine (port 0: any free one)") from None
        bound = self._server.server_port
        shown = socket.gethostname() if host in ("0.0.0.0", "::", "") else host
        self.address = f"[{shown}]:{bound}" if ":" in shown else f"{shown}:{bound}"

    def update(self, families: Iterable[Family]) -> None:
        with self._lock:
            self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        with self._lock:
            families = list(self._families)
        for f in families:
            names = sorted({k for labels, _ in f.samples for k in labels})
            metric = (CounterMetricFamily if f.kind == "counter" else GaugeMetricFamily)(f.name, f.help, labels=names)
            for labels, value in f.samples:
                metric.add_metric([labels.get(n, "") for n in names], value)
            yield metric

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
