"""Round batching: a call's work for one worker (`Part`) and the batcher that coalesces the
parts of concurrent calls into one worker round (`Batcher`).

The coordinator hands each single-worker part to the batcher of its (layer, worker, query
heads); the batcher decides when a batch leaves and runs it with the coordinator's round
runner (`cache_service.engine.rounds`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import torch

from cache_service.engine.attention_plan import AttentionPlan, SequenceViewLike
from cache_service.engine.eager_tasks import start_eagerly
from cache_service.engine.steps import Step
from cache_service.engine.worker_interface import AttentionResult

__all__ = ["Batcher", "Part"]


@dataclass
class Part:
    """One call's work for one group of workers on one layer.

    layer: the layer it writes and attends over.
    views / num_queries / seq_ids: per sequence of the call in this part, in order.
    query: the rows of all those sequences, concatenated, pool dtype.
    writes: worker -> (slots, key, value) of new tokens (pool dtype).
    """

    views: list[SequenceViewLike]
    num_queries: list[int]
    seq_ids: list[str]
    query: torch.Tensor
    writes: dict[str, tuple[list[int], torch.Tensor, torch.Tensor]]
    return_lse: bool
    layer: int = 0
    # The kernel plan of exactly these views and query rows, when known (a recorded
    # step's); Rounds.run_parts fills it in when it plans this part alone.
    plan: AttentionPlan | None = None
    # Host memory for the part's output (the caller's shared-memory slot): the worker's
    # when the part runs alone (run_attention's `out`), else the round's rows are copied
    # there once it is back.
    out: torch.Tensor | None = None
    # The recorded step the part repeats (its views, slots and plan are the step's).
    step: Step | None = None
    # The client connection the call came on (call_origin), for the batcher; None: none
    # named (the batcher then goes by the first sequence).
    origin: int | None = None
    # False: nobody has checked query / writes for NaN and infinities yet (the stacked
    # short path leaves that to the worker's device; see Rounds.run_parts).
    finite_checked: bool = True
    future: asyncio.Future[AttentionResult] = field(init=False)


# Adaptive window (see Batcher): weight of the newest batch in the estimate of how often
# batches are shared, and the estimate at or above which a lone part waits for the window.
_SHARED_WEIGHT = 0.5
_SHARED_THRESHOLD = 0.25
# Batches whose callers the next batch expects (see Batcher).
_RECENT_BATCHES = 4


class Batcher:
    """Coalesces parts for one (layer, worker, num_q_heads) into one worker call (for one
    (worker, num_q_heads) and every layer with CoordinatorConfig.coalesce_layers).

    A batch leaves when its window (opened by its first part) has passed and the previous
    batch of this key has come back, or at once when it holds `max_items` sequences. Under
    load, calls that arrive while a batch is on the worker gather into the next one instead
    of queueing behind it one by one.

    The window is adaptive. A batch counts as shared when one of its parts arrived while
    another part was gathering or a batch was on the worker; `_shared` is a moving estimate
    of how often recent batches were (each batch weighs `_SHARED_WEIGHT`). A part that finds
    nothing gathering and nothing in flight while that estimate is below
    `_SHARED_THRESHOLD` is a lone caller: its batch leaves at once instead of waiting for a
    window nobody would use. Otherwise it opens the window as above. One shared batch
    brings the window back; two or three unshared ones in a row drop it again.

    A window also ends early once everyone is there. The batcher knows its callers (a
    part's caller is the client connection it came on, `call_origin`, else the first
    sequence it names) and how many parts each sent in its last batch, and expects the
    callers of its last `_RECENT_BATCHES` batches. Once every expected caller has that many
    parts pending, the batch leaves as soon as nothing is in flight. Clients that call in
    step (a model's layers, one call each per round) then wait for each other, not for the
    clock, and groups of them that drifted apart merge again: a group's batch waits for the
    others, who come as soon as they had their replies. A client alternating between
    batches of sequences is one caller with one part per round; threads sharing one
    connection are one caller with several. A batch that waited its whole window stops
    expecting the callers it missed that were not in the batch before it either (out of
    step, or gone), so a caller that leaves holds the others for two windows at most.
    A batch whose window passed while the batch before it was on the worker waits one more
    window when that batch's callers are expected: they come straight back with their next
    parts, and one worker call serves everyone instead of groups that drifted apart taking
    turns (a straggling group of one or two costs a whole worker call for little).

    With `overlap` (four parts or more expected) the callers in step take turns in two
    groups instead, so that one group's batch is on the worker while the coordinator takes
    in the other's parts: a batch leaves, with nothing in flight, once it holds half the
    parts expected; with one batch in flight, once every expected caller not in that batch
    has its parts pending. For a worker in another process: with one batch for everyone,
    the coordinator idles while the batch is on the worker and the worker idles while the
    coordinator takes in the next parts; two groups keep both busy, for the price of one
    more worker call per round of every caller (its fixed cost, which would have to
    outweigh the coordinator's work on all the parts to make one batch better).

    call_later: the timer (delay in seconds, callback) -> handle with ``cancel()``; default
    the running loop's ``call_later`` (tests pass a fake clock).
    """

    def __init__(
        self,
        key: tuple[int | None, str, int],
        window_s: float,
        max_items: int,
        run: Callable[[tuple[int | None, str, int], list[Part]], Coroutine[Any, Any, None]],
        call_later: Callable[[float, Callable[[], None]], Any] | None = None,
        overlap: bool = False,
    ) -> None:
        self._key = key
        self._window_s = window_s
        self._max_items = max_items
        self._run = run
        self._call_later = call_later
        self._overlap = overlap
        self._pending: list[Part] = []
        self._items = 0
        self._timer: Any = None
        self._due = False  # the pending batch's window has passed
        self._in_flight = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._shared = 0.0  # moving estimate: how often recent batches were shared
        self._contended = False  # a part arrived while another was gathering / in flight
        # Callers of recent batches: caller -> (number of the last batch it was in, its
        # parts there); the parts the next batch expects of each, in all; the pending
        # parts of each caller; how many expected callers have all their parts pending
        # (see the class docstring).
        self._batches_sent = 0
        self._last_seen: dict[str | int, tuple[int, int]] = {}
        self._expected: dict[str | int, int] = {}
        self._expected_parts = 0
        self._pending_counts: dict[str | int, int] = {}
        self._satisfied = 0
        # The callers of each batch in flight; whether the pending batch's window was
        # extended once already for callers coming back from the worker.
        self._flying: dict[asyncio.Task[None], frozenset[str | int]] = {}
        self._extended = False

    @property
    def windowed(self) -> bool:
        """Whether a part arriving at an idle batcher waits for the window (recent batches
        were shared) rather than leaving at once."""
        return self._shared >= _SHARED_THRESHOLD

    def submit(self, part: Part) -> None:
        idle = not self._pending and self._in_flight == 0
        if not idle:
            self._contended = True
        self._pending.append(part)
        self._items += len(part.seq_ids)
        caller = caller_of(part)
        count = self._pending_counts.get(caller, 0) + 1
        self._pending_counts[caller] = count
        if count == self._expected.get(caller):
            self._satisfied += 1
        if self._items >= self._max_items or (idle and not self.windowed):
            self._flush()
        elif self._in_flight == 0 and self._everyone_here():
            self._flush()
        elif self._group_ready():
            self._flush()
        elif self._timer is None and not self._due:
            self._start_window()

    def _everyone_here(self) -> bool:
        """Every caller expected has its parts pending (two or more parts expected)."""
        return self._expected_parts > 1 and self._satisfied == len(self._expected)

    def _group_ready(self) -> bool:
        """With `overlap`: whether the pending batch is a group that should leave now (see
        the class docstring); needs four or more parts expected."""
        if not self._overlap or not self._pending or self._expected_parts < 4:
            return False
        if self._in_flight == 0:
            return 2 * len(self._pending) >= self._expected_parts
        if self._in_flight > 1:
            return False
        (flying,) = self._flying.values()
        counts, expected = self._pending_counts, self._expected
        waiting_for = [c for c in expected if c not in flying]
        return bool(waiting_for) and all(counts.get(c, 0) >= expected[c] for c in waiting_for)

    def _start_window(self) -> None:
        if self._call_later is not None:
            self._timer = self._call_later(self._window_s, self._window_passed)
        elif self._window_s > 0:
            self._timer = asyncio.get_running_loop().call_later(self._window_s, self._window_passed)
        else:
            # Still merges what arrives in the same event-loop turn.
            self._timer = asyncio.get_running_loop().call_soon(self._window_passed)

    def _window_passed(self) -> None:
        self._timer = None
        self._due = True
        if self._in_flight == 0:
            self._flush()

    def _flush(self) -> None:
        """Send the pending parts as one batch."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        waited_window, self._due = self._due, False
        self._extended = False
        parts, self._pending, self._items = self._pending, [], 0
        counts, self._pending_counts = self._pending_counts, {}
        self._satisfied = 0
        if not parts:
            return
        self._expect_after(counts, waited_window)
        # The sample of the batch that leaves now: were other parts arriving while it
        # gathered, or while the batch before it was on the worker?
        sample = 1.0 if self._contended else 0.0
        self._contended = False
        self._shared += _SHARED_WEIGHT * (sample - self._shared)
        self._in_flight += 1
        task = start_eagerly(self._run(self._key, parts))
        self._tasks.add(task)
        self._flying[task] = frozenset(counts)
        task.add_done_callback(self._batch_done)

    def _expect_after(self, counts: dict[str | int, int], waited_window: bool) -> None:
        """Update the expected callers once a batch left with `counts` parts of each caller
        (see the class docstring); `waited_window`: it left because its window passed."""
        self._batches_sent += 1
        number = self._batches_sent
        for caller, parts in counts.items():
            self._last_seen[caller] = (number, parts)
        # After a whole window, the absent callers of the batch before this one are still
        # in step (they had their reply later); those absent longer are not.
        oldest = number - 1 if waited_window else number - _RECENT_BATCHES + 1
        self._last_seen = {c: seen for c, seen in self._last_seen.items() if seen[0] >= oldest}
        self._expected = {c: parts for c, (_, parts) in self._last_seen.items()}
        self._expected_parts = sum(self._expected.values())

    def _batch_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        returning = self._flying.pop(task, frozenset())
        self._in_flight -= 1
        if self._in_flight != 0:
            if self._group_ready():
                self._flush()
            return
        if self._everyone_here() or self._group_ready():
            self._flush()
        elif self._due:
            if not self._extended and any(c in self._expected for c in returning):
                # Its window passed while the worker was busy, and the callers just answered
                # are expected: they come straight back, so wait one more window for them
                # (one worker call for all instead of two groups taking turns).
                self._extended = True
                self._due = False
                self._start_window()
            else:
                self._flush()


def caller_of(part: Part) -> str | int:
    """Who sent `part`, for the batcher: its client connection where the call named one,
    else the first sequence it names (a client's batch of sequences travels together from
    step to step)."""
    if part.origin is not None:
        return part.origin
    return part.seq_ids[0] if part.seq_ids else id(part)
