"""Observability: Prometheus metrics, engine gauges and the events Flower shows."""
