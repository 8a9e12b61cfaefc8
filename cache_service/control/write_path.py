"""The write path: reserving a sequence's positions (`prepare_write`: block growth,
copy-on-write, taking blocks from the pools), its all-or-nothing batch, `cancel_write`, and
the batch commit.

Checking and applying one commit stay `BlockManager` methods (`_committed_length`,
`_apply_commit`): every layer of a step runs them.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from typing import TYPE_CHECKING

from cache_service.control.host_tier import evict_block, evict_blocks
from cache_service.control.placement import plan_growth
from cache_service.control.prefix_index import pack_tokens
from cache_service.control.quotas import check_block_quota, unref
from cache_service.control.sequence import PENDING_TOKEN, Sequence
from cache_service.control.types import BlockCopy, CancelledWrite, PhysicalBlock, WritePlan
from cache_service.control.validation import batch_items
from cache_service.control.write_journal import Journal, Undo, roll_back
from cache_service.errors import CacheError, InvalidRequest, PoolExhausted, QuotaExceeded

if TYPE_CHECKING:
    from cache_service.control.block_manager import BlockManager

__all__ = ["cancel_write", "commit_writes", "fill_pending", "prepare_write", "prepare_writes"]


def prepare_write(
    m: BlockManager,
    tenant: str,
    seq_id: str,
    layer: int | None,
    token_ids: SequenceABC[int],
    capacity: int | None = None,
    ahead: int = 0,
) -> WritePlan:
    """`BlockManager.prepare_write`: the slots of `token_ids` at written(layer), reserving
    positions (and copying a shared partly filled last block) as needed, and `ahead` more
    positions past them whose tokens are to come (`PENDING_TOKEN` until
    `fill_pending`). capacity: `max_sequence_tokens()` when the caller has it (a batch
    asks once, not per item)."""
    seq = m._resolve(tenant, seq_id)
    start = m._start_of(seq, layer)
    tokens = pack_tokens(token_ids).tolist()
    n = len(tokens)
    if n == 0:
        raise InvalidRequest("token_ids is empty")
    bs = m._bs
    reserved = len(seq.tokens)
    if ahead:
        if start + n < reserved:
            raise InvalidRequest(
                f"sequence {seq_id!r} has positions reserved past {start + n}: positions "
                "ahead are reserved only at the end of a sequence"
            )
        tokens.extend([PENDING_TOKEN] * ahead)
        n += ahead
    end = start + n
    # The message is built only for a refusal: every decode step of every sequence comes
    # here, and formatting it costs more than the check.
    if end > reserved and end > (m.max_sequence_tokens() if capacity is None else capacity):
        m._check_length(
            "token_ids",
            end,
            f" would make sequence {seq_id!r} {end} tokens long ({n} at {start})",
        )
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
            if m._pools[last.worker_id].refcount(last.index) > 1:
                cow_src = last
        if m._journal is not None:
            m._journal.steps.append(
                Undo(seq, reserved, len(table), table[-1] if table else None, seq.home, [])
            )
        if new_blocks or cow_src is not None:
            copies = _grow(m, seq, new_blocks, cow_src)
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
    m: BlockManager,
    tenant: str,
    layer: int | None,
    writes: SequenceABC[tuple[str, SequenceABC[int]]],
    ahead: int = 0,
) -> list[WritePlan]:
    """`BlockManager.prepare_writes`: one WritePlan per item, all or nothing (a failing item
    rolls every earlier one back through the batch's Journal)."""
    if type(ahead) is not int or ahead < 0:
        raise InvalidRequest(f"ahead must be a non-negative int, got {ahead!r}")
    items = batch_items(writes, "token_ids")
    if not items:
        raise InvalidRequest("writes is empty")
    journal = m._journal = Journal(m._counters, m._released)
    plans: list[WritePlan] = []
    capacity = m.max_sequence_tokens()  # the pools' sizes do not change meanwhile
    try:
        for i, (seq_id, token_ids) in enumerate(items):
            try:
                plans.append(prepare_write(m, tenant, seq_id, layer, token_ids, capacity, ahead))
            except (PoolExhausted, QuotaExceeded) as exc:
                raise type(exc)(
                    f"{exc} (write {i + 1} of {len(items)}, sequence {seq_id!r}; the "
                    "batch reserved nothing)"
                ) from None
    except BaseException:
        m._journal = None
        roll_back(m, journal)
        raise
    m._journal = None
    if journal.evicted:  # blocks reused from the cached-free ones (a decode step rarely)
        evict_blocks(m, journal.evicted)
        for block in journal.evicted:
            m._note_released(block)
    return plans


def commit_writes(
    m: BlockManager, tenant: str, layer: int | None, writes: SequenceABC[tuple[str, int]]
) -> None:
    """`BlockManager.commit_writes`: check every write, then commit them all."""
    items = batch_items(writes, "num_tokens")
    checked: list[tuple[Sequence, int]] = []
    for i, (seq_id, num_tokens) in enumerate(items):
        try:
            seq = m._resolve(tenant, seq_id)
            checked.append((seq, m._committed_length(seq, layer, num_tokens)))
        except CacheError as exc:
            raise type(exc)(f"{exc} (write {i + 1} of {len(items)})") from None
    for seq, new in checked:
        m._apply_commit(seq, layer, new)


def fill_pending(
    m: BlockManager, tenant: str, fills: SequenceABC[tuple[str, int, SequenceABC[int]]]
) -> None:
    """`BlockManager.fill_pending`: check every fill, then set their tokens."""
    checked: list[tuple[Sequence, int, list[int]]] = []
    for i, (seq_id, start, token_ids) in enumerate(batch_items(fills, "start", "token_ids")):
        seq = m._resolve(tenant, seq_id)
        tokens = pack_tokens(token_ids).tolist()
        if type(start) is not int or start < 0 or start + len(tokens) > len(seq.tokens):
            raise InvalidRequest(
                f"fills[{i}]: positions {start}..{start}+{len(tokens)} are outside the "
                f"{len(seq.tokens)} reserved of {seq_id!r}"
            )
        if any(t != PENDING_TOKEN for t in seq.tokens[start : start + len(tokens)]):
            raise InvalidRequest(
                f"fills[{i}]: positions {start}..{start + len(tokens)} of {seq_id!r} are not "
                "all pending (their tokens are known already)"
            )
        checked.append((seq, start, tokens))
    for seq, start, tokens in checked:
        seq.tokens[start : start + len(tokens)] = tokens


def cancel_write(m: BlockManager, tenant: str, seq_id: str) -> CancelledWrite:
    """`BlockManager.cancel_write`: release the positions reserved past the sequence's
    longest written layer."""
    seq = m._resolve(tenant, seq_id)
    bs = m._bs
    start = max(seq.written)
    keep = -(-start // bs)
    if start % bs:
        last = seq.table[keep - 1]
        shared = m._pools[last.worker_id].refcount(last.index) > 1
        if shared or m._index.is_published(last):
            # Shared with a fork taken while this reservation was held (or written and
            # published by one): its other users hold these positions too, a block has
            # one fill, and published KV must not be overwritten with other tokens'.
            # They stay reserved: a write there must repeat their tokens.
            start = min(len(seq.tokens), keep * bs)
    num_tokens = len(seq.tokens) - start
    dropped = tuple(seq.table[keep:])
    if dropped:
        tenant_blocks = m._tenant_blocks[tenant]
        for block in reversed(dropped):
            m._release(block)
            unref(tenant_blocks, block)
        seq.truncate_table(keep)
    del seq.tokens[start:]
    return CancelledWrite(start, num_tokens, dropped)


def _grow(
    m: BlockManager, seq: Sequence, new_blocks: int, cow_src: PhysicalBlock | None
) -> list[BlockCopy]:
    """Reserve `new_blocks` more blocks, and a copy of `cow_src` (the sequence's shared,
    partly filled last block) if given; all or nothing. Returns the copies to run."""
    tenant_blocks = m._tenant_blocks[seq.tenant]
    delta = new_blocks
    if cow_src is not None:
        # The copy is a new block for the tenant; the source stops counting only if no
        # other of its sequences still uses it.
        delta += 0 if tenant_blocks[cow_src] == 1 else 1
    check_block_quota(m, seq.tenant, delta)
    plan = _growth_plan(m, seq.home, new_blocks, cow_src)

    copies: list[BlockCopy] = []
    if cow_src is not None:
        dst = _take(m, cow_src.worker_id)
        copies.append(BlockCopy(cow_src.worker_id, cow_src.index, dst.index))
        seq.replace_last_block(dst)
        m._release(cow_src)
        unref(tenant_blocks, cow_src)
        if m._journal is not None:
            m._journal.steps[-1].cow_src = cow_src
        tenant_blocks[dst] = 1
        m._counters.cow_copies += 1
    table = seq.table
    for worker_id, count in plan:
        for _ in range(count):
            block = _take(m, worker_id)
            table.append(block)
            tenant_blocks[block] = 1
        seq.home = worker_id
    return copies


def _growth_plan(
    m: BlockManager, home: str | None, new_blocks: int, cow_src: PhysicalBlock | None
) -> list[tuple[str, int]]:
    """(worker_id, blocks) to take from each worker, home first (see placement.plan_growth),
    leaving room for the copy of `cow_src` on its own worker.

    Raises:
        PoolExhausted: not enough free or evictable blocks.
    """
    if cow_src is None and home is not None:
        home_pool = m._pools.get(home)
        if home_pool is not None and home_pool.available >= new_blocks:
            return [(home, new_blocks)] if new_blocks else []
    available = {w: p.available for w, p in m._pools.items()}
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
    return growth


def _take(m: BlockManager, worker_id: str) -> PhysicalBlock:
    """One block from the worker's pool (a free one, else an evicted cached-free one),
    journaled when a batch is open."""
    index, evicted = m._pools[worker_id].take()
    block = PhysicalBlock(worker_id, index)
    journal = m._journal
    if journal is not None:
        journal.steps[-1].taken.append((block, evicted))
    if evicted:
        m._counters.evictions += 1
        if journal is not None:
            journal.evicted.append(block)  # dropped from the index if the batch succeeds
        else:
            evict_block(m, block)
            m._note_released(block)
    return block
