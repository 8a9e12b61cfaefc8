"""How the client runs one RPC: its deadline, retries of UNAVAILABLE with backoff, and for a
mutating call the request id and commit deadline it carries and the verdict it waits for.

A mixin of `KVCacheClient` (its state lives on the client, set by `_init_call_policy`); see
`cache_service.client.sdk`'s docstring for the contract with the server.
"""

from __future__ import annotations

import itertools
import random
import secrets
import time
from collections.abc import Callable
from typing import Any

import grpc

from cache_service.client.arguments import micros
from cache_service.client.errors import DeadlineExceededError, UnavailableError, error_from_rpc
from cache_service.errors import DEADLINE_VERDICT

__all__ = ["CallPolicy"]


class CallPolicy:
    """Deadlines, retries and verdicts of the client's RPCs."""

    timeout_s: float
    _attempts: int
    _grace: float
    _metadata: tuple[tuple[str, str], ...]

    def _init_call_policy(
        self, timeout_s: float, max_attempts: int, deadline_grace_s: float, token: str | None
    ) -> None:
        """Set the default deadline (seconds), the attempts of a retryable call, the grace
        a mutating call waits for its verdict (seconds) and the bearer token's metadata."""
        self.timeout_s = float(timeout_s)
        self._attempts = int(max_attempts)
        self._grace = float(deadline_grace_s)
        # Request ids: this client's random prefix and a counter (unique per tenant).
        self._id_prefix = secrets.token_hex(8)
        self._id_counter = itertools.count(1)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()

    def _call(
        self,
        method: Callable[..., Any],
        request: Any,
        *,
        timeout_s: float | None,
        retry: bool,
    ) -> Any:
        """Run one RPC with a deadline; retry UNAVAILABLE with backoff when `retry`."""
        budget = self.timeout_s if timeout_s is None else float(timeout_s)
        deadline = time.monotonic() + budget
        attempt = 0
        while True:
            attempt += 1
            remaining = deadline - time.monotonic()
            try:
                return method(request, timeout=max(remaining, 0.001), metadata=self._metadata)
            except grpc.RpcError as exc:
                error = error_from_rpc(exc)
                if not (retry and isinstance(error, UnavailableError) and attempt < self._attempts):
                    raise error from None
                # Exponential backoff with jitter, never past the deadline.
                pause = min(0.05 * 2 ** (attempt - 1), 1.0) * (0.5 + random.random() / 2)
                if time.monotonic() + pause >= deadline:
                    raise error from None
                time.sleep(pause)

    def new_request_id(self) -> str:
        """A fresh request id (this client's random prefix and a counter)."""
        return f"{self._id_prefix}-{next(self._id_counter)}"

    def _mutate(
        self,
        method: Callable[..., Any],
        build: Callable[[str, int], Any],
        *,
        timeout_s: float | None,
        request_id: str | None,
        retry_unavailable: bool = False,
    ) -> Any:
        """Run one mutating RPC: `build(request_id, timeout_us)` makes its request. The
        gRPC deadline is the commit deadline plus the grace; a DEADLINE_EXCEEDED that is not
        the server's verdict asks for it (`_verdict`). retry_unavailable: retry UNAVAILABLE
        with the same request id (calls idempotent even across a restart: creates)."""
        budget = self.timeout_s if timeout_s is None else float(timeout_s)
        rid = request_id or self.new_request_id()
        deadline = time.monotonic() + budget
        attempt = 0
        while True:
            attempt += 1
            remaining = max(deadline - time.monotonic(), 1e-6)
            request = build(rid, micros(remaining))
            try:
                return method(request, timeout=remaining + self._grace, metadata=self._metadata)
            except grpc.RpcError as exc:
                error = error_from_rpc(exc)
            if isinstance(error, DeadlineExceededError) and DEADLINE_VERDICT not in error.message:
                return self._verdict(method, build(rid, 1), rid)
            if not (
                retry_unavailable
                and isinstance(error, UnavailableError)
                and attempt < self._attempts
            ):
                raise error from None
            pause = min(0.05 * 2 ** (attempt - 1), 1.0) * (0.5 + random.random() / 2)
            if time.monotonic() + pause >= deadline:
                raise error from None
            time.sleep(pause)

    def _verdict(self, method: Callable[..., Any], request: Any, request_id: str) -> Any:
        """The outcome of a mutating call that got no verdict in time: ask again with its
        request id and a passed deadline; the server answers the first call's outcome (or
        DEADLINE_EXCEEDED for one it never saw), never applying it twice.

        Raises:
            UnavailableError: no answer in `max_attempts` tries of `deadline_grace_s` each
                (the outcome is unknown: retry with the same request_id).
        """
        for _ in range(self._attempts):
            try:
                return method(request, timeout=self._grace, metadata=self._metadata)
            except grpc.RpcError as exc:
                error = error_from_rpc(exc)
            if not isinstance(error, DeadlineExceededError | UnavailableError) or (
                DEADLINE_VERDICT in error.message
            ):
                raise error from None
        raise UnavailableError(
            grpc.StatusCode.UNAVAILABLE,
            f"no verdict from the server for request_id {request_id!r} within the deadline "
            "and its grace: the call may or may not have been applied; retry it with the "
            "same request_id to find out (it is never applied twice)",
        )
