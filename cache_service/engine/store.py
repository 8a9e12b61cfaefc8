"""The coordinator's write-ahead metadata store: a command log with checkpoints, in SQLite.

What is stored:
- `log`: one row per mutating control-plane call that succeeded (create_sequence, fork,
  free, prepare_write, commit_write, pin, unpin, publish_public, add_worker, lose_worker),
  with its arguments and its result as JSON, numbered by a log sequence number (lsn). The
  row is committed before the RPC that caused it is acknowledged.
- `checkpoint`: the latest snapshot of the whole control plane (the block manager's
  records), the lsn it covers and the worker epochs known then. Writing one deletes the
  log rows it covers, so the file stays bounded.
- `meta`: the schema version, the control-plane config fingerprint, and the coordinator
  generation, incremented each time a coordinator opens the store: a fence that lets
  workers and clients refuse calls from a stale coordinator.

Recovery (cache_service/engine/recovery.py) = the checkpoint + replay of the log rows after it.

Durability settings. The database runs in WAL mode (a commit is one sequential append to
the -wal file; readers never block the writer) with synchronous=FULL by default: every
commit fsyncs the WAL before returning. NORMAL would survive a crash of the coordinator
process (the failure our tests inject) but may roll back the last commits on a power loss
or kernel crash. That is not acceptable here: the workers' pools (on other hosts, detached
actors) outlive the coordinator's host, so a log rolled back past an acknowledged `free`
followed by an acknowledged write into the reused block would make the recovered
coordinator attribute another sequence's KV to the freed one, which is exactly what the
service must never do. The cost is one fsync per acknowledged mutation (group several
mutations into one transaction with `MetadataStore.transaction()` to share it).

One writer at a time: the connection uses locking_mode=EXCLUSIVE and takes the write lock
when it opens, so a second coordinator on the same file fails with StoreLockedError
instead of interleaving its log with ours. The operating system drops the lock when the
process dies, so a restarted coordinator can open the file at once.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "Checkpoint",
    "LogRecord",
    "MetadataStore",
    "StoreConfig",
    "StoreCorruptError",
    "StoreError",
    "StoreLockedError",
]

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS log (
    lsn        INTEGER PRIMARY KEY AUTOINCREMENT,
    generation INTEGER NOT NULL,
    op         TEXT NOT NULL,
    args       TEXT NOT NULL,
    result     TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS checkpoint (
    id            INTEGER PRIMARY KEY CHECK (id = 1),
    lsn           INTEGER NOT NULL,
    generation    INTEGER NOT NULL,
    state         TEXT NOT NULL,
    worker_epochs TEXT NOT NULL
);
"""


class StoreError(RuntimeError):
    """The metadata store cannot do what was asked; the message says what and why."""


class StoreLockedError(StoreError):
    """Another process (another coordinator) holds the store open for writing."""


class StoreCorruptError(StoreError):
    """The file is not a store this code can read, or its contents contradict each other."""


@dataclass(frozen=True)
class StoreConfig:
    """Where and how the store keeps its file.

    path: the SQLite file (its -wal and -shm companions sit beside it).
    synchronous: "FULL" (default; fsync per commit, survives power loss) or "NORMAL"
        (survives a process crash only); see the module docstring for why FULL.
    checkpoint_every: log rows after which the owner should write a checkpoint (advice
        read by the recording wrapper; the store itself never checkpoints on its own).
    busy_timeout_s: how long opening waits for another process's lock before failing.
    """

    path: str
    synchronous: Literal["FULL", "NORMAL"] = "FULL"
    checkpoint_every: int = 1000
    busy_timeout_s: float = 2.0

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("StoreConfig.path must name a file")
        if self.synchronous not in ("FULL", "NORMAL"):
            raise ValueError(
                f"StoreConfig.synchronous must be 'FULL' or 'NORMAL', got {self.synchronous!r}"
            )
        if self.checkpoint_every < 1:
            raise ValueError(
                f"StoreConfig.checkpoint_every must be >= 1, got {self.checkpoint_every}"
            )
        if self.busy_timeout_s < 0:
            raise ValueError(f"StoreConfig.busy_timeout_s must be >= 0, got {self.busy_timeout_s}")


@dataclass(frozen=True)
class LogRecord:
    """One logged mutation. args and result are JSON values (dicts, lists, str, int...)."""

    lsn: int
    generation: int
    op: str
    args: Any
    result: Any


@dataclass(frozen=True)
class Checkpoint:
    """The control-plane snapshot covering every log row with lsn <= `lsn`.

    state: the block manager's records (JSON value); worker_epochs: worker id -> epoch.
    """

    lsn: int
    generation: int
    state: Any
    worker_epochs: dict[str, Any]


def _dumps(value: Any) -> str:
    # Compact and key-sorted: equal values give equal text, so results can be compared as
    # stored, and token-id lists stay small.
    return json.dumps(value, separators=(",", ":"), sort_keys=True, allow_nan=False)


class MetadataStore:
    """A single-writer SQLite command log with one checkpoint slot.

    Not thread-safe by design beyond a lock that serialises calls: the coordinator calls it
    from its event loop between control-plane calls, which are themselves serial.
    """

    def __init__(self, config: StoreConfig) -> None:
        """Open (creating if absent) the store at config.path and take the writer lock."""
        self.config = config
        path = Path(config.path)
        if path.exists() and not path.is_file():
            raise StoreError(f"store path {config.path!r} exists and is not a file")
        if not path.exists():
            # The log holds tenants' token ids (their prompts): owner-only from the start.
            # SQLite gives the -wal and -shm files the database file's permissions.
            try:
                os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            except FileExistsError:
                pass
            except OSError as exc:
                raise StoreError(f"cannot create store {config.path!r}: {exc.strerror}") from None
        try:
            self._db = sqlite3.connect(
                config.path,
                timeout=config.busy_timeout_s,
                isolation_level=None,  # explicit BEGIN/COMMIT only
                check_same_thread=False,
            )
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open store {config.path!r}: {exc}") from None
        # Re-entrant: writes inside transaction() run on the thread that holds it.
        self._lock = threading.RLock()
        self._in_tx = False
        # A deferred (group-commit) transaction is open: appends with defer=True join it
        # and flush() commits it.
        self._deferred = 0
        self._generation: int | None = None
        try:
            self._db.execute("PRAGMA locking_mode=EXCLUSIVE")
            mode = self._db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise StoreError(f"store {config.path!r}: cannot switch to WAL mode ({mode})")
            self._db.execute(f"PRAGMA synchronous={config.synchronous}")
            # The first write transaction takes the exclusive lock and, in EXCLUSIVE
            # locking mode, keeps it until close.
            self._db.executescript("BEGIN IMMEDIATE;" + _SCHEMA + "COMMIT;")
        except sqlite3.OperationalError as exc:
            self._db.close()
            if "locked" in str(exc) or "busy" in str(exc):
                raise StoreLockedError(
                    f"store {config.path!r} is held by another process (another coordinator?)"
                ) from None
            raise StoreError(f"cannot initialise store {config.path!r}: {exc}") from None
        except sqlite3.DatabaseError as exc:
            self._db.close()
            raise StoreCorruptError(f"{config.path!r} is not a readable store: {exc}") from None
        version = self._meta("schema_version")
        if version is None:
            self._set_meta_autocommit("schema_version", str(SCHEMA_VERSION))
        elif version != str(SCHEMA_VERSION):
            self._db.close()
            raise StoreCorruptError(
                f"store {config.path!r} has schema version {version}; this code reads "
                f"{SCHEMA_VERSION}"
            )

    # ------------------------------------------------------------------ plumbing

    def close(self) -> None:
        """Close the file and release the writer lock.

        Deferred appends not yet flushed are dropped (they were never acknowledged).
        """
        with self._lock:
            self._db.close()

    def __enter__(self) -> MetadataStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _meta(self, key: str) -> str | None:
        with self._lock:
            row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def _set_meta_autocommit(self, key: str, value: str) -> None:
        self._db.execute(
            "INSERT INTO meta(key, value) VALUES(?, ?) "
            "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
            (key, value),
        )

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """Group several writes into one commit (one fsync). Nested use joins the outer one,
        and so does use while deferred appends are pending (they commit at flush()).

        On an exception inside the block nothing of it is kept.
        """
        with self._lock:
            if self._in_tx:
                yield
                return
            self._db.execute("BEGIN IMMEDIATE")
            self._in_tx = True
            try:
                yield
            except BaseException:
                self._in_tx = False
                self._deferred = 0
                self._db.execute("ROLLBACK")
                raise
            self._in_tx = False
            # Deferred appends made inside the block are committed with it.
            self._deferred = 0
            try:
                self._db.execute("COMMIT")
            except sqlite3.Error as exc:
                with contextlib.suppress(sqlite3.Error):
                    self._db.execute("ROLLBACK")
                raise StoreError(f"commit to {self.config.path!r} failed: {exc}") from None

    def _write(self, sql: str, params: tuple[Any, ...]) -> sqlite3.Cursor:
        try:
            with self.transaction():
                return self._db.execute(sql, params)
        except sqlite3.Error as exc:
            raise StoreError(f"write to {self.config.path!r} failed: {exc}") from None

    # ------------------------------------------------------------------ generation, config

    def begin_generation(self) -> int:
        """Increment and return the coordinator generation (1 for a new store).

        Call once per coordinator start, before serving.
        """
        with self.transaction():
            current = int(self._meta("generation") or 0)
            self._set_meta_autocommit("generation", str(current + 1))
        self._generation = current + 1
        return current + 1

    @property
    def generation(self) -> int:
        """The generation this process opened (begin_generation must have run)."""
        if self._generation is None:
            raise StoreError("begin_generation() has not been called on this store")
        return self._generation

    def stored_generation(self) -> int:
        """The latest generation recorded in the file (0 for a new store)."""
        return int(self._meta("generation") or 0)

    def get_meta(self, key: str) -> str | None:
        """A free-form metadata value (e.g. the control-plane config), or None."""
        return self._meta(key)

    def set_meta(self, key: str, value: str) -> None:
        """Set a free-form metadata value durably."""
        if key in ("schema_version", "generation"):
            raise ValueError(f"meta key {key!r} is managed by the store itself")
        with self.transaction():
            self._set_meta_autocommit(key, value)

    # ------------------------------------------------------------------ log

    def append(self, op: str, args: Any, result: Any, *, defer: bool = False) -> int:
        """Log one mutation and its result; returns its lsn.

        Durable when this returns, unless called inside transaction() (durable when it
        commits) or with defer=True (durable at the next flush(): group commit, one fsync
        for every deferred append since the last flush). args/result must be JSON values
        (no NaN).
        """
        if not op:
            raise ValueError("op must be a non-empty string")
        try:
            args_text, result_text = _dumps(args), _dumps(result)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{op}: arguments/result are not JSON values: {exc}") from None
        sql = "INSERT INTO log(generation, op, args, result) VALUES(?, ?, ?, ?)"
        params = (self.generation, op, args_text, result_text)
        if not defer:
            return int(self._write(sql, params).lastrowid or 0)
        with self._lock:
            try:
                if not self._in_tx:
                    self._db.execute("BEGIN IMMEDIATE")
                    self._in_tx = True
                    self._deferred = 0
                cursor = self._db.execute(sql, params)
            except sqlite3.Error as exc:
                self._abort_deferred()
                raise StoreError(f"write to {self.config.path!r} failed: {exc}") from None
            self._deferred += 1
            return int(cursor.lastrowid or 0)

    @property
    def in_transaction(self) -> bool:
        """Whether a commit is open (a `transaction()` block or unflushed deferred
        appends): appends made now are not durable yet."""
        return self._in_tx

    @property
    def pending(self) -> int:
        """Deferred appends not yet flushed."""
        return self._deferred

    def flush(self) -> int:
        """Commit every deferred append (one fsync); returns how many became durable."""
        with self._lock:
            if not self._deferred:
                return 0
            count = self._deferred
            try:
                self._db.execute("COMMIT")
            except sqlite3.Error as exc:
                self._abort_deferred()
                raise StoreError(f"commit to {self.config.path!r} failed: {exc}") from None
            self._in_tx = False
            self._deferred = 0
            return count

    def _abort_deferred(self) -> None:
        # Drops every unflushed append: none was acknowledged.
        with contextlib.suppress(sqlite3.Error):
            self._db.execute("ROLLBACK")
        self._in_tx = False
        self._deferred = 0

    def last_lsn(self) -> int:
        """The highest lsn ever written (0 when nothing was), including checkpointed rows."""
        with self._lock:
            # AUTOINCREMENT keeps the high-water mark in sqlite_sequence, so lsns are never
            # reused after a checkpoint deletes the rows it covers.
            row = self._db.execute("SELECT seq FROM sqlite_sequence WHERE name = 'log'").fetchone()
        return int(row[0]) if row else 0

    def records_after(self, lsn: int) -> Iterator[LogRecord]:
        """The logged mutations with lsn > `lsn`, in order."""
        with self._lock:
            rows = self._db.execute(
                "SELECT lsn, generation, op, args, result FROM log WHERE lsn > ? ORDER BY lsn",
                (lsn,),
            ).fetchall()
        for row_lsn, gen, op, args, result in rows:
            try:
                yield LogRecord(
                    int(row_lsn), int(gen), str(op), json.loads(args), json.loads(result)
                )
            except json.JSONDecodeError as exc:
                raise StoreCorruptError(f"log row {row_lsn} ({op}) is not JSON: {exc}") from None

    def log_length(self) -> int:
        """Log rows not yet covered by a checkpoint."""
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM log").fetchone()[0])

    # ------------------------------------------------------------------ checkpoints

    def write_checkpoint(self, lsn: int, state: Any, worker_epochs: dict[str, Any]) -> None:
        """Replace the checkpoint with `state` covering lsn <= `lsn`; drop those log rows.

        `lsn` must be the store's last lsn (the state must include every logged mutation),
        so a checkpoint can never skip a logged mutation.
        """
        try:
            state_text, epochs_text = _dumps(state), _dumps(worker_epochs)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"checkpoint state is not a JSON value: {exc}") from None
        with self.transaction():
            last = self.last_lsn()
            if lsn != last:
                raise StoreError(
                    f"checkpoint at lsn {lsn} does not cover the log, which ends at lsn {last}"
                )
            self._db.execute(
                "INSERT INTO checkpoint(id, lsn, generation, state, worker_epochs) "
                "VALUES(1, ?, ?, ?, ?) ON CONFLICT(id) DO UPDATE SET lsn = excluded.lsn, "
                "generation = excluded.generation, state = excluded.state, "
                "worker_epochs = excluded.worker_epochs",
                (lsn, self.generation, state_text, epochs_text),
            )
            self._db.execute("DELETE FROM log WHERE lsn <= ?", (lsn,))

    def latest_checkpoint(self) -> Checkpoint | None:
        """The checkpoint, or None when none was ever written."""
        with self._lock:
            row = self._db.execute(
                "SELECT lsn, generation, state, worker_epochs FROM checkpoint WHERE id = 1"
            ).fetchone()
        if row is None:
            return None
        try:
            return Checkpoint(int(row[0]), int(row[1]), json.loads(row[2]), json.loads(row[3]))
        except json.JSONDecodeError as exc:
            raise StoreCorruptError(f"the checkpoint is not JSON: {exc}") from None
