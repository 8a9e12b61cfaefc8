"""The control plane's facade: sequences, block tables, prefix sharing, eviction, placement.

Pure bookkeeping (no torch, Ray or gRPC): the coordinator calls it, then tells workers what
to copy and where to write. Every public method validates everything before it mutates
anything, so a call that raises leaves the state exactly as it was.

Not thread-safe: the coordinator calls it from one event loop.

Determinism: given the same calls (and the seq ids a write-ahead log recorded, passed back
through `seq_id=` / `new_seq_id=`), the same blocks and slots come out, so recovery can
replay a log on top of a `to_records()` snapshot.
"""

from __future__ import annotations

import secrets
from array import array
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass
from typing import Any, NamedTuple

from cache_service.accounting import CacheCounters, CacheStats, WorkerStats, collect_stats
from cache_service.block_pool import BlockPool
from cache_service.control_types import (
    BlockCopy,
    CancelledWrite,
    CreatedSequence,
    PhysicalBlock,
    Segment,
    SeqRef,
    SequenceInfo,
    SequenceSummary,
    SequenceView,
    TenantQuota,
    WriteCursor,
    WritePlan,
)
from cache_service.errors import (
    CacheError,
    InvalidRequest,
    LayerNotWritten,
    PermissionDenied,
    PoolExhausted,
    QuotaExceeded,
    SequenceLost,
    SequenceNotFound,
)
from cache_service.placement import choose_home, plan_growth
from cache_service.prefix_index import (
    ROOT_KEY,
    TOKEN_BYTES,
    IndexEntry,
    PrefixIndex,
    Salt,
    block_key,
    encode_tokens,
    make_salt,
    pack_tokens,
    token_bytes,
)
from cache_service.sequence import Sequence, segments_of

__all__ = [
    "BlockCopy",
    "BlockManager",
    "BlockManagerConfig",
    "CacheError",
    "CacheStats",
    "CancelledWrite",
    "CreatedSequence",
    "InvalidRequest",
    "LayerNotWritten",
    "PermissionDenied",
    "PhysicalBlock",
    "PoolExhausted",
    "QuotaExceeded",
    "Segment",
    "SeqRef",
    "SequenceInfo",
    "SequenceLost",
    "SequenceNotFound",
    "SequenceView",
    "TenantQuota",
    "WorkerStats",
    "WriteCursor",
    "WritePlan",
    "WriteSnapshot",
]

# Ids and tenant names are echoed in messages and stored in snapshots: keep them bounded.
_MAX_NAME = 256


@dataclass(frozen=True, slots=True)
class WriteSnapshot:
    """A batch of one-layer writes as planned, for `BlockManager.repeatable` (see
    `BlockManager.snapshot_writes`).

    Attributes:
        tenant: the writes' tenant.
        seq_ids: the sequences, in batch order.
        starts: per sequence, the first position written.
        num_tokens: tokens each sequence wrote.
        seqs / rows: the live sequence objects and their block rows at the time (identity
            is what `repeatable` checks; read them only through the manager).
    """

    tenant: str
    seq_ids: tuple[str, ...]
    starts: tuple[int, ...]
    num_tokens: int
    seqs: tuple[Sequence, ...]
    rows: tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class BlockManagerConfig:
    """Static settings of a block manager.

    Attributes:
        block_size: token slots per block (> 0).
        num_layers: model layers each block holds K/V for (> 0).
        layout_fingerprint: `KVLayout.fingerprint()`; salts every prefix key.
        tenant_quota_blocks: most distinct blocks one tenant's sequences may reference
            (a block shared by several of its sequences counts once); None: no limit.
            The default for tenants without a quota of their own (`set_tenant_quota`).
        tenant_quota_sequences: most live sequences per tenant; None: no limit. Same
            default rule.
    """

    block_size: int
    num_layers: int
    layout_fingerprint: str
    tenant_quota_blocks: int | None = None
    tenant_quota_sequences: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_size", "num_layers"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"BlockManagerConfig.{name} must be a positive int, got {value!r}")
        if not isinstance(self.layout_fingerprint, str) or not self.layout_fingerprint:
            raise ValueError("BlockManagerConfig.layout_fingerprint must be a non-empty str")
        for name in ("tenant_quota_blocks", "tenant_quota_sequences"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(
                    f"BlockManagerConfig.{name} must be None or a positive int, got {value!r}"
                )


class LostSequence(NamedTuple):
    """Tombstone of a sequence failed by a lost worker (kept until its client frees it)."""

    tenant: str
    worker_id: str


@dataclass(slots=True)
class _Undo:
    """How to put one sequence back as it was before one prepare_write of a batch."""

    seq: Sequence
    tokens: int
    table: int
    last: PhysicalBlock | None
    home: str | None
    # Blocks taken, in order, and whether each came off the cached-free LRU.
    taken: list[tuple[PhysicalBlock, bool]]
    cow_src: PhysicalBlock | None = None


class _Journal:
    """What the prepare_write calls of one `prepare_writes` batch changed, so that a failing
    item can put every earlier one back exactly (free-list and LRU order included).

    Index entries of cached-free blocks a batch evicts are removed only once the whole
    batch succeeded: nothing in prepare_write reads the index, and a failed batch then has
    nothing to re-publish (re-publishing would change the index's order).
    """

    def __init__(self, counters: CacheCounters, released: dict[str, list[int]]) -> None:
        self.evictions = counters.evictions
        self.cow_copies = counters.cow_copies
        self.released = {w: len(ids) for w, ids in released.items()}
        self.steps: list[_Undo] = []
        self.evicted: list[PhysicalBlock] = []


@dataclass(slots=True)
class Pin:
    """One pinned prefix of one tenant: the blocks it holds a reference on, and how many
    times it was pinned (each pin adds one reference per block)."""

    blocks: list[PhysicalBlock]
    count: int


class BlockManager:
    """Block tables, reference counts, the prefix index and per-worker pools.

    See docs/contracts.md for the contract and cache_service/errors.py for the errors.
    """

    def __init__(self, config: BlockManagerConfig) -> None:
        """An empty manager: no workers, no sequences."""
        if not isinstance(config, BlockManagerConfig):
            raise TypeError(f"config must be a BlockManagerConfig, got {type(config).__name__}")
        self.config = config
        self._bs = config.block_size
        self._num_layers = config.num_layers
        self._pools: dict[str, BlockPool] = {}
        self._index = PrefixIndex(config.block_size)
        self._seqs: dict[str, Sequence] = {}
        self._lost: dict[str, LostSequence] = {}
        # Per tenant: block -> how many of the tenant's table entries reference it. Its
        # length is what the block quota limits.
        self._tenant_blocks: dict[str, dict[PhysicalBlock, int]] = {}
        self._tenant_seqs: dict[str, int] = {}
        self._pins: dict[tuple[str, bytes], Pin] = {}
        self._pinned: dict[PhysicalBlock, int] = {}
        self._counters = CacheCounters()
        self._public = make_salt(None, config.layout_fingerprint)
        self._salts: dict[str, tuple[Salt, Salt]] = {}
        self._quotas: dict[str, TenantQuota] = {}
        # Blocks that went free (or were evicted for reuse) since the last
        # `take_released`, per worker: the workers poison them in debug mode. Not part of
        # the durable state: a release that never reached a worker costs only that check.
        self._released: dict[str, list[int]] = {}
        self._journal: _Journal | None = None

    # ---- workers ------------------------------------------------------------------------

    def add_worker(self, worker_id: str, num_blocks: int) -> None:
        """Register a worker's pool of `num_blocks` empty blocks.

        Raises:
            InvalidRequest: bad id or size, or the id is already registered.
        """
        _check_name("worker_id", worker_id)
        if worker_id in self._pools:
            raise InvalidRequest(f"worker {worker_id!r} is already registered")
        self._pools[worker_id] = BlockPool(worker_id, num_blocks)

    def workers(self) -> dict[str, int]:
        """Registered worker ids and their pool sizes in blocks, in the order added."""
        return {w: p.num_blocks for w, p in self._pools.items()}

    def lose_worker(self, worker_id: str) -> list[SeqRef]:
        """Forget a worker whose pool is gone.

        Every block on it leaves the tables, the pins and the index. Each sequence that used
        one of its blocks releases its other blocks and becomes a tombstone: later calls on
        it raise SequenceLost until the client frees it. Sequences merely homed there are
        re-placed at their next growth. The id may be added again (as an empty pool).

        Returns:
            The affected sequences, in creation order.

        Raises:
            InvalidRequest: unknown worker.
        """
        if not isinstance(worker_id, str) or worker_id not in self._pools:
            raise InvalidRequest(f"unknown worker {worker_id!r}")
        affected = [
            seq
            for seq in self._seqs.values()
            if any(block.worker_id == worker_id for block in seq.table)
        ]
        for seq in affected:
            tenant_blocks = self._tenant_blocks[seq.tenant]
            for block in reversed(seq.table):
                if block.worker_id != worker_id:
                    self._release(block)
                _unref(tenant_blocks, block)
            self._forget(seq)
            self._lost[seq.seq_id] = LostSequence(seq.tenant, worker_id)
        for key, pin in list(self._pins.items()):
            kept = [b for b in pin.blocks if b.worker_id != worker_id]
            if len(kept) != len(pin.blocks):
                if kept:
                    pin.blocks = kept
                else:
                    del self._pins[key]
        for block in [b for b in self._pinned if b.worker_id == worker_id]:
            del self._pinned[block]
        for block in self._index.blocks_on(worker_id):
            self._index.remove_block(block)
        for seq in self._seqs.values():
            if seq.home == worker_id:
                seq.home = None
        del self._pools[worker_id]
        # Its pool is gone: nothing there to poison any more.
        self._released.pop(worker_id, None)
        return [SeqRef(seq.tenant, seq.seq_id) for seq in affected]

    # ---- sequences ----------------------------------------------------------------------

    def create_sequence(
        self,
        tenant: str,
        prompt_token_ids: SequenceABC[int] | None = None,
        *,
        seq_id: str | None = None,
    ) -> CreatedSequence:
        """Start a sequence, adopting the longest cached prefix of its prompt.

        At most (len(prompt) - 1) // block_size full blocks are adopted, so the client always
        computes at least the last prompt token (it needs its logits). Adopted tokens are
        reserved and written on every layer; the rest of the prompt is reserved by the
        client's `prepare_write` calls.

        Args:
            tenant: owner.
            prompt_token_ids: the prompt (int64 token ids), or None for an empty sequence.
            seq_id: only for replaying a log: the id to use instead of a fresh random one.

        Returns:
            CreatedSequence(seq_id, num_cached_tokens).

        Raises:
            InvalidRequest, QuotaExceeded, PoolExhausted (no worker registered).
        """
        _check_name("tenant", tenant)
        if prompt_token_ids is None:
            prompt = array("Q")
            data = b""
        else:
            prompt = pack_tokens(prompt_token_ids)
            data = token_bytes(prompt)
        self._check_sequence_quota(tenant)
        new_id = self._new_id(seq_id)
        if not self._pools:
            raise PoolExhausted("no worker is registered")
        matched = (
            self._index.match(self._salts_for(tenant), data, (len(prompt) - 1) // self._bs)
            if prompt
            else []
        )
        blocks = [block for _, block in matched]
        held = self._tenant_blocks.get(tenant, {})
        self._check_block_quota(tenant, sum(1 for b in blocks if b not in held))

        available = {w: p.available for w, p in self._pools.items()}
        for block in blocks:
            if self._pools[block.worker_id].is_cached(block.index):
                available[block.worker_id] -= 1
        cached = len(blocks) * self._bs
        needed = max(1, -(-(len(prompt) - cached) // self._bs))
        home = choose_home(blocks[-1].worker_id if blocks else None, needed, available)

        tenant_blocks = self._tenant_blocks.setdefault(tenant, {})
        for block in blocks:
            self._pools[block.worker_id].incref(block.index)
            _ref(tenant_blocks, block)
        self._seqs[new_id] = Sequence(
            seq_id=new_id,
            tenant=tenant,
            tokens=prompt[:cached].tolist(),
            table=blocks,
            written=[cached] * self._num_layers,
            keys=[key for key, _ in matched],
            home=home,
        )
        self._tenant_seqs[tenant] = self._tenant_seqs.get(tenant, 0) + 1
        if prompt_token_ids is not None:
            self._counters.count_query(tenant, len(prompt), cached)
        return CreatedSequence(new_id, cached)

    def fork(self, tenant: str, seq_id: str, *, new_seq_id: str | None = None) -> str:
        """A new sequence sharing every block (and token, and written length) of `seq_id`.

        Args:
            new_seq_id: only for replaying a log: the id the fork got then.

        Returns:
            The fork's id.

        Raises:
            SequenceNotFound, SequenceLost, QuotaExceeded, InvalidRequest.
        """
        seq = self._resolve(tenant, seq_id)
        self._check_sequence_quota(tenant)
        new_id = self._new_id(new_seq_id)
        child = seq.copy_as(new_id)
        tenant_blocks = self._tenant_blocks[tenant]
        for block in child.table:
            self._pools[block.worker_id].incref(block.index)
            _ref(tenant_blocks, block)
        self._seqs[new_id] = child
        self._tenant_seqs[tenant] += 1
        return new_id

    def free(self, tenant: str, seq_id: str) -> None:
        """Release a sequence (or clear the tombstone of a lost one).

        Its blocks are released last block first, so when they stay cached-free the tail of
        a prefix is evicted before its head (a head without its tail is still useful).

        Raises:
            SequenceNotFound.
        """
        seq = self._seqs.get(seq_id) if isinstance(seq_id, str) else None
        if seq is not None and seq.tenant == tenant:
            tenant_blocks = self._tenant_blocks[tenant]
            for block in reversed(seq.table):
                self._release(block)
                _unref(tenant_blocks, block)
            self._forget(seq)
            return
        lost = self._lost.get(seq_id) if isinstance(seq_id, str) else None
        if lost is not None and lost.tenant == tenant:
            del self._lost[seq_id]
            return
        raise _not_found(seq_id)

    def sequence_info(self, tenant: str, seq_id: str) -> SequenceInfo:
        """Tokens, written lengths and placement of a sequence.

        Raises:
            SequenceNotFound, SequenceLost.
        """
        seq = self._resolve(tenant, seq_id)
        workers: dict[str, None] = {}
        for block in seq.table:
            workers.setdefault(block.worker_id)
        return SequenceInfo(
            seq_id=seq.seq_id,
            token_ids=tuple(seq.tokens),
            written=tuple(seq.written),
            num_blocks=len(seq.table),
            workers=tuple(workers),
        )

    def list_sequences(
        self, tenant: str, after: str = "", limit: int = 100
    ) -> tuple[list[SequenceSummary], bool]:
        """A page of the tenant's sequences, live and lost, in seq_id order.

        O(sequences of all tenants) per page: an occasional call (a client looking for
        sequences it lost track of), not a per-step one.

        Args:
            after: list ids greater than this one ("" from the start).
            limit: at most this many (>= 1).

        Returns:
            (the page, whether more follow).
        """
        ids = [s for s, seq in self._seqs.items() if seq.tenant == tenant and s > after]
        ids += [s for s, lost in self._lost.items() if lost.tenant == tenant and s > after]
        ids.sort()
        page = []
        for seq_id in ids[:limit]:
            seq = self._seqs.get(seq_id)
            if seq is None:
                page.append(SequenceSummary(seq_id, 0, (), True))
            else:
                page.append(SequenceSummary(seq_id, len(seq.tokens), tuple(seq.written), False))
        return page, len(ids) > limit

    def write_cursor(self, tenant: str, seq_id: str, layer: int | None) -> WriteCursor:
        """Where the next write of `layer` (None: all layers, whose lengths must be equal)
        starts and the token ids already reserved from there on; O(those positions), so a
        caller can check a write before `prepare_write` without copying the sequence.

        Raises:
            SequenceNotFound, SequenceLost, InvalidRequest (bad layer, unequal lengths).
        """
        seq = self._resolve(tenant, seq_id)
        start = self._start_of(seq, layer)
        return WriteCursor(start, tuple(seq.tokens[start:]))

    def unfinished_writes(self) -> list[SeqRef]:
        """Sequences holding reserved positions that no layer has written (a write that was
        prepared and neither committed nor cancelled), in creation order."""
        return [
            SeqRef(seq.tenant, seq.seq_id)
            for seq in self._seqs.values()
            if len(seq.tokens) > max(seq.written)
        ]

    # ---- writes -------------------------------------------------------------------------

    def prepare_write(
        self, tenant: str, seq_id: str, layer: int | None, token_ids: SequenceABC[int]
    ) -> WritePlan:
        """Slots for writing the K/V of `token_ids` at [written(layer), written(layer) + n).

        Positions already reserved (by an earlier write of another layer) must carry the same
        token ids; positions beyond are reserved now, one block at a time from the
        sequence's home worker, spilling to the worker with the most room. If the last block
        is partly filled and shared (a fork), it is first copied (copy-on-write). Nothing is
        committed: `commit_write` advances the written length once the worker wrote.

        Args:
            layer: the layer to write, or None for all layers (their lengths must be equal).
            token_ids: n >= 1 int64 token ids.

        Returns:
            WritePlan(start, slots [(worker_id, slot)] * n, copies to run first).

        Raises:
            SequenceNotFound, SequenceLost, InvalidRequest (bad layer or tokens, tokens that
            differ from reserved ones), QuotaExceeded, PoolExhausted (all or nothing: not
            enough blocks even after evicting every cached-free one).
        """
        seq = self._resolve(tenant, seq_id)
        start = self._start_of(seq, layer)
        tokens = pack_tokens(token_ids).tolist()
        n = len(tokens)
        if n == 0:
            raise InvalidRequest("token_ids is empty")
        bs = self._bs
        reserved = len(seq.tokens)
        end = start + n
        overlap = min(end, reserved) - start
        if overlap > 0 and seq.tokens[start : start + overlap] != tokens[:overlap]:
            for i in range(overlap):
                if seq.tokens[start + i] != tokens[i]:
                    raise InvalidRequest(
                        f"position {start + i} is reserved for token {seq.tokens[start + i]}, "
                        f"got {tokens[i]} (layer {layer})"
                    )
        copies: list[BlockCopy] = []
        table = seq.table
        if end > reserved:
            new_blocks = -(-end // bs) - len(table)
            cow_src: PhysicalBlock | None = None
            if reserved % bs:
                last = table[-1]
                if self._pools[last.worker_id].refcount(last.index) > 1:
                    cow_src = last
            if self._journal is not None:
                self._journal.steps.append(
                    _Undo(seq, reserved, len(table), table[-1] if table else None, seq.home, [])
                )
            if new_blocks or cow_src is not None:
                copies = self._grow(seq, new_blocks, cow_src)
            seq.tokens.extend(tokens[overlap:])
        if n == 1:
            block = table[start // bs]
            slots = [(block.worker_id, block.index * bs + start % bs)]
        else:
            slots = []
            for pos in range(start, end):
                block = table[pos // bs]
                slots.append((block.worker_id, block.index * bs + pos % bs))
        return WritePlan(start, slots, copies)

    def prepare_writes(
        self,
        tenant: str,
        layer: int | None,
        writes: SequenceABC[tuple[str, SequenceABC[int]]],
    ) -> list[WritePlan]:
        """`prepare_write` for several sequences of one tenant, all or nothing.

        Items are prepared in order (so an earlier one gets blocks first); when one fails,
        every earlier one is put back exactly as it was (blocks, free-list and LRU order,
        evicted prefix-index entries, counters) and the error is raised: a failed batch
        changes nothing, like every other failed call.

        Args:
            layer: the layer of every write, or None for all layers.
            writes: (seq_id, token_ids) per sequence; each sequence at most once.

        Returns:
            One WritePlan per item, in order.

        Raises:
            What prepare_write raises; InvalidRequest for an empty batch or a sequence
            named twice. PoolExhausted / QuotaExceeded name the failing item.
        """
        items = _batch_items(writes, "token_ids")
        if not items:
            raise InvalidRequest("writes is empty")
        journal = self._journal = _Journal(self._counters, self._released)
        plans: list[WritePlan] = []
        try:
            for i, (seq_id, token_ids) in enumerate(items):
                try:
                    plans.append(self.prepare_write(tenant, seq_id, layer, token_ids))
                except (PoolExhausted, QuotaExceeded) as exc:
                    raise type(exc)(
                        f"{exc} (write {i + 1} of {len(items)}, sequence {seq_id!r}; the "
                        "batch reserved nothing)"
                    ) from None
        except BaseException:
            self._journal = None
            self._roll_back(journal)
            raise
        self._journal = None
        for block in journal.evicted:
            self._index.remove_block(block)
            self._note_released(block)
        return plans

    def cancel_write(self, tenant: str, seq_id: str) -> CancelledWrite:
        """Release the positions reserved past the sequence's longest written layer: what
        a prepared write that will never be committed (its call failed) holds.

        The released positions' blocks (those past the ones holding written positions)
        leave the table, last first; blocks no one else references become free. Blocks
        holding written positions, a copy-on-write copy among them, stay; so do reserved
        positions in the partly written last block when a fork shares (or published) it.

        Returns:
            CancelledWrite(start, num_tokens, blocks) (num_tokens 0: nothing was reserved).

        Raises:
            SequenceNotFound, SequenceLost.
        """
        seq = self._resolve(tenant, seq_id)
        bs = self._bs
        start = max(seq.written)
        keep = -(-start // bs)
        if start % bs:
            last = seq.table[keep - 1]
            shared = self._pools[last.worker_id].refcount(last.index) > 1
            if shared or self._index.is_published(last):
                # Shared with a fork taken while this reservation was held (or written and
                # published by one): its other users hold these positions too, a block has
                # one fill, and published KV must not be overwritten with other tokens'.
                # They stay reserved: a write there must repeat their tokens.
                start = min(len(seq.tokens), keep * bs)
        num_tokens = len(seq.tokens) - start
        dropped = tuple(seq.table[keep:])
        if dropped:
            tenant_blocks = self._tenant_blocks[tenant]
            for block in reversed(dropped):
                self._release(block)
                _unref(tenant_blocks, block)
            seq.truncate_table(keep)
        del seq.tokens[start:]
        return CancelledWrite(start, num_tokens, dropped)

    def commit_write(self, tenant: str, seq_id: str, layer: int | None, num_tokens: int) -> None:
        """Advance written(layer) by `num_tokens` after the worker wrote them.

        Blocks that become full and written on every layer are published in the prefix
        index under the tenant's salt.

        Args:
            layer: the layer, or None for all layers (their lengths must be equal).
            num_tokens: >= 0; written(layer) + num_tokens may not pass the reserved length.

        Raises:
            SequenceNotFound, SequenceLost, InvalidRequest.
        """
        seq = self._resolve(tenant, seq_id)
        self._apply_commit(seq, layer, self._committed_length(seq, layer, num_tokens))

    def commit_writes(
        self, tenant: str, layer: int | None, writes: SequenceABC[tuple[str, int]]
    ) -> None:
        """`commit_write` of several sequences of one tenant on one layer, all or nothing:
        every write is checked before any is committed.

        Args:
            layer: the layer of every write, or None for all layers.
            writes: (seq_id, num_tokens) per sequence; each sequence at most once.

        Raises:
            What commit_write raises, naming the write; InvalidRequest for a sequence named
            twice.
        """
        items = _batch_items(writes, "num_tokens")
        checked: list[tuple[Sequence, int]] = []
        for i, (seq_id, num_tokens) in enumerate(items):
            try:
                seq = self._resolve(tenant, seq_id)
                checked.append((seq, self._committed_length(seq, layer, num_tokens)))
            except CacheError as exc:
                raise type(exc)(f"{exc} (write {i + 1} of {len(items)})") from None
        for seq, new in checked:
            self._apply_commit(seq, layer, new)

    def commit_repeated(self, snapshot: WriteSnapshot, layer: int) -> None:
        """`commit_writes` of the snapshot's writes on `layer` (snapshot.num_tokens per
        sequence), for a caller that had `repeatable(snapshot, layer, ...)` answer True
        and held the sequences' locks since: what `repeatable` checked (the same live
        sequences, `layer` written exactly up to the snapshot's starts, those positions
        reserved) still holds, so no sequence is looked up or checked again but that
        `layer` still stands at its start. All or nothing.

        Raises:
            InvalidRequest: a sequence's `layer` is no longer at the snapshot's start (the
                caller broke the contract); nothing was committed.
        """
        pairs = list(zip(snapshot.seqs, snapshot.starts, strict=True))
        for i, (seq, start) in enumerate(pairs):
            if seq.written[layer] != start:
                raise InvalidRequest(
                    f"layer {layer} of {snapshot.seq_ids[i]!r} stands at {seq.written[layer]}, "
                    f"not at the snapshot's {start}: check repeatable() under the same locks"
                )
        n = snapshot.num_tokens
        for seq, start in pairs:
            self._apply_commit(seq, layer, start + n)

    def _committed_length(self, seq: Sequence, layer: int | None, num_tokens: object) -> int:
        """written(layer) after committing `num_tokens` more, checked against the reserved
        positions."""
        if type(num_tokens) is not int or num_tokens < 0:
            raise InvalidRequest(f"num_tokens must be a non-negative int, got {num_tokens!r}")
        start = self._start_of(seq, layer)
        new = start + num_tokens
        reserved = len(seq.tokens)
        if new > reserved:
            raise InvalidRequest(
                f"layer {layer}: {start} written + {num_tokens} passes the {reserved} "
                "reserved tokens (prepare_write reserves them)"
            )
        return new

    def _apply_commit(self, seq: Sequence, layer: int | None, new: int) -> None:
        if layer is None:
            seq.written = [new] * self._num_layers
        else:
            seq.written[layer] = new
        # Blocks written on every layer get published: min(written) // block_size of them.
        # That minimum is at most `new`, so when `new` opens no block past the published
        # ones (most commits) there is nothing to publish and no need for the minimum.
        if new // self._bs > len(seq.keys):
            low = min(seq.written)
            if low // self._bs > len(seq.keys):
                self._publish(seq, low // self._bs)

    # ---- repeated writes (the other layers of a decode step) ----------------------------

    def snapshot_writes(
        self, tenant: str, seq_ids: SequenceABC[str], plans: SequenceABC[WritePlan]
    ) -> WriteSnapshot | None:
        """Remember a batch of one-layer writes that `prepare_writes` planned (and whose
        views the caller read through `block_ids`), so `repeatable` can tell when another
        layer's write of the same tokens would get the very same plan.

        Returns:
            The snapshot; None when the batch does not qualify: writes of unequal length,
            copy-on-write copies, or a sequence whose block ids were not read since its
            table last changed.

        Raises:
            SequenceNotFound, SequenceLost; InvalidRequest when seq_ids and plans differ
            in length.
        """
        if len(seq_ids) != len(plans):
            raise InvalidRequest(f"{len(seq_ids)} seq_ids for {len(plans)} write plans")
        if not plans:
            return None
        n = len(plans[0].slots)
        seqs: list[Sequence] = []
        rows: list[Any] = []
        for seq_id, plan in zip(seq_ids, plans, strict=True):
            seq = self._resolve(tenant, seq_id)
            row = seq.row
            if plan.copies or len(plan.slots) != n or row is None or not row.matches(seq.table):
                return None
            seqs.append(seq)
            rows.append(row)
        starts = tuple(plan.start for plan in plans)
        return WriteSnapshot(tenant, tuple(seq_ids), starts, n, tuple(seqs), tuple(rows))

    def repeatable(
        self, snapshot: WriteSnapshot, layer: int, token_ids: SequenceABC[object]
    ) -> bool:
        """Whether writing `token_ids` on `layer` now would be planned exactly as the
        snapshot's writes were: same slots, same block ids, nothing reserved or copied.

        True when, for every sequence of the snapshot: it is still the same live sequence,
        `layer` has written exactly up to the snapshot's start (so the write covers the
        same positions), those positions are reserved for these very token ids (int
        objects), and its block table changed only by growing since the snapshot (the
        block row is the same object and still mirrors the table, see
        cache_service.block_rows). Then `prepare_write` would reserve nothing (the
        positions are reserved), copy nothing (copy-on-write happens only when reserving)
        and compute the same slots from the unchanged leading blocks.

        Args:
            token_ids: the new tokens, snapshot.num_tokens per sequence, sequence by sequence.

        Read only; False for anything unusual (the caller plans from scratch then, and
        that path raises the precise error).
        """
        n = snapshot.num_tokens
        if (
            type(layer) is not int
            or not 0 <= layer < self._num_layers
            or len(token_ids) != n * len(snapshot.seq_ids)
        ):
            return False
        live = self._seqs
        for i, (seq_id, seq, row, start) in enumerate(
            zip(snapshot.seq_ids, snapshot.seqs, snapshot.rows, snapshot.starts, strict=True)
        ):
            if (
                live.get(seq_id) is not seq
                or seq.written[layer] != start
                or seq.row is not row
                or not row.matches(seq.table)
                or len(seq.tokens) < start + n
            ):
                return False
            if n == 1:
                token = token_ids[i]
                if type(token) is not int or seq.tokens[start] != token:
                    return False
            else:
                mine = token_ids[i * n : (i + 1) * n]
                if any(type(t) is not int for t in mine) or seq.tokens[start : start + n] != list(
                    mine
                ):
                    return False
        return True

    # ---- attention ----------------------------------------------------------------------

    def attention_view(self, tenant: str, seq_id: str, layer: int) -> SequenceView:
        """What attending over `layer` of the sequence reads: seq_len = written(layer) and
        the block table's runs per worker covering it.

        Raises:
            SequenceNotFound, SequenceLost, InvalidRequest (bad layer), LayerNotWritten.
        """
        seq = self._resolve(tenant, seq_id)
        seq_len = self._written_on(seq, layer, "attention_view")
        return SequenceView(seq_len, segments_of(seq.table, -(-seq_len // self._bs), self._bs))

    def written_length(self, tenant: str, seq_id: str, layer: int) -> int:
        """written(layer): the keys attending over `layer` reads (`attention_view`'s
        seq_len, without building the view).

        Raises:
            SequenceNotFound, SequenceLost, InvalidRequest (bad layer), LayerNotWritten.
        """
        return self._written_on(self._resolve(tenant, seq_id), layer, "written_length")

    def written_lengths(self, tenant: str, seq_id: str) -> tuple[int, ...]:
        """written(l) of every layer, O(layers) (no token ids copied).

        Raises:
            SequenceNotFound, SequenceLost.
        """
        return tuple(self._resolve(tenant, seq_id).written)

    def block_ids(self, tenant: str, seq_id: str, num_blocks: int) -> tuple[str, memoryview] | None:
        """The first `num_blocks` physical block indices of the sequence's table as a
        read-only view of packed int32 (``numpy.frombuffer(view, numpy.int32)`` reads it
        without a copy), with the worker holding them, when that whole table lives on one
        worker; None when it spans several (use `attention_view` then).

        What the attention hot path reads instead of `attention_view`: the ids are kept
        across calls and extended as the table grows (cache_service.block_rows), so this
        is O(1) rather than O(blocks). The view is a snapshot: later changes to the table
        never show through it.

        Raises:
            SequenceNotFound, SequenceLost, InvalidRequest (num_blocks outside
            [0, blocks in the table]).
        """
        seq = self._resolve(tenant, seq_id)
        row = seq.block_row()
        if type(num_blocks) is not int or not 0 <= num_blocks <= row.n:
            raise InvalidRequest(
                f"num_blocks must be an int in [0, {row.n}] for sequence {seq_id!r}, got "
                f"{num_blocks!r}"
            )
        if row.mixed or row.worker is None:
            return None
        return row.worker, row.ids(num_blocks)

    # ---- prefix cache -------------------------------------------------------------------

    def lookup(self, tenant: str, token_ids: SequenceABC[int]) -> int:
        """Tokens of this prompt that `create_sequence` would adopt right now (same cap).

        No side effects: nothing is counted, nothing moves in the LRU.
        """
        _check_name("tenant", tenant)
        prompt = pack_tokens(token_ids)
        data = token_bytes(prompt)
        if not prompt:
            return 0
        matched = self._index.match(self._salts_for(tenant), data, (len(prompt) - 1) // self._bs)
        return len(matched) * self._bs

    def pin(self, tenant: str, token_ids: SequenceABC[int]) -> int:
        """Keep the cached full blocks of this prefix from eviction until `unpin`.

        Pins the longest chain of cached blocks of token_ids' full blocks (no cap: the
        whole prefix may be pinned). Pins of the same prefix by the same tenant nest.
        Pinned blocks count as used; they do not count against the tenant's block quota.

        Returns:
            Tokens pinned (0 if none of it is cached; nothing is recorded then).
        """
        _check_name("tenant", tenant)
        prompt = pack_tokens(token_ids)
        data = token_bytes(prompt)
        full = len(prompt) // self._bs
        key = (tenant, data[: full * self._bs * TOKEN_BYTES])
        pin = self._pins.get(key)
        if pin is None:
            matched = self._index.match(self._salts_for(tenant), data, full)
            if not matched:
                return 0
            pin = self._pins[key] = Pin([block for _, block in matched], 0)
        for block in pin.blocks:
            self._pools[block.worker_id].incref(block.index)
            self._pinned[block] = self._pinned.get(block, 0) + 1
        pin.count += 1
        return len(pin.blocks) * self._bs

    def unpin(self, tenant: str, token_ids: SequenceABC[int]) -> None:
        """Undo one `pin` of the same prefix by the same tenant.

        Raises:
            InvalidRequest: this tenant holds no pin of this prefix.
        """
        _check_name("tenant", tenant)
        prompt = pack_tokens(token_ids)
        data = token_bytes(prompt)
        key = (tenant, data[: (len(prompt) // self._bs) * self._bs * TOKEN_BYTES])
        pin = self._pins.get(key)
        if pin is None:
            raise InvalidRequest(
                f"tenant {tenant!r} holds no pin of this {len(prompt)}-token prefix"
            )
        # Tail first, as in `free`: the head of a prefix outlives its tail in the LRU.
        for block in reversed(pin.blocks):
            self._release(block)
            _unref(self._pinned, block)
        pin.count -= 1
        if pin.count == 0:
            del self._pins[key]

    def publish_public(self, tenant: str, seq_id: str) -> int:
        """Make the sequence's published blocks (full, every layer written) findable by
        every tenant, keyed under the shared public salt.

        Returns:
            Blocks newly published as public.

        Raises:
            SequenceNotFound, SequenceLost.
        """
        seq = self._resolve(tenant, seq_id)
        stride = self._bs * TOKEN_BYTES
        data = encode_tokens(seq.tokens[: len(seq.keys) * self._bs])
        parent = ROOT_KEY
        added = 0
        for i in range(len(seq.keys)):
            chunk = data[i * stride : (i + 1) * stride]
            key = block_key(parent, self._public.salt, chunk)
            added += self._index.publish(key, IndexEntry(seq.table[i], parent, None, chunk))
            parent = key
        return added

    def set_tenant_quota(
        self, tenant: str, max_blocks: int | None = None, max_sequences: int | None = None
    ) -> None:
        """Give `tenant` its own limits (None: the config-wide default for that limit).

        Both None removes the tenant's own quota. A limit below the current usage refuses
        new blocks or sequences until usage drops under it; nothing held is taken away.

        Raises:
            InvalidRequest: bad tenant name, or a limit that is not None or a positive int.
        """
        _check_name("tenant", tenant)
        for name, value in (("max_blocks", max_blocks), ("max_sequences", max_sequences)):
            if value is not None and (type(value) is not int or value < 1):
                raise InvalidRequest(f"{name} must be None or a positive int, got {value!r}")
        if max_blocks is None and max_sequences is None:
            self._quotas.pop(tenant, None)
        else:
            self._quotas[tenant] = TenantQuota(max_blocks, max_sequences)

    def tenant_quotas(self) -> dict[str, TenantQuota]:
        """Tenants with their own quota (see `set_tenant_quota`), in the order set."""
        return dict(self._quotas)

    def take_released(self) -> dict[str, list[int]]:
        """Blocks that went free since the last call, per worker, and forget them.

        Free means unreferenced and not findable: a block that stays cached-free (still in
        the prefix index) is never listed, because a later prompt may adopt its KV. A
        cached-free block evicted to be reused at once is listed, so a worker can poison it
        (debug pools) before the new owner writes it. Blocks of a lost worker are dropped.
        Not logged and not part of snapshots.
        """
        released, self._released = self._released, {}
        return released

    def evict(self, max_blocks: int | None = None, worker_id: str | None = None) -> int:
        """Reclaim cached-free blocks now, least recently released first.

        Args:
            max_blocks: at most this many (None: all of them).
            worker_id: only on this worker (None: every worker, in the order added).

        Returns:
            Blocks evicted.
        """
        if max_blocks is not None and (type(max_blocks) is not int or max_blocks < 0):
            raise InvalidRequest(f"max_blocks must be None or an int >= 0, got {max_blocks!r}")
        if worker_id is not None and worker_id not in self._pools:
            raise InvalidRequest(f"unknown worker {worker_id!r}")
        pools = [self._pools[worker_id]] if worker_id is not None else self._pools.values()
        left = max_blocks
        evicted = 0
        for pool in pools:
            while left is None or left > 0:
                index = pool.evict_oldest()
                if index is None:
                    break
                block = PhysicalBlock(pool.worker_id, index)
                self._index.remove_block(block)
                self._note_released(block)
                evicted += 1
                if left is not None:
                    left -= 1
        self._counters.evictions += evicted
        return evicted

    # ---- accounting ---------------------------------------------------------------------

    def stats(self) -> CacheStats:
        """An exact snapshot of pools, fragmentation, prefix hits and event counters."""
        return collect_stats(
            self._pools, self._seqs, self._pinned, self._counters, self._bs, len(self._lost)
        )

    def check_integrity(self) -> None:
        """Verify every invariant; raise IntegrityError naming each that fails.

        Checked: each block is free xor cached-free xor used; reference counts equal table
        plus pin references; cached-free blocks are exactly the unreferenced published
        ones; index entries point at live blocks whose users hold exactly the entry's tokens
        and chain to a consistent parent; every slot holds one token (users of a block agree
        on its tokens); table lengths match reserved tokens; tenant counts and stats agree
        with a recount.
        """
        from cache_service.control_integrity import check_integrity

        check_integrity(self)

    # ---- snapshots ----------------------------------------------------------------------

    def to_records(self) -> dict[str, Any]:
        """The whole state as plain JSON-able data (see control_records.py)."""
        from cache_service.control_records import to_records

        return to_records(self)

    @classmethod
    def from_records(cls, records: dict[str, Any]) -> BlockManager:
        """Rebuild a manager from `to_records()` output; the result passes check_integrity.

        Raises:
            InvalidRequest: malformed or inconsistent records.
        """
        from cache_service.control_records import from_records

        return from_records(cls, records)

    # ---- internals ----------------------------------------------------------------------

    def _resolve(self, tenant: str, seq_id: str) -> Sequence:
        seq = self._seqs.get(seq_id) if isinstance(seq_id, str) else None
        if seq is not None and seq.tenant == tenant:
            return seq
        lost = self._lost.get(seq_id) if isinstance(seq_id, str) else None
        if lost is not None and lost.tenant == tenant:
            raise SequenceLost(
                f"sequence {seq_id!r} lost its KV blocks with worker {lost.worker_id!r}; "
                "free it and recompute"
            )
        raise _not_found(seq_id)

    def _written_on(self, seq: Sequence, layer: int, caller: str) -> int:
        """written(layer) of a resolved sequence, refusing None, a bad layer and nothing
        written (what attending over one layer needs)."""
        if layer is None:
            raise InvalidRequest(f"{caller} needs one layer, got None")
        self._check_layer(layer)
        seq_len = seq.written[layer]
        if seq_len == 0:
            raise LayerNotWritten(f"layer {layer} of sequence {seq.seq_id!r} has nothing written")
        return seq_len

    def _check_layer(self, layer: object) -> None:
        if type(layer) is not int or not 0 <= layer < self._num_layers:
            raise InvalidRequest(
                f"layer must be an int in [0, {self._num_layers}) or None, got {layer!r}"
            )

    def _start_of(self, seq: Sequence, layer: int | None) -> int:
        written = seq.written
        if layer is None:
            first = written[0]
            if written.count(first) != len(written):
                raise InvalidRequest(
                    "layer=None needs every layer's written length equal, got "
                    f"min {min(written)} max {max(written)}"
                )
            return first
        self._check_layer(layer)
        return written[layer]

    def _salts_for(self, tenant: str) -> tuple[Salt, Salt]:
        salts = self._salts.get(tenant)
        if salts is None:
            salts = (make_salt(tenant, self.config.layout_fingerprint), self._public)
            self._salts[tenant] = salts
        return salts

    def _new_id(self, requested: str | None) -> str:
        if requested is None:
            while True:
                new_id = secrets.token_urlsafe(16)
                if new_id not in self._seqs and new_id not in self._lost:
                    return new_id
        _check_name("seq_id", requested)
        if requested in self._seqs or requested in self._lost:
            raise InvalidRequest(f"sequence id {requested!r} is already in use")
        return requested

    def _check_sequence_quota(self, tenant: str) -> None:
        own = self._quotas.get(tenant)
        quota = own.max_sequences if own is not None else None
        if quota is None:
            quota = self.config.tenant_quota_sequences
        if quota is not None and self._tenant_seqs.get(tenant, 0) >= quota:
            live = self._tenant_seqs.get(tenant, 0)
            raise QuotaExceeded(
                f"tenant {tenant!r} has {live} live sequences, its quota is {quota} sequences"
            )

    def _check_block_quota(self, tenant: str, new_blocks: int) -> None:
        own = self._quotas.get(tenant)
        quota = own.max_blocks if own is not None else None
        if quota is None:
            quota = self.config.tenant_quota_blocks
        if quota is not None and new_blocks > 0:
            held = len(self._tenant_blocks.get(tenant, ()))
            if held + new_blocks > quota:
                raise QuotaExceeded(
                    f"tenant {tenant!r} holds {held} blocks; {new_blocks} more would pass its "
                    f"quota of {quota}"
                )

    def _take(self, worker_id: str) -> PhysicalBlock:
        index, evicted = self._pools[worker_id].take()
        block = PhysicalBlock(worker_id, index)
        journal = self._journal
        if journal is not None:
            journal.steps[-1].taken.append((block, evicted))
        if evicted:
            self._counters.evictions += 1
            if journal is not None:
                journal.evicted.append(block)  # dropped from the index if the batch succeeds
            else:
                self._index.remove_block(block)
                self._note_released(block)
        return block

    def _release(self, block: PhysicalBlock) -> None:
        pool = self._pools[block.worker_id]
        keep = self._index.is_published(block)
        pool.decref(block.index, keep)
        if not keep and pool.refcount(block.index) == 0:
            self._note_released(block)

    def _note_released(self, block: PhysicalBlock) -> None:
        self._released.setdefault(block.worker_id, []).append(block.index)

    def _roll_back(self, journal: _Journal) -> None:
        """Undo every step of a failed batch, last first (see _Journal)."""
        for step in reversed(journal.steps):
            seq = step.seq
            tenant_blocks = self._tenant_blocks[seq.tenant]
            for block, evicted in reversed(step.taken):
                self._pools[block.worker_id].untake(block.index, evicted)
                _unref(tenant_blocks, block)
            if step.cow_src is not None:
                self._pools[step.cow_src.worker_id].incref(step.cow_src.index)
                _ref(tenant_blocks, step.cow_src)
            del seq.tokens[step.tokens :]
            seq.truncate_table(step.table)
            if step.last is not None:
                seq.replace_last_block(step.last)
            seq.home = step.home
        self._counters.evictions = journal.evictions
        self._counters.cow_copies = journal.cow_copies
        for worker_id in list(self._released):
            kept = journal.released.get(worker_id, 0)
            if kept:
                del self._released[worker_id][kept:]
            else:
                del self._released[worker_id]

    def _forget(self, seq: Sequence) -> None:
        del self._seqs[seq.seq_id]
        left = self._tenant_seqs[seq.tenant] - 1
        if left:
            self._tenant_seqs[seq.tenant] = left
        else:
            # Its last sequence is gone, so it references no block any more.
            del self._tenant_seqs[seq.tenant]
            del self._tenant_blocks[seq.tenant]

    def _grow(
        self, seq: Sequence, new_blocks: int, cow_src: PhysicalBlock | None
    ) -> list[BlockCopy]:
        """Reserve `new_blocks` more blocks, and a copy of `cow_src` (the sequence's shared,
        partly filled last block) if given; all or nothing. Returns the copies to run."""
        tenant_blocks = self._tenant_blocks[seq.tenant]
        delta = new_blocks
        if cow_src is not None:
            # The copy is a new block for the tenant; the source stops counting only if no
            # other of its sequences still uses it.
            delta += 0 if tenant_blocks[cow_src] == 1 else 1
        self._check_block_quota(seq.tenant, delta)

        home = seq.home
        home_pool = self._pools.get(home) if home is not None else None
        if cow_src is None and home_pool is not None and home_pool.available >= new_blocks:
            plan = [(home, new_blocks)] if new_blocks else []
        else:
            available = {w: p.available for w, p in self._pools.items()}
            if cow_src is not None:
                # A copy runs inside one worker, so the copy lives where its source does.
                if available[cow_src.worker_id] < 1:
                    raise PoolExhausted(
                        f"copy-on-write of a shared block needs a free block on worker "
                        f"{cow_src.worker_id!r}, which has none"
                    )
                available[cow_src.worker_id] -= 1
            growth = plan_growth(home, new_blocks, available) if new_blocks else []
            if growth is None:
                raise PoolExhausted(
                    f"need {new_blocks} more blocks; {sum(available.values())} free or "
                    f"evictable across {len(available)} workers"
                )
            plan = growth

        copies: list[BlockCopy] = []
        if cow_src is not None:
            dst = self._take(cow_src.worker_id)
            copies.append(BlockCopy(cow_src.worker_id, cow_src.index, dst.index))
            seq.replace_last_block(dst)
            self._release(cow_src)
            _unref(tenant_blocks, cow_src)
            if self._journal is not None:
                self._journal.steps[-1].cow_src = cow_src
            tenant_blocks[dst] = 1
            self._counters.cow_copies += 1
        table = seq.table
        for worker_id, count in plan:
            for _ in range(count):
                block = self._take(worker_id)
                table.append(block)
                tenant_blocks[block] = 1
            seq.home = worker_id
        return copies

    def _publish(self, seq: Sequence, upto: int) -> None:
        """Publish blocks len(seq.keys) .. upto-1 of `seq` under its tenant's salt."""
        salt = self._salts_for(seq.tenant)[0].salt
        keys = seq.keys
        bs = self._bs
        parent = keys[-1] if keys else ROOT_KEY
        for i in range(len(keys), upto):
            chunk = encode_tokens(seq.tokens[i * bs : (i + 1) * bs])
            key = block_key(parent, salt, chunk)
            self._index.publish(key, IndexEntry(seq.table[i], parent, seq.tenant, chunk))
            keys.append(key)
            parent = key


def _check_name(what: str, value: object) -> None:
    if not isinstance(value, str) or not value or len(value) > _MAX_NAME:
        raise InvalidRequest(f"{what} must be a non-empty str of at most {_MAX_NAME} characters")


def _batch_items(writes: SequenceABC[Any], second: str) -> list[tuple[Any, Any]]:
    """A batch of ``(seq_id, <second>)`` pairs as a list, each sequence at most once.

    Raises:
        InvalidRequest: an item that is not a pair, a seq_id that is not a str, a sequence
            named twice.
    """
    items = list(writes)
    seen: set[str] = set()
    for item in items:
        if not isinstance(item, tuple | list) or len(item) != 2:
            raise InvalidRequest(f"each write must be a (seq_id, {second}) pair")
        if not isinstance(item[0], str):
            raise InvalidRequest("each write's seq_id must be a str")
        if item[0] in seen:
            raise InvalidRequest(f"sequence {item[0]!r} appears twice in one batch")
        seen.add(item[0])
    return items


def _not_found(seq_id: object) -> SequenceNotFound:
    # One message for unknown ids and ids of other tenants: nothing to probe.
    shown = seq_id if isinstance(seq_id, str) and len(seq_id) <= _MAX_NAME else "<invalid>"
    return SequenceNotFound(f"no sequence {shown!r} for this tenant")


def _ref(counts: dict[PhysicalBlock, int], block: PhysicalBlock) -> None:
    counts[block] = counts.get(block, 0) + 1


def _unref(counts: dict[PhysicalBlock, int], block: PhysicalBlock) -> None:
    left = counts[block] - 1
    if left:
        counts[block] = left
    else:
        del counts[block]
