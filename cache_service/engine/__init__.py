"""The coordinator and what it runs on: attention planning, per-step plans, sequence locks,
online correctness checks, the write-ahead store and recovery, and the worker interface with
its two implementations. Raises domain errors; only `cache_service.api` maps them to gRPC."""
