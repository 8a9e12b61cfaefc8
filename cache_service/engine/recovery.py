"""Write-ahead logging around the block manager, and recovery from the log.

`DurableBlockManager` wraps a `BlockManager`: each mutating call runs on the manager first
(it validates everything and changes nothing when it raises, so failed calls are never
logged), then is appended to the store with its arguments and result, committed, and only
then returned to the caller, who acknowledges the RPC. A crash before the commit loses a
call nobody was told about; a crash after it loses nothing.

`recover()` rebuilds the manager: the last checkpoint (`BlockManager.from_records`) plus
the log after it, replayed call by call. The block manager is deterministic except for
fresh sequence ids, which the log carries and replay passes back (`seq_id=` /
`new_seq_id=`). Every replayed result must equal the recorded one; the first difference
stops recovery with RecoveryError (the code or the file changed under us, and serving
from a state that differs from what clients were told would hand out wrong KV).

Writes in flight at the crash: a `prepare_write` is logged before the workers copy and
write, and its `commit_write` after. A sequence whose last prepare_write planned
copy-on-write copies but was never committed may have a destination block that the copy
never reached; recovery reports those (`RecoveryResult.unfinished_copies`) so the
coordinator can fail them instead of serving a half-copied block. Positions a crashed call
reserved and never committed are released (`cancel_unfinished_writes`): no call is in
flight after a restart, and a client that never got its answer may send other tokens there.

Pure: no torch, Ray or gRPC imports.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Iterable, Iterator
from collections.abc import Sequence as SequenceABC
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from cache_service.control.block_manager import BlockManager, BlockManagerConfig, WriteSnapshot
from cache_service.control.eviction import DEFAULT_EVICTION_POLICY
from cache_service.control.kv_events import KvEventLog
from cache_service.control.types import (
    BlockCopy,
    CancelledWrite,
    CreatedSequence,
    SeqRef,
    WritePlan,
)
from cache_service.engine.store import MetadataStore, StoreError
from cache_service.errors import CacheError

__all__ = [
    "LOGGED_OPS",
    "DurableBlockManager",
    "RecoveryError",
    "RecoveryResult",
    "cancel_unfinished_writes",
    "drop_unfinished_copies",
    "encode_result",
    "reconcile_workers",
    "recover",
    "recover_control_plane",
]

log = logging.getLogger("kvcache.coordinator")

# The manager's methods that change state. Every one goes through the log; anything not
# listed here or in _READ_ONLY is refused by the wrapper, so a mutating method added to
# the manager later cannot silently bypass the log.
LOGGED_OPS = (
    "add_worker",
    "lose_worker",
    "create_sequence",
    "fork",
    "free",
    "prepare_write",
    "prepare_writes",
    "fill_pending",
    "cancel_write",
    "commit_write",
    "commit_writes",
    "pin",
    "unpin",
    "publish_public",
    "evict",
    "set_tenant_quota",
    "drop_host_tier",
)
# take_released and take_tier_moves empty transient lists that are no part of the durable
# state (see BlockManager.take_released), so they pass through like reads; so does block_ids, whose
# only side effect is a cache derived from the block tables (cache_service.control.block_rows).
_READ_ONLY = frozenset(
    {
        "attention_view",
        "block_ids",
        "lookup",
        "repeatable",
        "repeatable_layers",
        "snapshot_writes",
        "sequence_info",
        "list_sequences",
        "written_lengths",
        "write_cursor",
        "written_length",
        "unfinished_writes",
        "tenant_quotas",
        "take_released",
        "take_tier_moves",
        "host_tiers",
        "stats",
        "check_integrity",
        "to_records",
        "workers",
        "config",
    }
)
_CONFIG_META_KEY = "block_manager_config"
# The KV event stream's id: one per store, so the numbering it names survives restarts.
_EVENT_STREAM_META_KEY = "kv_event_stream"


class RecoveryError(StoreError):
    """The log cannot be replayed into a state equal to the recorded one."""


def encode_result(value: Any) -> Any:
    """A control-plane value as JSON data: dataclasses -> dicts, tuples -> lists."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if type(value) is WritePlan:
        # Every write's result, a decode step's one per sequence: what the generic walk
        # below makes of it (same keys, same order), without a field lookup per value.
        return {
            "start": value.start,
            "slots": [[worker_id, slot] for worker_id, slot in value.slots],
            "copies": [encode_result(copy) for copy in value.copies],
        }
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: encode_result(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, list | tuple):
        return [encode_result(v) for v in value]
    if isinstance(value, dict):
        return {str(k): encode_result(v) for k, v in value.items()}
    raise TypeError(f"cannot log a value of type {type(value).__name__}")


def _materialize(token_ids: Any) -> Any:
    """A list the manager and the log both read (a one-shot iterator would be consumed by
    the manager and logged empty). Non-iterables pass through for the manager to refuse."""
    if isinstance(token_ids, Iterable) and not isinstance(token_ids, str | bytes | list):
        return list(token_ids)
    return token_ids


def _token_list(token_ids: Any) -> list[int] | None:
    # Called only after the manager accepted the tokens, so each converts to an int.
    return None if token_ids is None else [int(t) for t in token_ids]


def _config_json(config: BlockManagerConfig) -> dict[str, Any]:
    return encode_result(config)


class DurableBlockManager:
    """A BlockManager whose every mutation is logged durably before the call returns.

    Reads (attention_view, lookup, stats, ...) pass straight through. The worker epochs
    given to add_worker are logged with it and kept here, for checkpoints and recovery.
    Once a log write fails the in-memory state is ahead of the file; from then on every
    call raises StoreError and the coordinator must restart (and recover from the file).
    """

    def __init__(
        self,
        manager: BlockManager,
        store: MetadataStore,
        worker_epochs: dict[str, str] | None = None,
        unfinished_copies: dict[SeqRef, list[BlockCopy]] | None = None,
        *,
        group_commit: bool = False,
    ) -> None:
        """Wrap `manager` (already recovered from `store`, or new) and log into `store`.

        group_commit: False: every call commits (one fsync each) before it returns. True:
            calls are appended to an open transaction and become durable at `flush()`,
            which the caller must run before acknowledging anything (one fsync covers every
            call made since the previous flush, by any request).

        Raises RecoveryError when the store was written for another layout.
        """
        _check_config(store, manager.config)
        self._manager = manager
        self._store = store
        self._epochs: dict[str, str] = dict(worker_epochs or {})
        self._unfinished: dict[SeqRef, list[BlockCopy]] = dict(unfinished_copies or {})
        self._failed: str | None = None
        self._group = group_commit
        self._since_checkpoint = store.log_length()
        if store.get_meta(_CONFIG_META_KEY) is None:
            store.set_meta(_CONFIG_META_KEY, json.dumps(_config_json(manager.config)))
        # KV events become visible once the call that made them is durable: a crash before
        # that must not take back (and renumber) an event a subscriber already saw.
        events = manager.events
        events.auto_release = False
        stream = store.get_meta(_EVENT_STREAM_META_KEY)
        if stream is None:
            store.set_meta(_EVENT_STREAM_META_KEY, events.stream_id)
        else:
            events.stream_id = stream
        events.release()  # what recovery rebuilt is durable already

    @classmethod
    def from_recovery(
        cls, result: RecoveryResult, store: MetadataStore, *, group_commit: bool = False
    ) -> DurableBlockManager:
        """Continue logging into `store` after `recover(store, ...)` returned `result`."""
        return cls(
            result.manager,
            store,
            result.worker_epochs,
            result.unfinished_copies,
            group_commit=group_commit,
        )

    # ------------------------------------------------------------------ plumbing

    @property
    def manager(self) -> BlockManager:
        """The wrapped manager (reads only: mutating it directly bypasses the log)."""
        return self._manager

    @property
    def events(self) -> KvEventLog:
        """The manager's KV event log (released as calls become durable)."""
        return self._manager.events

    @property
    def worker_epochs(self) -> dict[str, str]:
        """Worker id -> the epoch its blocks belong to (a copy)."""
        return dict(self._epochs)

    def __getattr__(self, name: str) -> Any:
        if name in _READ_ONLY:
            return getattr(self._manager, name)
        raise AttributeError(
            f"DurableBlockManager has no {name!r}: only logged mutations and known reads "
            "are exposed"
        )

    @property
    def unfinished_copies(self) -> dict[SeqRef, list[BlockCopy]]:
        """Sequences with copy-on-write copies planned and not yet committed (a copy)."""
        return {ref: list(c) for ref, c in self._unfinished.items()}

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """Group the calls inside into one commit (one fsync) - a group commit.

        Nothing inside is durable until the block exits; acknowledge after it.
        """
        with self._store.transaction():
            yield
        self._release_events()

    def _release_events(self) -> None:
        """Publish the KV events of every durable call (none while a commit is open)."""
        if not self._store.in_transaction:
            self._manager.events.release()

    def _check_usable(self) -> None:
        if self._failed is not None:
            raise StoreError(
                f"the metadata store failed earlier ({self._failed}); the in-memory state is "
                "no longer durable: restart the coordinator to recover from the store"
            )

    def flush(self) -> int:
        """Make every logged call durable; returns how many were pending.

        Acknowledge an RPC only after this (a no-op without group commit). Cheap when
        nothing is pending, so every RPC may call it, reads included: a read can observe a
        mutation of another request that is not durable yet.
        """
        self._check_usable()
        try:
            flushed = self._store.flush()
        except StoreError as exc:
            self._failed = f"flush: {exc}"
            raise
        self._release_events()
        return flushed

    def _log(self, op: str, args: dict[str, Any], result: Any) -> None:
        try:
            self._store.append(op, args, encode_result(result), defer=self._group)
        except (StoreError, ValueError, TypeError) as exc:
            self._failed = f"{op}: {exc}"
            raise StoreError(f"could not log {op}: {exc}") from exc
        _track(op, args, result, self._epochs, self._unfinished)
        self._release_events()
        self._since_checkpoint += 1
        if self._since_checkpoint >= self._store.config.checkpoint_every:
            self.checkpoint()

    def _run(self, op: str, call: Callable[[], Any], args: Callable[[], dict[str, Any]]) -> Any:
        self._check_usable()
        result = call()  # a CacheError here changed nothing: nothing to log
        self._log(op, args(), result)
        return result

    def checkpoint(self) -> int:
        """Snapshot the whole state into the store now; returns the lsn it covers."""
        self._check_usable()
        try:
            with self._store.transaction():
                lsn = self._store.last_lsn()
                state = _checkpoint_state(self._manager, self._unfinished)
                self._store.write_checkpoint(lsn, state, self._epochs)
        except StoreError as exc:
            # The log still holds everything: a failed checkpoint loses nothing.
            raise StoreError(f"checkpoint failed: {exc}") from exc
        self._since_checkpoint = 0
        return lsn

    # ------------------------------------------------------------------ workers

    def add_worker(
        self, worker_id: str, num_blocks: int, epoch: str | None = None, host_blocks: int = 0
    ) -> None:
        """BlockManager.add_worker, recording the worker's `epoch` (see WorkerDescription)."""
        if epoch is not None and not isinstance(epoch, str):
            raise TypeError(f"epoch must be a str or None, got {type(epoch).__name__}")
        self._check_usable()
        self._manager.add_worker(worker_id, num_blocks, host_blocks)
        args: dict[str, Any] = {"worker_id": worker_id, "num_blocks": num_blocks, "epoch": epoch}
        if host_blocks:
            args["host_blocks"] = host_blocks
        self._log("add_worker", args, None)

    def drop_host_tier(self) -> int:
        """BlockManager.drop_host_tier."""
        return self._run("drop_host_tier", self._manager.drop_host_tier, lambda: {})

    def lose_worker(self, worker_id: str) -> list[SeqRef]:
        """BlockManager.lose_worker; forgets the worker's epoch."""
        self._check_usable()
        result = self._manager.lose_worker(worker_id)
        self._log("lose_worker", {"worker_id": worker_id}, result)
        return result

    # ------------------------------------------------------------------ sequences

    def create_sequence(
        self,
        tenant: str,
        prompt_token_ids: SequenceABC[int] | None = None,
        namespace: str = "",
        *,
        seq_id: str | None = None,
    ) -> CreatedSequence:
        """BlockManager.create_sequence, logged with the id it drew (or was given: an
        idempotent create's id, derived from its request id; replay passes it back)."""
        prompt_token_ids = _materialize(prompt_token_ids)
        return self._run(
            "create_sequence",
            lambda: self._manager.create_sequence(
                tenant, prompt_token_ids, seq_id=seq_id, namespace=namespace
            ),
            lambda: {
                "tenant": tenant,
                "prompt_token_ids": _token_list(prompt_token_ids),
                **_ns(namespace),
            },
        )

    def fork(self, tenant: str, seq_id: str, *, new_seq_id: str | None = None) -> str:
        """BlockManager.fork, logged with the id it drew (or was given, as in
        `create_sequence`)."""
        return self._run(
            "fork",
            lambda: self._manager.fork(tenant, seq_id, new_seq_id=new_seq_id),
            lambda: {"tenant": tenant, "seq_id": seq_id},
        )

    def free(self, tenant: str, seq_id: str) -> None:
        """BlockManager.free."""
        self._run(
            "free",
            lambda: self._manager.free(tenant, seq_id),
            lambda: {"tenant": tenant, "seq_id": seq_id},
        )

    def prepare_write(
        self, tenant: str, seq_id: str, layer: int | None, token_ids: SequenceABC[int]
    ) -> WritePlan:
        """BlockManager.prepare_write."""
        token_ids = _materialize(token_ids)
        return self._run(
            "prepare_write",
            lambda: self._manager.prepare_write(tenant, seq_id, layer, token_ids),
            lambda: {
                "tenant": tenant,
                "seq_id": seq_id,
                "layer": layer,
                "token_ids": _token_list(token_ids),
            },
        )

    def prepare_writes(
        self,
        tenant: str,
        layer: int | None,
        writes: SequenceABC[tuple[str, SequenceABC[int]]],
        ahead: int = 0,
    ) -> list[WritePlan]:
        """BlockManager.prepare_writes (one record for the whole batch: all or nothing)."""
        items = _materialize(writes)
        if isinstance(items, list):
            items = [
                (w[0], _materialize(w[1])) if isinstance(w, tuple | list) and len(w) == 2 else w
                for w in items
            ]
        return self._run(
            "prepare_writes",
            lambda: self._manager.prepare_writes(tenant, layer, items, ahead),
            lambda: {
                "tenant": tenant,
                "layer": layer,
                "writes": [[seq_id, _token_list(tokens)] for seq_id, tokens in items],
                **({"ahead": ahead} if ahead else {}),
            },
        )

    def fill_pending(
        self, tenant: str, fills: SequenceABC[tuple[str, int, SequenceABC[int]]]
    ) -> None:
        """BlockManager.fill_pending (one record for the batch)."""
        items = [
            (f[0], f[1], _materialize(f[2])) if isinstance(f, tuple | list) and len(f) == 3 else f
            for f in fills
        ]
        self._run(
            "fill_pending",
            lambda: self._manager.fill_pending(tenant, items),
            lambda: {
                "tenant": tenant,
                "fills": [[seq_id, start, _token_list(tokens)] for seq_id, start, tokens in items],
            },
        )

    def cancel_write(self, tenant: str, seq_id: str) -> CancelledWrite:
        """BlockManager.cancel_write."""
        return self._run(
            "cancel_write",
            lambda: self._manager.cancel_write(tenant, seq_id),
            lambda: {"tenant": tenant, "seq_id": seq_id},
        )

    def set_tenant_quota(
        self, tenant: str, max_blocks: int | None = None, max_sequences: int | None = None
    ) -> None:
        """BlockManager.set_tenant_quota (recovered with the rest of the state)."""
        self._run(
            "set_tenant_quota",
            lambda: self._manager.set_tenant_quota(tenant, max_blocks, max_sequences),
            lambda: {"tenant": tenant, "max_blocks": max_blocks, "max_sequences": max_sequences},
        )

    def commit_write(self, tenant: str, seq_id: str, layer: int | None, num_tokens: int) -> None:
        """BlockManager.commit_write."""
        self._run(
            "commit_write",
            lambda: self._manager.commit_write(tenant, seq_id, layer, num_tokens),
            lambda: {"tenant": tenant, "seq_id": seq_id, "layer": layer, "num_tokens": num_tokens},
        )

    def commit_writes(
        self, tenant: str, layer: int | None, writes: SequenceABC[tuple[str, int]]
    ) -> None:
        """BlockManager.commit_writes (one record for the whole batch: all or nothing)."""
        items = [tuple(w) if isinstance(w, tuple | list) else w for w in writes]
        self._run(
            "commit_writes",
            lambda: self._manager.commit_writes(tenant, layer, items),
            lambda: {"tenant": tenant, "layer": layer, "writes": [list(w) for w in items]},
        )

    def commit_repeated(self, snapshot: WriteSnapshot, layer: int) -> None:
        """BlockManager.commit_repeated, logged as the `commit_writes` it is equivalent to
        (recovery replays that)."""
        self._run(
            "commit_writes",
            lambda: self._manager.commit_repeated(snapshot, layer),
            lambda: {
                "tenant": snapshot.tenant,
                "layer": layer,
                "writes": [[s, c] for s, c in zip(snapshot.seq_ids, snapshot.counts, strict=True)],
            },
        )

    def commit_repeated_layers(self, snapshot: WriteSnapshot, layers: SequenceABC[int]) -> None:
        """BlockManager.commit_repeated_layers, logged as the `commit_writes` of each layer
        (what `commit_repeated` logs for it) in one store transaction: a step lease's end
        commits its layers with one fsync, not one per layer."""
        layers = tuple(layers)
        self._check_usable()
        self._manager.commit_repeated_layers(snapshot, layers)  # raising, it changed nothing
        writes = [[s, c] for s, c in zip(snapshot.seq_ids, snapshot.counts, strict=True)]
        self._log_commits(
            [{"tenant": snapshot.tenant, "layer": layer, "writes": writes} for layer in layers]
        )

    def commit_steps(self, snapshot: WriteSnapshot, steps: int, layers: SequenceABC[int]) -> None:
        """BlockManager.commit_steps, logged as the `commit_writes` it is equivalent to
        (every layer by `steps` tokens, then each of `layers` by one) in one store
        transaction."""
        layers = tuple(layers)
        self._check_usable()
        self._manager.commit_steps(snapshot, steps, layers)  # raising, it changed nothing
        records = []
        if steps:
            writes = [[s, steps] for s in snapshot.seq_ids]
            records.append({"tenant": snapshot.tenant, "layer": None, "writes": writes})
        ones = [[s, 1] for s in snapshot.seq_ids]
        records += [{"tenant": snapshot.tenant, "layer": x, "writes": ones} for x in layers]
        self._log_commits(records)

    def _log_commits(self, records: list[dict[str, Any]]) -> None:
        """Log `commit_writes` records of a commit already made in memory, in one store
        transaction (one fsync)."""
        try:
            with self.transaction():
                for args in records:
                    self._log("commit_writes", args, None)
        except StoreError as exc:
            # Committed in memory, not in the log (the transaction kept none of its
            # records): as when one record cannot be logged (`_log`), the store refuses
            # every later call until a restart recovers from it.
            if self._failed is None:
                self._failed = f"commit_writes: {exc}"
            raise

    def pin(self, tenant: str, token_ids: SequenceABC[int], namespace: str = "") -> int:
        """BlockManager.pin."""
        token_ids = _materialize(token_ids)
        return self._run(
            "pin",
            lambda: self._manager.pin(tenant, token_ids, namespace),
            lambda: {"tenant": tenant, "token_ids": _token_list(token_ids), **_ns(namespace)},
        )

    def unpin(self, tenant: str, token_ids: SequenceABC[int], namespace: str = "") -> None:
        """BlockManager.unpin."""
        token_ids = _materialize(token_ids)
        self._run(
            "unpin",
            lambda: self._manager.unpin(tenant, token_ids, namespace),
            lambda: {"tenant": tenant, "token_ids": _token_list(token_ids), **_ns(namespace)},
        )

    def publish_public(self, tenant: str, seq_id: str) -> int:
        """BlockManager.publish_public."""
        return self._run(
            "publish_public",
            lambda: self._manager.publish_public(tenant, seq_id),
            lambda: {"tenant": tenant, "seq_id": seq_id},
        )

    def evict(self, max_blocks: int | None = None, worker_id: str | None = None) -> int:
        """BlockManager.evict."""
        return self._run(
            "evict",
            lambda: self._manager.evict(max_blocks, worker_id),
            lambda: {"max_blocks": max_blocks, "worker_id": worker_id},
        )


# ---------------------------------------------------------------------------- recovery


@dataclass
class RecoveryResult:
    """What recover() rebuilt.

    manager: the recovered BlockManager (check_integrity passed).
    generation: this coordinator's generation (already incremented in the store).
    worker_epochs: worker id -> epoch its blocks belong to, as of the end of the log.
    checkpoint_lsn: the lsn the checkpoint covered (0: none).
    replayed: log records replayed after it.
    unfinished_copies: sequences whose last prepare_write planned copy-on-write copies and
        was not followed by a commit_write: the copies may not have run.
    """

    manager: BlockManager
    generation: int
    worker_epochs: dict[str, str]
    checkpoint_lsn: int
    replayed: int
    unfinished_copies: dict[SeqRef, list[BlockCopy]] = field(default_factory=dict)


def _ns(namespace: str) -> dict[str, str]:
    """The namespace argument of a log record: absent for the default namespace, so records
    of default-namespace calls read the same as before namespaces existed."""
    return {"namespace": namespace} if namespace else {}


def _apply(manager: BlockManager, op: str, args: dict[str, Any], recorded: Any) -> Any:
    """Re-run one logged call, feeding back the ids it drew."""
    m = manager
    if op == "add_worker":
        return m.add_worker(args["worker_id"], args["num_blocks"], args.get("host_blocks", 0))
    if op == "drop_host_tier":
        return m.drop_host_tier()
    if op == "lose_worker":
        return m.lose_worker(args["worker_id"])
    if op == "create_sequence":
        if not isinstance(recorded, dict) or "seq_id" not in recorded:
            raise RecoveryError(f"create_sequence record has no seq_id: {recorded!r}")
        # Logs written before namespaces existed hold none: the default namespace.
        return m.create_sequence(
            args["tenant"],
            args["prompt_token_ids"],
            seq_id=recorded["seq_id"],
            namespace=args.get("namespace", ""),
        )
    if op == "fork":
        return m.fork(args["tenant"], args["seq_id"], new_seq_id=recorded)
    if op == "free":
        return m.free(args["tenant"], args["seq_id"])
    if op == "prepare_write":
        return m.prepare_write(args["tenant"], args["seq_id"], args["layer"], args["token_ids"])
    if op == "prepare_writes":
        writes = [(seq_id, tokens) for seq_id, tokens in args["writes"]]
        return m.prepare_writes(args["tenant"], args["layer"], writes, args.get("ahead", 0))
    if op == "fill_pending":
        fills = [(seq_id, start, tokens) for seq_id, start, tokens in args["fills"]]
        return m.fill_pending(args["tenant"], fills)
    if op == "cancel_write":
        return m.cancel_write(args["tenant"], args["seq_id"])
    if op == "set_tenant_quota":
        return m.set_tenant_quota(args["tenant"], args["max_blocks"], args["max_sequences"])
    if op == "commit_write":
        return m.commit_write(args["tenant"], args["seq_id"], args["layer"], args["num_tokens"])
    if op == "commit_writes":
        writes = [(seq_id, num_tokens) for seq_id, num_tokens in args["writes"]]
        return m.commit_writes(args["tenant"], args["layer"], writes)
    if op == "pin":
        return m.pin(args["tenant"], args["token_ids"], args.get("namespace", ""))
    if op == "unpin":
        return m.unpin(args["tenant"], args["token_ids"], args.get("namespace", ""))
    if op == "publish_public":
        return m.publish_public(args["tenant"], args["seq_id"])
    if op == "evict":
        return m.evict(args["max_blocks"], args["worker_id"])
    raise RecoveryError(f"unknown logged operation {op!r}")


def _check_config(store: MetadataStore, config: BlockManagerConfig) -> None:
    stored = store.get_meta(_CONFIG_META_KEY)
    if stored is None:
        return
    # Only the fields that decide block contents, prefix keys and which block each
    # replayed call gets must match; quotas may change between runs (they apply to new
    # calls, not to the replayed ones). Stores that predate eviction_policy used LRU.
    was, now = json.loads(stored), _config_json(config)
    was.setdefault("eviction_policy", DEFAULT_EVICTION_POLICY)
    for name in ("block_size", "num_layers", "layout_fingerprint", "eviction_policy"):
        if was.get(name) != now[name]:
            raise RecoveryError(
                f"the store was written with {name}={was.get(name)!r} but the service is "
                f"configured with {now[name]!r}; use another store path or the stored setting"
            )


@contextmanager
def _stage(lsn: int, op: str) -> Iterator[None]:
    try:
        yield
    except RecoveryError:
        raise
    except (CacheError, KeyError, TypeError, ValueError) as exc:
        raise RecoveryError(
            f"replaying log record {lsn} ({op}) failed: {type(exc).__name__}: {exc}"
        ) from exc


def recover(store: MetadataStore, config: BlockManagerConfig) -> RecoveryResult:
    """Rebuild the control plane from `store`: checkpoint + verified replay of the log.

    `store.begin_generation()` must have been called (the caller owns the generation, so
    it can fence workers before serving). `config` is the service's configuration; its
    layout fields must equal the stored ones. Quotas come from `config`.

    Raises:
        RecoveryError: a record fails to replay or gives a result that differs from the
            recorded one, or the layout changed.
    """
    _check_config(store, config)
    checkpoint = store.latest_checkpoint()
    unfinished: dict[SeqRef, list[BlockCopy]] = {}
    if checkpoint is None:
        replay_manager = BlockManager(config)
        epochs: dict[str, str] = {}
        start = 0
    else:
        with _stage(checkpoint.lsn, "checkpoint"):
            replay_manager, unfinished = _from_checkpoint_state(checkpoint.state)
        epochs = dict(checkpoint.worker_epochs)
        start = checkpoint.lsn

    replayed = 0
    for record in store.records_after(start):
        args = record.args
        with _stage(record.lsn, record.op):
            result = _apply(replay_manager, record.op, args, record.result)
        got = encode_result(result)
        if got != record.result:
            raise RecoveryError(
                f"log record {record.lsn} ({record.op} {args!r}) replays to {got!r}, but "
                f"{record.result!r} was recorded"
            )
        _track(record.op, args, result, epochs, unfinished)
        replayed += 1

    with _stage(start, "check_integrity"):
        replay_manager.check_integrity()
    # Blocks the replay saw go free were released (or not) by the coordinator that ran
    # then; many were reused since, and poisoning them now would destroy live KV.
    replay_manager.take_released()
    # Likewise the copies to and from host tiers: they ran (or not) back then.
    replay_manager.take_tier_moves()
    manager = _with_config(replay_manager, config)
    return RecoveryResult(manager, store.generation, epochs, start, replayed, unfinished)


def _track(
    op: str,
    args: dict[str, Any],
    result: Any,
    epochs: dict[str, str],
    unfinished: dict[SeqRef, list[BlockCopy]],
) -> None:
    """Follow worker epochs and uncommitted copy-on-write plans through the log."""
    if op == "add_worker" and args.get("epoch") is not None:
        epochs[args["worker_id"]] = args["epoch"]
    elif op == "lose_worker":
        epochs.pop(args["worker_id"], None)
        for ref in result:
            unfinished.pop(SeqRef(*ref), None)
    elif op == "prepare_write" and result.copies:
        unfinished[SeqRef(args["tenant"], args["seq_id"])] = list(result.copies)
    elif op == "prepare_writes":
        # A cancel_write leaves the entry: the copy may not have run before the call failed.
        for (seq_id, _), plan in zip(args["writes"], result, strict=True):
            if plan.copies:
                unfinished[SeqRef(args["tenant"], seq_id)] = list(plan.copies)
    elif op in ("commit_write", "free"):
        unfinished.pop(SeqRef(args["tenant"], args["seq_id"]), None)
    elif op == "commit_writes":
        for seq_id, _ in args["writes"]:
            unfinished.pop(SeqRef(args["tenant"], seq_id), None)


def _checkpoint_state(
    manager: BlockManager, unfinished: dict[SeqRef, list[BlockCopy]]
) -> dict[str, Any]:
    return {
        "manager": manager.to_records(),
        "unfinished_copies": [
            {"tenant": ref.tenant, "seq_id": ref.seq_id, "copies": encode_result(copies)}
            for ref, copies in unfinished.items()
        ],
        "kv_events": manager.events.to_records(),
    }


def _from_checkpoint_state(
    state: dict[str, Any],
) -> tuple[BlockManager, dict[SeqRef, list[BlockCopy]]]:
    manager = BlockManager.from_records(state["manager"])
    if "kv_events" in state:  # absent in checkpoints written before KV events existed
        manager.attach_events(KvEventLog.from_records(state["kv_events"]))
    unfinished = {
        SeqRef(item["tenant"], item["seq_id"]): [BlockCopy(**c) for c in item["copies"]]
        for item in state["unfinished_copies"]
    }
    return manager, unfinished


def _with_config(manager: BlockManager, config: BlockManagerConfig) -> BlockManager:
    """The same state under the service's current config (quotas may have changed)."""
    if manager.config == config:
        return manager
    records = manager.to_records()
    records["config"] = _config_json(config)
    rebuilt = BlockManager.from_records(records)
    rebuilt.attach_events(manager.events)
    return rebuilt


def reconcile_workers(
    durable: DurableBlockManager, live: dict[str, tuple[str, int]]
) -> tuple[set[str], list[SeqRef]]:
    """Match the recovered workers against the ones answering now, before serving.

    A recovered worker whose epoch changed (it restarted: its pool is empty), whose size
    changed, whose epoch was never recorded, or that is gone is removed with lose_worker
    (its sequences fail with SequenceLost). The caller adds every live worker not kept.

    Args:
        live: worker id -> (current epoch, num_blocks), from WorkerDescription.

    Returns:
        (ids kept with their blocks, sequences lost).
    """
    epochs = durable.worker_epochs
    kept: set[str] = set()
    lost: list[SeqRef] = []
    for worker_id, num_blocks in durable.workers().items():
        now = live.get(worker_id)
        if now is not None and epochs.get(worker_id) == now[0] and num_blocks == now[1]:
            kept.add(worker_id)
        else:
            lost.extend(durable.lose_worker(worker_id))
    return kept, lost


def drop_unfinished_copies(durable: DurableBlockManager) -> list[SeqRef]:
    """Free the sequences whose copy-on-write copy may not have run before the crash.

    Their last block may hold another sequence's later writes or nothing at all; serving
    it could hand out wrong KV, so they are dropped (later calls get NOT_FOUND; the client
    recomputes). The window is one worker round trip, so this is rare.
    """
    dropped = list(durable.unfinished_copies)
    for ref in dropped:
        durable.free(ref.tenant, ref.seq_id)
    return dropped


def cancel_unfinished_writes(durable: DurableBlockManager) -> list[SeqRef]:
    """Release what calls in flight at the crash reserved and never committed.

    Their clients got no answer; holding the positions would refuse a retry with other
    token ids and keep blocks nobody will write. Run after `drop_unfinished_copies`.

    Returns:
        The sequences whose reservations were released.
    """
    refs = durable.unfinished_writes()
    for ref in refs:
        durable.cancel_write(ref.tenant, ref.seq_id)
    return refs


def recover_control_plane(
    store: MetadataStore,
    config: BlockManagerConfig,
    live: dict[str, tuple[str, int]],
    metrics: Any = None,
) -> tuple[DurableBlockManager, int, set[str]]:
    """A coordinator's start on a store: begin its generation, rebuild the control plane
    (`recover`), drop the workers that came back other than they were (`live`: worker id
    -> (epoch, num_blocks) as they describe themselves now), and undo the copies and
    writes no call finished. Counts the lost sequences in `metrics` (a ServiceMetrics,
    optional).

    Returns (the durable block manager, the generation, the workers whose blocks
    survived).
    """
    generation = store.begin_generation()
    result = recover(store, config)
    durable = DurableBlockManager.from_recovery(result, store)
    kept, lost = reconcile_workers(durable, live)
    # An offload logged before the crash may never have reached its worker: no host block
    # can be trusted, so the host tiers start empty (cache_service.control.host_tier).
    host_dropped = durable.drop_host_tier() if any(durable.host_tiers().values()) else 0
    dropped = drop_unfinished_copies(durable)
    cancelled = cancel_unfinished_writes(durable)
    if metrics is not None and lost:
        metrics.add_lost_sequences(len(lost))
    log.info(
        "control plane recovered",
        extra={
            "generation": generation,
            "checkpoint_lsn": result.checkpoint_lsn,
            "replayed": result.replayed,
            "workers_kept": sorted(kept),
            "lost_sequences": len(lost),
            "dropped_unfinished_copies": len(dropped),
            "dropped_host_tier_keys": host_dropped,
            "cancelled_unfinished_writes": len(cancelled),
        },
    )
    return durable, generation, kept
