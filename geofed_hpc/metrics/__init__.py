"""One metrics recorder and the one list of metric names (JSONL and W&B; Prometheus later)."""

from geofed_hpc.metrics.recorder import METRIC_HELP, METRIC_NAMES, Recorder, read_jsonl

__all__ = ["METRIC_HELP", "METRIC_NAMES", "Recorder", "read_jsonl"]
