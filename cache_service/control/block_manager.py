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
from typing import Any

from cache_service.control import (
    host_tier,
    pins,
    prefix_sharing,
    quotas,
    repeated_writes,
    validation,
    worker_loss,
    write_path,
)
from cache_service.control.accounting import CacheCounters, CacheStats, WorkerStats, collect_stats
from cache_service.control.block_pool import BlockPool
from cache_service.control.eviction import make_policy
from cache_service.control.integrity import check_integrity
from cache_service.control.kv_events import KvEventLog
from cache_service.control.placement import choose_home
from cache_service.control.prefix_index import (
    PrefixIndex,
    Salt,
    make_salt,
    pack_tokens,
    token_bytes,
)
from cache_service.control.prefix_sharing import publish
from cache_service.control.quotas import ref as _ref
from cache_service.control.quotas import unref as _unref
from cache_service.control.records import from_records, to_records
from cache_service.control.repeated_writes import WriteSnapshot
from cache_service.control.sequence import PENDING_TOKEN, Sequence, segments_of
from cache_service.control.state import BlockManagerConfig, LostSequence, Pin
from cache_service.control.types import (
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
from cache_service.control.validation import MAX_NAMESPACE as MAX_NAMESPACE
from cache_service.control.validation import check_name as _check_name
from cache_service.control.validation import check_namespace
from cache_service.control.validation import not_found as _not_found
from cache_service.control.write_journal import Journal
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
        # What the index gains and loses, numbered for subscribers (KV events).
        self.events = KvEventLog()
        self._index.events = self.events
        self._seqs: dict[str, Sequence] = {}
        self._lost: dict[str, LostSequence] = {}
        # Per tenant: block -> how many of the tenant's table entries reference it. Its
        # length is what the block quota limits.
        self._tenant_blocks: dict[str, dict[PhysicalBlock, int]] = {}
        self._tenant_seqs: dict[str, int] = {}
        self._pins: dict[tuple[str, str, bytes], Pin] = {}
        self._pinned: dict[PhysicalBlock, int] = {}
        self._counters = CacheCounters()
        self._public = make_salt(None, config.layout_fingerprint)
        self._salts: dict[tuple[str, str], tuple[Salt, Salt]] = {}
        self._quotas: dict[str, TenantQuota] = {}
        # Blocks that went free (or were evicted for reuse) since the last
        # `take_released`, per worker: the workers poison them in debug mode. Not part of
        # the durable state: a release that never reached a worker costs only that check.
        self._released: dict[str, list[int]] = {}
        self._journal: Journal | None = None
        # Prefix blocks that left the GPU pools for their workers' host memory.
        self._host = host_tier.HostTier(config.eviction_policy)

    # ---- workers ------------------------------------------------------------------------

    def add_worker(self, worker_id: str, num_blocks: int, host_blocks: int = 0) -> None:
        """Register a worker's pool of `num_blocks` empty blocks, with a host tier of
        `host_blocks` empty host blocks (0: none; see cache_service.control.host_tier).

        Raises:
            InvalidRequest: bad id or size, or the id is already registered.
        """
        _check_name("worker_id", worker_id)
        if worker_id in self._pools:
            raise InvalidRequest(f"worker {worker_id!r} is already registered")
        pool = BlockPool(worker_id, num_blocks, make_policy(self.config.eviction_policy))
        self._host.add_worker(worker_id, host_blocks)
        self._pools[worker_id] = pool

    def host_tiers(self) -> dict[str, int]:
        """Host tier size in blocks of every worker that has one."""
        return {w: p.num_blocks for w, p in self._host.pools.items()}

    def take_tier_moves(self) -> dict[str, list[host_tier.TierMove]]:
        """Copies between GPU pools and host tiers decided since the last call, per worker
        in the order decided, and forget them. The caller runs each worker's offloads,
        then its releases (`take_released`), then its restores, before any later call on
        that worker. Not logged and not part of snapshots (see `drop_host_tier`)."""
        return self._host.take_moves()

    def drop_host_tier(self) -> int:
        """Forget every host tier's contents (sizes stay): what a recovered coordinator
        does, since a logged offload may never have reached its worker. Returns the
        prefix keys dropped (reported removed from the "cpu" medium)."""
        return host_tier.drop_all(self)

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
        return worker_loss.lose_worker(self, worker_id)

    # ---- sequences ----------------------------------------------------------------------

    def create_sequence(
        self,
        tenant: str,
        prompt_token_ids: SequenceABC[int] | None = None,
        *,
        seq_id: str | None = None,
        namespace: str = "",
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
            namespace: prefix-cache namespace (model identity): only blocks published in
                the same namespace are adopted, and the sequence publishes into it.

        Returns:
            CreatedSequence(seq_id, num_cached_tokens).

        Raises:
            InvalidRequest, QuotaExceeded, PoolExhausted (no worker registered).
        """
        _check_name("tenant", tenant)
        check_namespace(namespace)
        if prompt_token_ids is None:
            prompt = array("Q")
            data = b""
        else:
            prompt = pack_tokens(prompt_token_ids)
            self._check_length("prompt_token_ids", len(prompt))
            data = token_bytes(prompt)
        self._check_sequence_quota(tenant)
        new_id = self._new_id(seq_id)
        if not self._pools:
            raise PoolExhausted("no worker is registered")
        matched = prefix_sharing.match_prompt(self, tenant, namespace, prompt, data)
        held = self._tenant_blocks.get(tenant, {})
        # A host block restored becomes a new block for the tenant.
        self._check_block_quota(
            tenant,
            sum(1 for _, b in matched if type(b) is not PhysicalBlock or b not in held),
        )
        cached = len(matched) * self._bs
        home = self._home_for([b for _, b in matched], len(prompt))
        blocks, restored = prefix_sharing.adopt(self, tenant, matched)
        self._seqs[new_id] = Sequence(
            seq_id=new_id,
            tenant=tenant,
            tokens=prompt[:cached].tolist(),
            table=blocks,
            written=[cached] * self._num_layers,
            keys=[key for key, _ in matched],
            home=home,
            namespace=namespace,
        )
        self._tenant_seqs[tenant] = self._tenant_seqs.get(tenant, 0) + 1
        if prompt_token_ids is not None:
            self._counters.count_query(tenant, len(prompt), cached)
            self._counters.host_hit_tokens += restored * self._bs
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

        Its blocks are released last block first, so when they stay cached-free an
        order-of-release policy (LRU) evicts the tail of a prefix before its head (a head
        without its tail is still useful).

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
        tokens = seq.tokens
        if tokens and tokens[-1] == PENDING_TOKEN:
            # Positions reserved ahead by a lease whose tokens are to come: not tokens yet.
            tokens = tokens[: tokens.index(PENDING_TOKEN)]
        return SequenceInfo(
            seq_id=seq.seq_id,
            token_ids=tuple(tokens),
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
        return write_path.prepare_write(self, tenant, seq_id, layer, token_ids)

    def prepare_writes(
        self,
        tenant: str,
        layer: int | None,
        writes: SequenceABC[tuple[str, SequenceABC[int]]],
        ahead: int = 0,
    ) -> list[WritePlan]:
        """`prepare_write` for several sequences of one tenant, all or nothing.

        Items are prepared in order (so an earlier one gets blocks first); when one fails,
        every earlier one is put back exactly as it was (blocks, free-list and eviction order,
        evicted prefix-index entries, counters) and the error is raised: a failed batch
        changes nothing, like every other failed call.

        Args:
            layer: the layer of every write, or None for all layers.
            writes: (seq_id, token_ids) per sequence; each sequence at most once.
            ahead: positions each write reserves past its tokens, whose tokens are to
                come (a multi-step lease's later decode steps): their slots end each
                plan; `fill_pending` names their tokens before they are committed, and
                `cancel_write` gives back those never written. Only at a sequence's end
                (no position reserved past the write's tokens).

        Returns:
            One WritePlan per item, in order (n + ahead slots each).

        Raises:
            What prepare_write raises; InvalidRequest for an empty batch, a sequence
            named twice or positions ahead asked for inside a reservation.
            PoolExhausted / QuotaExceeded name the failing item.
        """
        return write_path.prepare_writes(self, tenant, layer, writes, ahead)

    def fill_pending(
        self, tenant: str, fills: SequenceABC[tuple[str, int, SequenceABC[int]]]
    ) -> None:
        """Name the tokens of positions reserved ahead (`prepare_writes`' `ahead`), all or
        nothing: every fill is checked before any is applied.

        Args:
            fills: (seq_id, first position, token ids) per sequence, each at most once;
                every position must be reserved and still pending.

        Raises:
            SequenceNotFound, SequenceLost; InvalidRequest (a position outside the
            reservation or not pending, bad token ids, a sequence named twice).
        """
        write_path.fill_pending(self, tenant, fills)

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
        return write_path.cancel_write(self, tenant, seq_id)

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
        write_path.commit_writes(self, tenant, layer, writes)

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
        repeated_writes.commit_repeated(self, snapshot, layer)

    def commit_repeated_layers(self, snapshot: WriteSnapshot, layers: SequenceABC[int]) -> None:
        """`commit_repeated` of each of `layers` (distinct), in order, all or nothing: every
        layer is checked before any is committed. What a step lease's end commits: the
        layers the lease wrote.

        Raises:
            InvalidRequest: a layer named twice, or a sequence's layer no longer at the
                snapshot's start; nothing was committed.
        """
        repeated_writes.commit_repeated_layers(self, snapshot, layers)

    def commit_steps(self, snapshot: WriteSnapshot, steps: int, layers: SequenceABC[int]) -> None:
        """What a multi-step lease's end commits: every layer of every sequence advances
        `steps` positions from the snapshot's starts (decode steps written on all
        layers), then each of `layers` (distinct) one more (the step that ended part way).
        The caller holds the sequences' locks since the snapshot and filled the positions'
        tokens (`fill_pending`). All or nothing.

        Raises:
            InvalidRequest: `steps` negative, a layer named twice or outside the layout,
                more positions than reserved, or a sequence's layer no longer at the
                snapshot's start; nothing was committed.
        """
        repeated_writes.commit_steps(self, snapshot, steps, layers)

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
        self._publish_written(seq, new)

    def _publish_written(self, seq: Sequence, new: int) -> None:
        """Publish the blocks `seq` now holds on every layer, after a commit that set some
        layers' written length to `new`."""
        # Blocks written on every layer get published: min(written) // block_size of them.
        # That minimum is at most `new`, so when `new` opens no block past the published
        # ones (most commits) there is nothing to publish and no need for the minimum.
        if new // self._bs > len(seq.keys):
            low = min(seq.written)
            if low // self._bs > len(seq.keys):
                publish(self, seq, low // self._bs)

    # ---- repeated writes (the other layers of a decode step) ----------------------------

    def snapshot_writes(
        self,
        tenant: str,
        seq_ids: SequenceABC[str],
        plans: SequenceABC[WritePlan],
        ragged: bool = False,
    ) -> WriteSnapshot | None:
        """Remember a batch of one-layer writes that `prepare_writes` planned (and whose
        views the caller read through `block_ids`), so `repeatable` can tell when another
        layer's write of the same tokens would get the very same plan.

        ragged: writes of unequal lengths qualify too (a step leased whole, never
            `repeatable`).

        Returns:
            The snapshot; None when the batch does not qualify: writes of unequal length,
            copy-on-write copies, or a sequence whose block ids were not read since its
            table last changed.

        Raises:
            SequenceNotFound, SequenceLost; InvalidRequest when seq_ids and plans differ
            in length.
        """
        return repeated_writes.snapshot_writes(self, tenant, seq_ids, plans, ragged)

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
        cache_service.control.block_rows). Then `prepare_write` would reserve nothing (the
        positions are reserved), copy nothing (copy-on-write happens only when reserving)
        and compute the same slots from the unchanged leading blocks.

        Args:
            token_ids: the new tokens, snapshot.num_tokens per sequence, sequence by sequence.

        Read only; False for anything unusual (the caller plans from scratch then, and
        that path raises the precise error).
        """
        return repeated_writes.repeatable(self, snapshot, layer, token_ids)

    def repeatable_layers(self, snapshot: WriteSnapshot) -> list[int]:
        """The layers on which writing the snapshot's own tokens again would be planned
        exactly as the snapshot's writes were (`repeatable` with its reserved tokens):
        every layer still written up to the snapshot's starts, ascending; [] when a
        sequence changed (freed, its table replaced). Read only."""
        return repeated_writes.repeatable_layers(self, snapshot)

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
        across calls and extended as the table grows (cache_service.control.block_rows), so this
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

    def max_sequence_tokens(self) -> int:
        """The most tokens one sequence could ever hold: every block of every registered
        worker (a sequence spills across workers), times block_size; 0 with no worker."""
        return sum(p.num_blocks for p in self._pools.values()) * self._bs

    # ---- prefix cache -------------------------------------------------------------------

    def lookup(self, tenant: str, token_ids: SequenceABC[int], namespace: str = "") -> int:
        """Tokens of this prompt that `create_sequence` would adopt right now (same cap).

        No side effects: nothing is counted, no block's eviction order changes.
        """
        return prefix_sharing.lookup(self, tenant, token_ids, namespace)

    def pin(self, tenant: str, token_ids: SequenceABC[int], namespace: str = "") -> int:
        """Keep the cached full blocks of this prefix from eviction until `unpin`.

        Pins the longest chain of cached blocks of token_ids' full blocks (no cap: the
        whole prefix may be pinned). Pins of the same prefix by the same tenant nest.
        Pinned blocks count as used; they do not count against the tenant's block quota.

        Returns:
            Tokens pinned (0 if none of it is cached; nothing is recorded then).
        """
        return pins.pin(self, tenant, token_ids, namespace)

    def unpin(self, tenant: str, token_ids: SequenceABC[int], namespace: str = "") -> None:
        """Undo one `pin` of the same prefix by the same tenant.

        Raises:
            InvalidRequest: this tenant holds no pin of this prefix.
        """
        pins.unpin(self, tenant, token_ids, namespace)

    def publish_public(self, tenant: str, seq_id: str) -> int:
        """Make the sequence's published blocks (full, every layer written) findable by
        every tenant, keyed under the shared public salt.

        Returns:
            Blocks newly published as public.

        Raises:
            SequenceNotFound, SequenceLost.
        """
        return prefix_sharing.publish_public(self, tenant, seq_id)

    def set_tenant_quota(
        self, tenant: str, max_blocks: int | None = None, max_sequences: int | None = None
    ) -> None:
        """Give `tenant` its own limits (None: the config-wide default for that limit).

        Both None removes the tenant's own quota. A limit below the current usage refuses
        new blocks or sequences until usage drops under it; nothing held is taken away.

        Raises:
            InvalidRequest: bad tenant name, or a limit that is not None or a positive int.
        """
        quotas.set_tenant_quota(self, tenant, max_blocks, max_sequences)

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
        """Reclaim cached-free blocks now, in each pool's eviction order.

        Args:
            max_blocks: at most this many (None: all of them).
            worker_id: only on this worker (None: every worker, in the order added).

        Returns:
            Blocks evicted.
        """
        return prefix_sharing.evict(self, max_blocks, worker_id)

    def attach_events(self, events: KvEventLog) -> None:
        """Report the index's changes to `events` from now on (recovery continues the log
        its checkpoint carried)."""
        if not isinstance(events, KvEventLog):
            raise TypeError(f"events must be a KvEventLog, got {type(events).__name__}")
        self.events = events
        self._index.events = events

    # ---- accounting ---------------------------------------------------------------------

    def stats(self) -> CacheStats:
        """An exact snapshot of pools, fragmentation, prefix hits and event counters."""
        return collect_stats(
            self._pools,
            self._seqs,
            self._pinned,
            self._counters,
            self._bs,
            len(self._lost),
            self._host,
        )

    def check_integrity(self) -> None:
        """Verify every invariant; raise IntegrityError naming each that fails.

        Checked: each block is free xor cached-free xor used; reference counts equal table
        plus pin references; cached-free blocks are exactly the unreferenced published
        ones; index entries point at live blocks whose users hold exactly the entry's tokens
        and chain to a consistent parent; every slot holds one token (users of a block agree
        on its tokens); table lengths match reserved tokens; tenant counts and stats agree
        with a recount; every host tier block is free xor holds one evicted block's keys,
        and no key is in both tiers.
        """
        check_integrity(self)

    # ---- snapshots ----------------------------------------------------------------------

    def to_records(self) -> dict[str, Any]:
        """The whole state as plain JSON-able data (see cache_service/control/records.py)."""
        return to_records(self)

    @classmethod
    def from_records(cls, records: dict[str, Any]) -> BlockManager:
        """Rebuild a manager from `to_records()` output; the result passes check_integrity.

        Raises:
            InvalidRequest: malformed or inconsistent records.
        """
        return from_records(cls, records)

    # ---- internals ----------------------------------------------------------------------

    # Checks and lookups that live with their subject, bound here as methods (no extra call).
    _resolve = validation.resolve
    _written_on = validation.written_on
    _check_layer = validation.check_layer
    _start_of = validation.start_of
    _check_length = validation.check_length
    _check_sequence_quota = quotas.check_sequence_quota
    _check_block_quota = quotas.check_block_quota
    _salts_for = prefix_sharing.salts_for

    def _home_for(self, adopted: list[Any], prompt_len: int) -> str | None:
        """Home worker of a new sequence adopting `adopted` (before they are adopted) for
        a prompt of `prompt_len` tokens (see placement.choose_home)."""
        available = {w: p.available for w, p in self._pools.items()}
        for block in adopted:
            # Adopting a cached-free block takes it out of what that worker can evict;
            # restoring a host block (not a PhysicalBlock) takes one.
            if type(block) is not PhysicalBlock or self._pools[block.worker_id].is_cached(
                block.index
            ):
                available[block.worker_id] -= 1
        needed = max(1, -(-(prompt_len - len(adopted) * self._bs) // self._bs))
        return choose_home(adopted[-1].worker_id if adopted else None, needed, available)

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

    def _release(self, block: PhysicalBlock) -> None:
        pool = self._pools[block.worker_id]
        keep = self._index.is_published(block)
        pool.decref(block.index, keep)
        if not keep and pool.refcount(block.index) == 0:
            self._note_released(block)

    def _note_released(self, block: PhysicalBlock) -> None:
        self._released.setdefault(block.worker_id, []).append(block.index)

    def _forget(self, seq: Sequence) -> None:
        del self._seqs[seq.seq_id]
        left = self._tenant_seqs[seq.tenant] - 1
        if left:
            self._tenant_seqs[seq.tenant] = left
        else:
            # Its last sequence is gone, so it references no block any more.
            del self._tenant_seqs[seq.tenant]
            del self._tenant_blocks[seq.tenant]
