"""Prometheus `/metrics` for the parameter server: the recorder's metric names, per site, plus RPC stats."""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from geofed_hpc.errors import UnavailableError
from geofed_hpc.log import logger
from geofed_hpc.metrics.recorder import METRIC_HELP

PREFIX = "geofed_"
RPC_REQUESTS = PREFIX + "rpc_requests_total"
RPC_LATENCY = PREFIX + "rpc_latency_seconds"


def prom_name(metric: str) -> str:
    """`sync/bytes_sent` -> `geofed_sync_bytes_sent` (the same name, in Prometheus' alphabet)."""
    return PREFIX + re.sub(r"[^a-zA-Z0-9_]", "_", metric)


class PrometheusExporter:
    """Gauges for every numeric metric name (label `site`), RPC counters and latencies, on its own registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._gauges = {
            name: Gauge(prom_name(name), help_text, ["site"], registry=self.registry)
            for name, help_text in METRIC_HELP.items()
        }
        self._requests = Counter(
            RPC_REQUESTS, "RPCs handled by the parameter server", ["method", "code"], registry=self.registry
        )
        self._latency = Histogram(
            RPC_LATENCY,
            "RPC handling time in seconds",
            ["method"],
            registry=self.registry,
            buckets=(0.001, 0.005, 0.02, 0.1, 0.5, 2.0, 10.0, 60.0, 300.0),
        )
        self._server: Any = None
        self._lock = threading.Lock()
        self.port = 0

    def names(self) -> list[str]:
        """Every metric family this exporter serves."""
        return sorted([prom_name(n) for n in self._gauges] + [RPC_REQUESTS, RPC_LATENCY])

    def observe(self, site: str, metrics: Mapping[str, Any]) -> None:
        """Set the gauges of the numeric metrics we know; other keys are ignored."""
        with self._lock:
            for key, value in metrics.items():
                gauge = self._gauges.get(key)
                if gauge is not None and isinstance(value, (int, float)) and not isinstance(value, bool):
                    gauge.labels(site=site).set(float(value))

    def rpc(self, method: str, code: str, seconds: float) -> None:
        self._requests.labels(method=method, code=code).inc()
        self._latency.labels(method=method).observe(seconds)

    def serve(self, host: str, port: int) -> int:
        """Serve `/metrics` on host:port (0 picks a free port); a port in use is a clear error."""
        try:
            self._server, _thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise UnavailableError(
                f"cannot serve Prometheus metrics on {host}:{port} ({exc.strerror}): the port is in use or not "
                "local; choose another with ps.metrics_port=..."
            ) from None
        self.port = int(self._server.server_port)
        logger.info("Prometheus metrics on http://%s:%d/metrics", host, self.port)
        return self.port

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
