"""`BlockManager.check_integrity`: recount everything from the tables and compare.

Slow on purpose (O(total table entries + index size), rehashing every index key): it is for
tests, for a debug endpoint, and for checking a restored snapshot, never the request path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cache_service.control.host_tier import check_host_tier
from cache_service.control.prefix_index import ROOT_KEY, block_key, encode_tokens, make_salt
from cache_service.control.types import PhysicalBlock
from cache_service.errors import IntegrityError

if TYPE_CHECKING:
    from cache_service.control.block_manager import BlockManager
    from cache_service.control.sequence import Sequence

__all__ = ["check_integrity"]

# Enough examples in a message to debug from, without flooding a log.
_EXAMPLES = 5


class _Problems:
    """Collects failed invariants with their counts and a few examples each."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def check(self, what: str, bad: list[str]) -> None:
        if bad:
            shown = "; ".join(bad[:_EXAMPLES])
            more = f" (+{len(bad) - _EXAMPLES} more)" if len(bad) > _EXAMPLES else ""
            self.lines.append(f"{what}: {len(bad)} bad: {shown}{more}")


@dataclass(slots=True)
class _Recount:
    """What the tables and pins say, counted from scratch."""

    # block -> table plus pin references
    refs: dict[PhysicalBlock, int] = field(default_factory=dict)
    # block -> (logical index, tokens reserved in it) of the user reserving the most
    users: dict[PhysicalBlock, tuple[int, list[int]]] = field(default_factory=dict)
    # block -> highest fill among its users
    fills: dict[PhysicalBlock, int] = field(default_factory=dict)
    tenant_blocks: dict[str, dict[PhysicalBlock, int]] = field(default_factory=dict)
    tenant_seqs: dict[str, int] = field(default_factory=dict)


def check_integrity(manager: BlockManager) -> None:
    """Raise IntegrityError listing every invariant of `manager` that does not hold."""
    p = _Problems()
    recount = _Recount()
    _check_sequences(manager, recount, p)
    _check_pins(manager, recount, p)
    _check_pools(manager, recount, p)
    _check_index(manager, recount, p)
    _check_tenants(manager, recount, p)
    _check_stats(manager, recount, p)
    p.check("host tier", check_host_tier(manager))
    if p.lines:
        raise IntegrityError("control plane integrity check failed: " + " | ".join(p.lines))


def _check_sequences(m: BlockManager, recount: _Recount, p: _Problems) -> None:
    """Shapes of every sequence, and who uses which block at which logical index."""
    bs = m._bs
    shape_bad: list[str] = []
    slot_bad: list[str] = []
    users = recount.users
    for seq in m._seqs.values():
        shape_bad.extend(_shape_problems(m, seq))
        recount.tenant_seqs[seq.tenant] = recount.tenant_seqs.get(seq.tenant, 0) + 1
        counts = recount.tenant_blocks.setdefault(seq.tenant, {})
        for i, block in enumerate(seq.table):
            pool = m._pools.get(block.worker_id)
            if pool is None or not 0 <= block.index < pool.num_blocks:
                shape_bad.append(f"{seq.seq_id}: block {block} is not in a live pool")
                continue
            recount.refs[block] = recount.refs.get(block, 0) + 1
            counts[block] = counts.get(block, 0) + 1
            held = seq.tokens[i * bs : (i + 1) * bs]
            recount.fills[block] = max(recount.fills.get(block, 0), len(held))
            first = users.get(block)
            if first is None:
                users[block] = (i, held)
                continue
            index, tokens = first
            shorter = min(len(tokens), len(held))
            if index != i or tokens[:shorter] != held[:shorter]:
                slot_bad.append(
                    f"{block} is logical block {index} with tokens {tokens[:4]}.. for one user "
                    f"and block {i} with {held[:4]}.. for {seq.seq_id}"
                )
            if len(held) > len(tokens):
                users[block] = (i, held)
    p.check("sequence shape", shape_bad)
    p.check("slot handed out twice", slot_bad)


def _shape_problems(m: BlockManager, seq: Sequence) -> list[str]:
    """Table, written lengths, published keys and cached block-id row of one sequence."""
    bs = m._bs
    bad: list[str] = []
    n = len(seq.tokens)
    if len(seq.table) != -(-n // bs):
        bad.append(f"{seq.seq_id}: {len(seq.table)} blocks for {n} tokens")
    if len(seq.written) != m._num_layers or any(not 0 <= w <= n for w in seq.written):
        bad.append(f"{seq.seq_id}: written {seq.written} with {n} tokens reserved")
    elif len(seq.keys) != min(seq.written) // bs:
        bad.append(
            f"{seq.seq_id}: {len(seq.keys)} published blocks but "
            f"{min(seq.written) // bs} full blocks written on every layer"
        )
    row = seq.row
    if row is not None and row.matches(seq.table):
        # A cached block-id row that would be served must be the table's prefix
        # (cache_service.control.block_rows); one that no longer matches is rebuilt on use.
        prefix = seq.table[: row.n]
        workers = {b.worker_id for b in prefix}
        if row.ids(row.n).tolist() != [b.index for b in prefix] or (
            prefix and (row.mixed != (len(workers) > 1) or row.worker != prefix[0].worker_id)
        ):
            bad.append(f"{seq.seq_id}: its cached block-id row differs from its table")
    return bad


def _check_pins(m: BlockManager, recount: _Recount, p: _Problems) -> None:
    """Pins agree with the pinned map; pin references join the recount."""
    pin_refs: dict[PhysicalBlock, int] = {}
    for pin in m._pins.values():
        for block in pin.blocks:
            pin_refs[block] = pin_refs.get(block, 0) + pin.count
    p.check(
        "pin counts",
        [
            f"{b}: pins say {pin_refs.get(b, 0)}, pinned map says {m._pinned.get(b, 0)}"
            for b in set(pin_refs) | set(m._pinned)
            if pin_refs.get(b, 0) != m._pinned.get(b, 0)
        ],
    )
    for block, count in m._pinned.items():
        recount.refs[block] = recount.refs.get(block, 0) + count


def _check_pools(m: BlockManager, recount: _Recount, p: _Problems) -> None:
    """Each pool's states partition its blocks and its counts equal the references."""
    state_bad: list[str] = []
    count_bad: list[str] = []
    for worker_id, pool in m._pools.items():
        free = pool.free_order()
        cached = pool.cached_order()
        free_set, cached_set = set(free), set(cached)
        if len(free_set) != len(free) or len(cached_set) != len(cached):
            state_bad.append(f"{worker_id}: a block is listed twice in the free or cached list")
        if pool.num_cached != len(cached):
            state_bad.append(
                f"{worker_id}: eviction policy holds {pool.num_cached} blocks, lists {len(cached)}"
            )
        counts = pool.refcounts()
        used = {i for i, c in enumerate(counts) if c > 0}
        overlap = (free_set & cached_set) | (free_set & used) | (cached_set & used)
        missing = set(range(pool.num_blocks)) - free_set - cached_set - used
        if overlap or missing:
            state_bad.append(
                f"{worker_id}: {len(overlap)} blocks in two states, {len(missing)} in none"
            )
        if pool.num_used != len(used):
            state_bad.append(f"{worker_id}: used counter {pool.num_used}, recount {len(used)}")
        for i in cached_set:
            if not m._index.is_published(PhysicalBlock(worker_id, i)):
                state_bad.append(f"{worker_id}: cached-free block {i} is not in the index")
        for i in free_set:
            if m._index.is_published(PhysicalBlock(worker_id, i)):
                state_bad.append(f"{worker_id}: free block {i} is still in the index")
        for i, count in enumerate(counts):
            expected = recount.refs.get(PhysicalBlock(worker_id, i), 0)
            if count != expected:
                count_bad.append(f"{worker_id}:{i} count {count}, references {expected}")
    p.check("block states", state_bad)
    p.check("reference counts", count_bad)


def _check_index(m: BlockManager, recount: _Recount, p: _Problems) -> None:
    """Every entry points at a live block, hashes to its key, chains within its owner and
    namespace, and holds its users' tokens; the reverse map agrees."""
    bs = m._bs
    index_bad: list[str] = []
    salts: dict[tuple[str | None, str], bytes] = {}
    by_block: dict[PhysicalBlock, int] = {}
    for key, entry in m._index.entries():
        block = entry.block
        by_block[block] = by_block.get(block, 0) + 1
        pool = m._pools.get(block.worker_id)
        if pool is None or not 0 <= block.index < pool.num_blocks:
            index_bad.append(f"{key.hex()[:12]} points at {block}, not in a live pool")
            continue
        if pool.refcount(block.index) == 0 and not pool.is_cached(block.index):
            index_bad.append(f"{key.hex()[:12]} points at free block {block}")
        if len(entry.tokens) != bs * 8:
            index_bad.append(f"{key.hex()[:12]}: {len(entry.tokens) // 8} tokens, not {bs}")
        salt_of = (entry.owner, entry.namespace)
        salt = salts.get(salt_of)
        if salt is None:
            salt = salts[salt_of] = make_salt(
                entry.owner, m.config.layout_fingerprint, entry.namespace
            ).salt
        if block_key(entry.parent, salt, entry.tokens) != key:
            index_bad.append(f"{key.hex()[:12]}: key is not the hash of its entry")
        parent = m._index.get(entry.parent) if entry.parent != ROOT_KEY else None
        if parent is not None and parent.owner not in (entry.owner, None):
            index_bad.append(f"{key.hex()[:12]}: chains to another tenant's block")
        if parent is not None and parent.namespace != entry.namespace:
            index_bad.append(f"{key.hex()[:12]}: chains to another namespace's block")
        user = recount.users.get(block)
        if user is not None and encode_tokens(user[1]) != entry.tokens:
            index_bad.append(f"{key.hex()[:12]}: users of {block} hold other tokens")
    for block in list(by_block):
        if len(m._index.keys_of(block)) != by_block[block]:
            index_bad.append(f"{block}: reverse map disagrees with the entries")
    p.check("prefix index", index_bad)


def _check_tenants(m: BlockManager, recount: _Recount, p: _Problems) -> None:
    """Per-tenant sequence and block counts, and no id both live and lost."""
    tenant_bad: list[str] = []
    if recount.tenant_seqs != m._tenant_seqs:
        tenant_bad.append(f"sequence counts {m._tenant_seqs}, recount {recount.tenant_seqs}")
    if recount.tenant_blocks != m._tenant_blocks:
        tenant_bad.append(
            "block references "
            f"{ {t: len(b) for t, b in m._tenant_blocks.items()} }, recount "
            f"{ {t: len(b) for t, b in recount.tenant_blocks.items()} }"
        )
    both = set(m._seqs) & set(m._lost)
    if both:
        tenant_bad.append(f"{len(both)} ids both live and lost")
    p.check("tenants", tenant_bad)


def _check_stats(m: BlockManager, recount: _Recount, p: _Problems) -> None:
    """`stats()` agrees with the pools and the recounted fills."""
    bs = m._bs
    stats_bad: list[str] = []
    for worker_id, ws in m.stats().workers.items():
        pool = m._pools[worker_id]
        used_blocks = [PhysicalBlock(worker_id, i) for i, c in enumerate(pool.refcounts()) if c > 0]
        # Blocks held only by pins are published, hence full.
        filled = sum(recount.fills.get(b, bs) for b in used_blocks)
        if ws.total != ws.used + ws.cached_free + ws.free:
            stats_bad.append(f"{worker_id}: total {ws.total} != used+cached+free")
        if ws.filled_slots != filled or ws.allocated_slots != len(used_blocks) * bs:
            stats_bad.append(
                f"{worker_id}: stats say {ws.filled_slots}/{ws.allocated_slots} slots filled, "
                f"recount {filled}/{len(used_blocks) * bs}"
            )
    p.check("stats", stats_bad)
