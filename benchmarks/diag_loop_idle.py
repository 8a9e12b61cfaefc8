"""Why the coordinator's event loop sits idle while clients wait (a diagnostic).

Runs `bench_service.py` with the given arguments (e.g. the H200's Ray row, concurrency
only: ``--h200 --no-in-process --transports local-shm --phases concurrent``) with probes in
the server's process: every blocking wait of the event loop in its selector is an idle
stretch, and each is put down to what the loop was waiting for when it began, from the
state the probes keep:

- clients in the server: local-session connections whose request arrived (``data_received``)
  and whose reply is not yet written (``_write``); the others are in their own turn;
- worker calls in flight: worker-channel requests written (``exchange``) without a reply;
- open windows: batchers (``coordinator._Batcher``) holding parts with a timer running;
  held parts: parts pending in a batcher that waits for its batch in flight to return;
- online correctness checks running (``CorrectnessChecker.check``).

Printed per run (the number of clients connected tells them apart): the run's wall time
between its first and last call, the loop's idle share, the idle time by cause, how many
clients were in the server at the start of each idle stretch and where (in a batch in
flight, pending in a batcher, elsewhere: the batchers' own bookkeeping, the steadier
figure), and the worker channel's calls from request written to reply in.

    PYTHONPATH=.:benchmarks python3 benchmarks/diag_loop_idle.py --h200 \\
        --no-in-process --transports local-shm --phases concurrent
"""

from __future__ import annotations

import selectors
import sys
import threading
import time
from collections import Counter, defaultdict
from typing import Any

import bench_service

import cache_service.coordinator as coordinator
import cache_service.correctness_check as correctness_check
import cache_service.local_sessions as local_sessions
import cache_service.worker_channel as worker_channel

# Idle stretches shorter than this are the selector's own cost, not a wait.
_MIN_IDLE_S = 5e-6


class _State:
    """What the loop waits for, kept by the probes (all on the loop's thread)."""

    def __init__(self) -> None:
        self.connected: set[int] = set()
        self.in_server: set[int] = set()
        self.worker_calls = 0
        self.batchers: list[Any] = []
        # by number of clients connected: [first call, last reply] perf_counter seconds
        self.span: dict[int, list[float]] = {}
        # by clients connected: cause -> idle seconds; clients in server -> idle seconds
        self.idle: dict[int, Counter[str]] = defaultdict(Counter)
        self.idle_by_inside: dict[int, Counter[int]] = defaultdict(Counter)
        self.calls: Counter[int] = Counter()
        self.checks = 0  # correctness checks running
        self.sent: dict[int, float] = {}  # worker-channel connection -> request written at
        self.flying_at_send: dict[int, int] = {}  # connection -> calls in flight once sent
        # by clients connected: (worker stretch seconds, calls in flight when it was sent)
        self.stretches: dict[int, list[tuple[float, int]]] = defaultdict(list)
        # by clients connected: idle seconds by (clients flying, pending, elsewhere)
        self.where: dict[int, Counter[tuple[int, int, int]]] = defaultdict(Counter)

    def cause(self) -> str:
        """What an idle stretch beginning now waits for."""
        windows = sum(1 for b in self.batchers if b._timer is not None and b._pending)
        held = sum(len(b._pending) for b in self.batchers if b._in_flight and b._timer is None)
        parts = []
        if self.worker_calls:
            parts.append("worker")
        if windows:
            parts.append("window")
        if held:
            parts.append("held behind a batch in flight")
        if self.checks:
            parts.append("correctness check")
        if not parts:
            parts.append("clients" if not self.in_server else "other (timers, Ray, metrics)")
        return " + ".join(parts)

    def placement(self) -> tuple[int, int, int]:
        """Clients in the server: (in a batch in flight, pending in a batcher, elsewhere)."""
        flying: set[Any] = set()
        pending: set[Any] = set()
        for b in self.batchers:
            for callers in b._flying.values():
                flying.update(callers)
            pending.update(b._pending_counts)
        inside = len(self.in_server)
        f, p = len(flying), len(pending - flying)
        return f, p, max(inside - f - p, 0)

    def observe_idle(
        self, began: float, ended: float, cause: str, inside: int, where: tuple[int, int, int]
    ) -> None:
        n = len(self.connected)
        if n == 0 or n not in self.span:
            return
        self.idle[n][cause] += ended - began
        self.idle_by_inside[n][inside] += ended - began
        self.where[n][where] += ended - began

    def worker_sent(self, conn: int) -> None:
        self.worker_calls += 1
        self.sent[conn] = time.perf_counter()
        self.flying_at_send[conn] = self.worker_calls

    def worker_answered(self, conn: int) -> None:
        self.worker_calls = max(self.worker_calls - 1, 0)
        began = self.sent.pop(conn, None)
        flying = self.flying_at_send.pop(conn, 1)
        if began is not None and self.connected:
            self.stretches[len(self.connected)].append((time.perf_counter() - began, flying))

    def arrived(self, conn: int) -> None:
        self.in_server.add(conn)
        now = time.perf_counter()
        n = len(self.connected)
        self.span.setdefault(n, [now, now])
        self.calls[n] += 1

    def replied(self, conn: int) -> None:
        self.in_server.discard(conn)
        n = len(self.connected)
        if n in self.span:
            self.span[n][1] = time.perf_counter()

    def report(self) -> str:
        lines = []
        for n in sorted(self.span):
            first, last = self.span[n]
            wall = last - first
            idle = sum(self.idle[n].values())
            if wall <= 0 or self.calls[n] < 100:
                continue
            lines.append(
                f"\n### {n} client(s) connected: {self.calls[n]} calls in {wall:.2f} s, "
                f"loop idle {idle / wall:.1%} ({idle / self.calls[n] * 1e6:.1f} us a call)\n"
            )
            lines.append("| waiting for | idle share of the run | us a call |")
            lines.append("| --- | ---: | ---: |")
            for cause, seconds in self.idle[n].most_common():
                lines.append(
                    f"| {cause} | {seconds / wall:.1%} | {seconds / self.calls[n] * 1e6:.1f} |"
                )
            lines.append("\n| clients in the server when idle began | idle share of the run |")
            lines.append("| ---: | ---: |")
            for inside, seconds in sorted(self.idle_by_inside[n].items()):
                lines.append(f"| {inside} | {seconds / wall:.1%} |")
            lines.append(
                "\n| clients when idle began: in a batch in flight, pending, elsewhere "
                "| idle share of the run |"
            )
            lines.append("| --- | ---: |")
            for where, seconds in self.where[n].most_common(8):
                lines.append(f"| {where} | {seconds / wall:.1%} |")
            stretches = self.stretches[n][len(self.stretches[n]) // 4 :]
            for flying in (1, 2, 3):
                times = sorted(t for t, f in stretches if f == flying)
                if len(times) < 10:
                    continue
                q = [times[int(len(times) * x)] * 1e6 for x in (0.1, 0.5, 0.9)]
                lines.append(
                    f"\nworker channel calls sent with {flying} in flight: {len(times)}, "
                    f"request written -> reply in p10 / p50 / p90 {q[0]:.0f} / {q[1]:.0f} / "
                    f"{q[2]:.0f} us"
                )
        return "\n".join(lines)


def _install(state: _State) -> None:
    loop_thread: list[int] = []

    def wrap(cls: type, name: str, before: Any = None, after: Any = None) -> None:
        original = getattr(cls, name)

        def probed(self: Any, *args: Any, **kwargs: Any) -> Any:
            if before is not None:
                before(self)
            result = original(self, *args, **kwargs)
            if after is not None:
                after(self)
            return result

        setattr(cls, name, probed)

    session = local_sessions._Connection
    wrap(session, "connection_made", after=lambda c: state.connected.add(id(c)))
    wrap(session, "connection_lost", after=lambda c: state.connected.discard(id(c)))
    wrap(session, "data_received", before=lambda c: state.arrived(id(c)))
    wrap(session, "_write", after=lambda c: state.replied(id(c)))

    wrap(worker_channel._Connection, "exchange", after=lambda c: state.worker_sent(id(c)))
    wrap(worker_channel._Connection, "_deliver", before=lambda c: state.worker_answered(id(c)))
    wrap(coordinator._Batcher, "__init__", after=state.batchers.append)

    check = correctness_check.CorrectnessChecker.check

    async def counted_check(self: Any, *args: Any, **kwargs: Any) -> Any:
        state.checks += 1
        try:
            return await check(self, *args, **kwargs)
        finally:
            state.checks -= 1

    correctness_check.CorrectnessChecker.check = counted_check  # type: ignore[method-assign]

    original_select = selectors.EpollSelector.select

    def select(self: Any, timeout: float | None = None) -> Any:
        if not loop_thread or threading.get_ident() != loop_thread[0]:
            return original_select(self, timeout)
        cause, inside, where = state.cause(), len(state.in_server), state.placement()
        began = time.perf_counter()
        events = original_select(self, timeout)
        ended = time.perf_counter()
        if ended - began >= _MIN_IDLE_S:
            state.observe_idle(began, ended, cause, inside, where)
        return events

    selectors.EpollSelector.select = select  # type: ignore[method-assign]

    # The loop's thread is the one that accepts the first local session.
    def first_connection(_: Any) -> None:
        if not loop_thread:
            loop_thread.append(threading.get_ident())

    wrap(session, "connection_made", before=first_connection)


def main() -> int:
    state = _State()
    _install(state)
    code = bench_service.main(sys.argv[1:])
    print("\n## Where the coordinator's loop sat idle (diag_loop_idle.py)")
    print(state.report())
    return code


if __name__ == "__main__":
    sys.exit(main())
