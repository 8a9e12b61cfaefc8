"""`python -m cache_service.health_probe`: exit 0 when the coordinator's gRPC health service
reports SERVING, 1 otherwise (container HEALTHCHECK, Kubernetes exec probes, scripts).

Uses the standard grpc.health.v1 service, so it checks the server that answers the API,
not just that a process exists.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

__all__ = ["check", "main"]


def check(address: str, service: str = "", timeout_s: float = 3.0) -> str:
    """Ask `address` ("host:port", plaintext) for the health of `service` ("" = the server).

    Returns the status name ("SERVING", "NOT_SERVING", ...); raises grpc.RpcError when the
    server cannot be reached or does not know the service.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry; returns the process exit code (0 healthy, 1 not)."""
    parser = argparse.ArgumentParser(
        prog="python -m cache_service.health_probe", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--address", default="127.0.0.1:50051", help="gRPC host:port")
    parser.add_argument("--service", default="", help='service name ("" = whole server)')
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait")
    args = parser.parse_args(argv)
    if args.timeout <= 0:
        parser.error("--timeout must be > 0 seconds")
    try:
        status = check(args.address, args.service, args.timeout)
    except grpc.RpcError as exc:
        print(f"unhealthy: {args.address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    print(f"{args.address} {args.service or '(server)'}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
