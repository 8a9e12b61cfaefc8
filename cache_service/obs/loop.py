"""How saturated the coordinator's event loop is: its thread's CPU time and its lag.

The coordinator runs on one asyncio event loop, one thread: every call's control-plane
work (decoding, block tables, batching, replies) is Python on that thread, so the loop's
busy share is the service's headroom (docs/deploy.md, "The coordinator's capacity").

- :class:`LoopCPUCollector` exports the loop thread's CPU seconds as a counter read at
  scrape time from the thread's CPU clock (no cost on the request path); its rate is the
  loop's busy share, 0..1.
- :func:`probe_loop_lag` wakes up periodically and reports how much later than asked it
  woke: the time a callback that became ready waited behind the loop's other work.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["LoopCPUCollector", "current_thread_cpu_clock", "probe_loop_lag"]

log = logging.getLogger(__name__)


def current_thread_cpu_clock() -> int | None:
    """The CPU-time clock id of the calling thread, or None where the platform has no
    per-thread CPU clocks. (Only the calling thread: asking for another thread's clock by
    an id that names no live thread is undefined behaviour in pthreads.)"""
    getter = getattr(time, "pthread_getcpuclockid", None)
    if getter is None:
        return None
    return getter(threading.get_ident())


class LoopCPUCollector(Collector):
    """``<prefix>_event_loop_cpu_seconds_total``: CPU seconds the event loop's thread has
    used since it started, read at scrape time.

    Args:
        prefix: metric name prefix, e.g. "kvcache".
        clock_id: the thread's CPU clock (:func:`current_thread_cpu_clock`, on it).

    Once the thread has ended its clock can no longer be read: the series is then left out
    of the scrape (logged once) and the other metrics are served as before.
    """

    def __init__(self, prefix: str, clock_id: int) -> None:
        self._name = f"{prefix}_event_loop_cpu_seconds"
        self._clock_id = clock_id
        self._warned = False

    def collect(self) -> Iterator[Metric]:
        try:
            seconds = time.clock_gettime(self._clock_id)
        except OSError as exc:
            if not self._warned:
                self._warned = True
                log.warning("event loop CPU clock unreadable (its thread ended?): %s", exc)
            return
        family = CounterMetricFamily(
            self._name,
            "CPU seconds used by the coordinator's event-loop thread; its rate is the loop's "
            "busy share (0..1), the coordinator's saturation.",
        )
        family.add_metric([], seconds)
        yield family

    def describe(self) -> Iterator[Metric]:
        yield CounterMetricFamily(self._name, "")


async def probe_loop_lag(observe: Callable[[float], None], interval_s: float) -> None:
    """Forever (until cancelled): sleep `interval_s` seconds on the running loop and pass
    `observe` how much later than that the probe ran again, seconds (>= 0).

    Raises:
        ValueError: `interval_s` is not a positive number.
    """
    if (
        isinstance(interval_s, bool)
        or not isinstance(interval_s, int | float)
        or not math.isfinite(interval_s)
        or interval_s <= 0
    ):
        raise ValueError(f"interval_s must be a positive number of seconds, got {interval_s!r}")
    loop = asyncio.get_running_loop()
    while True:
        asked = loop.time() + interval_s
        await asyncio.sleep(interval_s)
        observe(max(loop.time() - asked, 0.0))
