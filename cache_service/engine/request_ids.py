"""Idempotent calls: the outcomes of recent request ids, so a retry is never applied twice.

A client gives each mutating call a `request_id` (kvcache.proto, "Deadlines and request
ids"). The servicer runs a call with one through `RequestLedger`: the first call of an id
runs; a retry while it runs waits for it and answers its outcome; a retry after it
committed answers its reply without running again; a retry after it answered
DEADLINE_EXCEEDED answers DEADLINE_EXCEEDED again (so a duplicate arriving late never
applies); after any other failure (which changed nothing) the id is forgotten and a retry
runs afresh.

Bounded: ids are kept for `ttl_s` and at most `max_ids` of them (the oldest go first);
replies are kept up to `max_reply_bytes` in all, beyond which the oldest replies are
dropped but their "applied" mark stays (a retry then gets ALREADY_EXISTS). Lookups and
records are O(1) dict operations; expiry pops from the old end of an OrderedDict. Not thread-safe: the servicer uses it from the event loop only.

Creates need no ledger: their sequence id is derived from the request id
(`request_seq_id`), which the write-ahead log already keeps durable.

Pure: no gRPC, torch or Ray imports.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from cache_service.errors import DEADLINE_VERDICT, AlreadyApplied, DeadlinePassed, InvalidRequest

__all__ = [
    "DEFAULT_MAX_IDS",
    "DEFAULT_MAX_REPLY_BYTES",
    "DEFAULT_TTL_S",
    "MAX_REQUEST_ID_BYTES",
    "RequestLedger",
    "check_request_id",
    "request_seq_id",
]

MAX_REQUEST_ID_BYTES = 128
DEFAULT_TTL_S = 600.0
DEFAULT_MAX_IDS = 65536
DEFAULT_MAX_REPLY_BYTES = 64 << 20

_T = TypeVar("_T")

# Entry states.
_RUNNING, _APPLIED, _DEADLINE = 0, 1, 2


class _Entry:
    __slots__ = ("at", "deadline", "reply", "size", "state", "waiters")

    def __init__(self, at: float, deadline: float) -> None:
        self.at = at
        self.deadline = deadline  # the running call's commit deadline (0.0: none)
        self.state = _RUNNING
        self.reply: Any = None
        self.size = 0
        self.waiters: list[asyncio.Future[None]] | None = None


def check_request_id(request_id: str) -> str:
    """`request_id` if it is acceptable (at most MAX_REQUEST_ID_BYTES bytes of UTF-8).

    Raises:
        InvalidRequest: it is longer.
    """
    if len(request_id) > MAX_REQUEST_ID_BYTES // 4 and (
        len(request_id.encode()) > MAX_REQUEST_ID_BYTES
    ):
        raise InvalidRequest(
            f"request_id is {len(request_id.encode())} bytes; at most "
            f"{MAX_REQUEST_ID_BYTES} are accepted"
        )
    return request_id


def request_seq_id(tenant: str, request_id: str) -> str:
    """The id of the sequence an idempotent create (or fork) of `tenant` makes: a digest of
    (tenant, request_id), 22 URL-safe characters like a random one, so equal request ids of
    two tenants never meet."""
    digest = hashlib.sha256(f"{tenant}\0{request_id}".encode()).digest()
    return base64.urlsafe_b64encode(digest[:16]).decode().rstrip("=")


class RequestLedger:
    """Recent request ids per tenant and their outcomes.

    Args:
        ttl_s: seconds an id is remembered after its call started.
        max_ids: ids remembered at once, over all tenants.
        max_reply_bytes: bytes of kept replies (bytes replies count their length, other
            replies a nominal 64), over all tenants.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(
        self,
        ttl_s: float = DEFAULT_TTL_S,
        max_ids: int = DEFAULT_MAX_IDS,
        max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ttl = ttl_s
        self._max_ids = max_ids
        self._max_bytes = max_reply_bytes
        self._clock = clock
        # OrderedDicts, not dicts: taking the oldest item of a plain dict again and again
        # walks over the slots deleted before it (O(n) each time until it resizes).
        self._entries: OrderedDict[tuple[str, str], _Entry] = OrderedDict()
        # Keys of entries holding a reply, oldest first -> the reply's bytes.
        self._with_reply: OrderedDict[tuple[str, str], int] = OrderedDict()
        self._reply_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    async def run(
        self,
        tenant: str,
        request_id: str,
        call: Callable[[], Awaitable[_T]],
        deadline: float = 0.0,
    ) -> _T:
        """Run `call` once for (tenant, request_id); a repeat gets the first outcome.

        Args:
            deadline: the call's commit deadline (monotonic seconds, 0.0: none); a new id
                whose deadline has already passed is refused (and remembered) without
                running `call`.

        Returns:
            `call`'s result, or the kept result of the id's first call.

        A repeat while the first call runs waits for its outcome, or answers
        DEADLINE_EXCEEDED as soon as the first call's commit deadline has passed (it can no
        longer commit).

        Raises:
            DeadlinePassed: this id's call answered DEADLINE_EXCEEDED (now or before), or
                cannot commit any more.
            AlreadyApplied: the id's call was applied and its reply is no longer kept.
            whatever `call` raises (the id is then forgotten, except for DeadlinePassed).
        """
        key = (tenant, request_id)
        entry = self._entries.get(key)
        while entry is not None and entry.state == _RUNNING:
            remaining = None
            if entry.deadline:
                remaining = entry.deadline - self._clock()
                if remaining < 0:
                    # The first call checks this very deadline right before it commits (and
                    # nothing awaits in between): past it, it can no longer commit.
                    raise DeadlinePassed(_late(request_id))
            waiter = asyncio.get_running_loop().create_future()
            if entry.waiters is None:
                entry.waiters = []
            entry.waiters.append(waiter)
            await asyncio.wait((waiter,), timeout=remaining)
            entry = self._entries.get(key)  # forgotten after a failure: run afresh
        if entry is not None:
            return self._replay(request_id, entry)
        entry = self.begin(key, deadline)
        if deadline and self._clock() > deadline:
            late = DeadlinePassed(_late(request_id))
            self.finish(key, entry, late)
            raise late
        try:
            reply = await call()
        except BaseException as exc:
            self.finish(key, entry, exc)
            raise
        self.finish(key, entry, reply)
        return reply

    async def run_held(
        self, key: tuple[str, str], entry: _Entry, call: Callable[[], Awaitable[_T]]
    ) -> _T:
        """Run `call` for an id whose record `begin` made, and finish the record."""
        try:
            reply = await call()
        except BaseException as exc:
            self.finish(key, entry, exc)
            raise
        self.finish(key, entry, reply)
        return reply

    def replay(self, tenant: str, request_id: str) -> tuple[bool, Any]:
        """Without waiting: (True, reply) for an id whose call was applied; raises as
        `run` does for one that answered DEADLINE_EXCEEDED or lost its reply; (False,
        None) for an unknown id or one still running (then use `run`)."""
        entry = self._entries.get((tenant, request_id))
        if entry is None or entry.state == _RUNNING:
            return False, None
        return True, self._replay(request_id, entry)

    def known(self, tenant: str, request_id: str) -> bool:
        """Whether the id has an entry (running or finished)."""
        return (tenant, request_id) in self._entries

    def begin(self, key: tuple[str, str], deadline: float = 0.0) -> _Entry:
        """Record a new id's call as running (the caller checked it is unknown); deadline:
        its commit deadline (monotonic seconds, 0.0: none)."""
        if self._entries:
            self._expire()
        entry = _Entry(self._clock(), deadline)
        self._entries[key] = entry
        return entry

    def finish(self, key: tuple[str, str], entry: _Entry, outcome: Any) -> None:
        """The call of `entry` ended with `outcome`: its reply, or the exception it raised
        (DeadlinePassed is remembered, any other error forgets the id). Wakes waiters."""
        if isinstance(outcome, BaseException):
            if isinstance(outcome, DeadlinePassed):
                entry.state = _DEADLINE
            elif self._entries.get(key) is entry:
                del self._entries[key]
        else:
            entry.state = _APPLIED
            entry.reply = outcome
            size = len(outcome) if type(outcome) is bytes else 64
            entry.size = size
            self._with_reply[key] = size
            self._reply_bytes += size
            if self._reply_bytes > self._max_bytes:
                self._trim_replies()
        waiters = entry.waiters
        if waiters is not None:
            entry.waiters = None
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)

    def _replay(self, request_id: str, entry: _Entry) -> Any:
        if entry.state == _DEADLINE:
            raise DeadlinePassed(_late(request_id))
        if entry.reply is None:
            raise AlreadyApplied(
                f"request_id {request_id!r} was applied by an earlier call whose reply is no "
                "longer kept; nothing was applied again (its tokens are written: Attend gives "
                "the output again)"
            )
        return entry.reply

    def _expire(self) -> None:
        """Forget finished ids older than the TTL, and the oldest beyond max_ids. A call
        still running at the old end stops the sweep (it goes once it has finished and
        aged): its waiters need its entry."""
        entries = self._entries
        horizon = self._clock() - self._ttl
        while entries:
            key = next(iter(entries))
            entry = entries[key]
            if entry.state == _RUNNING or (entry.at >= horizon and len(entries) < self._max_ids):
                break
            del entries[key]
            self._drop_reply(key, entry)

    def _trim_replies(self) -> None:
        """Drop the oldest kept replies until they fit max_reply_bytes (the ids stay)."""
        while self._reply_bytes > self._max_bytes and self._with_reply:
            key = next(iter(self._with_reply))
            entry = self._entries.get(key)
            if entry is not None:
                self._drop_reply(key, entry)
            else:
                self._reply_bytes -= self._with_reply.pop(key)

    def _drop_reply(self, key: tuple[str, str], entry: _Entry) -> None:
        self._reply_bytes -= self._with_reply.pop(key, 0)
        entry.reply = None
        entry.size = 0


def _late(request_id: str) -> str:
    return f"the deadline of request_id {request_id!r} {DEADLINE_VERDICT}"
