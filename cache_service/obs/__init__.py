"""Observability: Prometheus metrics of the service, read from the control plane's own
accounting, the event loop's saturation, and per-RPC timing."""
