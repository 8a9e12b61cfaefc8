"""Snapshot and restore of a BlockManager as plain JSON-able data.

Shape of `to_records()` (version 1); ids, tenants and worker ids are strings, keys hex:

    {"version": 1,
     "config": {block_size, num_layers, layout_fingerprint, tenant_quota_blocks,
                tenant_quota_sequences, eviction_policy},
     "workers": [{"worker_id", "num_blocks", "free": [index, ...] (next handed out last),
                  "cached": [index, ...] (eviction order; lru: next evicted first)}],        # in the order added
     "sequences": [{"seq_id", "tenant", "tokens": [int], "table": [[worker_id, index]],
                    "written": [int per layer], "keys": [hex], "home": worker_id | None,
                    "namespace": str}],
     "lost": [{"seq_id", "tenant", "worker_id"}],
     "index": [{"key": hex, "worker_id", "index", "parent": hex, "owner": tenant | None,
                "tokens": [int], "namespace": str}],
     "pins": [{"tenant", "tokens": [int], "blocks": [[worker_id, index]], "count",
               "namespace": str}],
     "counters": {"evictions", "cow_copies", "prefix_query_tokens": {tenant: int},
                  "prefix_hit_tokens": {tenant: int}, "host_hit_tokens", "host_evictions"},
     "host_tiers": [{"worker_id", "num_blocks", "free": [index, ...],
                     "held": [{"index", "entries": [{"key", "parent", "owner", "tokens",
                                                     "namespace"}]}] (eviction order)}],
     "tenant_quotas": [{"tenant", "max_blocks", "max_sequences"}]}   # absent: none

"namespace" ("" = the default prefix-cache namespace) and "eviction_policy" may be absent;
absent means the default namespace and the default policy ("lru"). "host_tiers" and the two
host counters may be absent: no host tier (cache_service.control.host_tier).

The blocks waiting for `take_released` are not stored: they only feed the workers' debug
poisoning, and a block replayed as released long ago may have been reused since.

Reference counts are not stored: they are the table and pin references, recounted on
restore. Free-list and eviction orders are stored because they decide which block the next
allocation returns, and a log replayed after the snapshot must get the same slots.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cache_service.control.accounting import CacheCounters
from cache_service.control.block_pool import BlockPool
from cache_service.control.eviction import make_policy
from cache_service.control.host_tier import host_records, restore_host_records
from cache_service.control.prefix_index import IndexEntry, decode_tokens, encode_tokens
from cache_service.control.sequence import Sequence
from cache_service.control.state import BlockManagerConfig, LostSequence, Pin
from cache_service.control.types import PhysicalBlock
from cache_service.errors import IntegrityError, InvalidRequest

if TYPE_CHECKING:
    from cache_service.control.block_manager import BlockManager

__all__ = ["RECORDS_VERSION", "from_records", "to_records"]

RECORDS_VERSION = 1


def to_records(manager: BlockManager) -> dict[str, Any]:
    """The manager's whole state; see the module docstring for the shape."""
    m = manager
    cfg = m.config
    return {
        "version": RECORDS_VERSION,
        "config": {
            "block_size": cfg.block_size,
            "num_layers": cfg.num_layers,
            "layout_fingerprint": cfg.layout_fingerprint,
            "tenant_quota_blocks": cfg.tenant_quota_blocks,
            "tenant_quota_sequences": cfg.tenant_quota_sequences,
            "eviction_policy": cfg.eviction_policy,
        },
        "workers": [
            {
                "worker_id": w,
                "num_blocks": pool.num_blocks,
                "free": pool.free_order(),
                "cached": pool.cached_order(),
            }
            for w, pool in m._pools.items()
        ],
        "sequences": [
            {
                "seq_id": s.seq_id,
                "tenant": s.tenant,
                "tokens": list(s.tokens),
                "table": [[b.worker_id, b.index] for b in s.table],
                "written": list(s.written),
                "keys": [k.hex() for k in s.keys],
                "home": s.home,
                "namespace": s.namespace,
            }
            for s in m._seqs.values()
        ],
        "lost": [
            {"seq_id": seq_id, "tenant": lost.tenant, "worker_id": lost.worker_id}
            for seq_id, lost in m._lost.items()
        ],
        "index": [
            {
                "key": key.hex(),
                "worker_id": e.block.worker_id,
                "index": e.block.index,
                "parent": e.parent.hex(),
                "owner": e.owner,
                "tokens": decode_tokens(e.tokens),
                "namespace": e.namespace,
            }
            for key, e in m._index.entries()
        ],
        "pins": [
            {
                "tenant": tenant,
                "tokens": decode_tokens(data),
                "blocks": [[b.worker_id, b.index] for b in pin.blocks],
                "count": pin.count,
                "namespace": namespace,
            }
            for (tenant, namespace, data), pin in m._pins.items()
        ],
        "counters": {
            "evictions": m._counters.evictions,
            "cow_copies": m._counters.cow_copies,
            "prefix_query_tokens": dict(m._counters.prefix_query_tokens),
            "prefix_hit_tokens": dict(m._counters.prefix_hit_tokens),
            "host_hit_tokens": m._counters.host_hit_tokens,
            "host_evictions": m._host.evictions,
        },
        "host_tiers": host_records(m),
        "tenant_quotas": [
            {"tenant": tenant, "max_blocks": q.max_blocks, "max_sequences": q.max_sequences}
            for tenant, q in m._quotas.items()
        ],
    }


def from_records(cls: type[BlockManager], records: dict[str, Any]) -> BlockManager:
    """Rebuild a manager from `to_records` output and verify it with check_integrity.

    Raises:
        InvalidRequest: wrong version, missing or mistyped fields, or records that describe
            an inconsistent state (the integrity report is in the message).
    """
    if not isinstance(records, dict) or records.get("version") != RECORDS_VERSION:
        raise InvalidRequest(f"records must be a dict with version {RECORDS_VERSION}")
    try:
        config = BlockManagerConfig(**records["config"])
        m = cls(config)
        for w in records["workers"]:
            m.add_worker(w["worker_id"], w["num_blocks"])
        # Reference counts are recounted from the tables and pins, per worker.
        refcounts = {w: [0] * pool.num_blocks for w, pool in m._pools.items()}
        _restore_sequences(m, records["sequences"], refcounts)
        for lost in records["lost"]:
            m._lost[lost["seq_id"]] = LostSequence(lost["tenant"], lost["worker_id"])
        events, m._index.events = m._index.events, None  # restored keys are not news
        _restore_index(m, records["index"], refcounts)
        m._index.events = events
        _restore_pins(m, records["pins"], refcounts)
        for w in records["workers"]:
            worker_id = w["worker_id"]
            m._pools[worker_id] = BlockPool.restore(
                worker_id,
                w["num_blocks"],
                refcounts[worker_id],
                w["free"],
                w["cached"],
                make_policy(config.eviction_policy),
            )
        c = records["counters"]
        m._counters = CacheCounters(
            evictions=int(c["evictions"]),
            cow_copies=int(c["cow_copies"]),
            prefix_query_tokens=dict(c["prefix_query_tokens"]),
            prefix_hit_tokens=dict(c["prefix_hit_tokens"]),
            host_hit_tokens=int(c.get("host_hit_tokens", 0)),
        )
        m._host.evictions = int(c.get("host_evictions", 0))
        restore_host_records(m, records.get("host_tiers", []))
        # Optional: absent means no tenant has a quota of its own.
        for q in records.get("tenant_quotas", []):
            m.set_tenant_quota(q["tenant"], q["max_blocks"], q["max_sequences"])
        m.check_integrity()
    except IntegrityError as exc:
        raise InvalidRequest(f"records describe an inconsistent state: {exc}") from None
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidRequest(f"malformed records: {type(exc).__name__}: {exc}") from None
    return m


def _block_of(pair: list[Any], refcounts: dict[str, list[int]]) -> PhysicalBlock:
    """A recorded [worker_id, index] as a block of a registered worker.

    Raises:
        InvalidRequest: unknown worker or index out of its pool.
    """
    worker_id, index = pair
    if worker_id not in refcounts or type(index) is not int:
        raise InvalidRequest(f"block {pair!r} is not in a registered worker")
    if not 0 <= index < len(refcounts[worker_id]):
        raise InvalidRequest(f"block {pair!r} is out of range")
    return PhysicalBlock(worker_id, index)


def _restore_sequences(
    m: BlockManager, sequences: list[dict[str, Any]], refcounts: dict[str, list[int]]
) -> None:
    """Add the recorded sequences, counting their table references."""
    for s in sequences:
        table = [_block_of(pair, refcounts) for pair in s["table"]]
        seq = Sequence(
            seq_id=s["seq_id"],
            tenant=s["tenant"],
            tokens=[int(t) for t in s["tokens"]],
            table=table,
            written=[int(w) for w in s["written"]],
            keys=[bytes.fromhex(k) for k in s["keys"]],
            home=s["home"],
            namespace=s.get("namespace", ""),
        )
        if seq.seq_id in m._seqs:
            raise InvalidRequest(f"sequence {seq.seq_id!r} appears twice")
        m._seqs[seq.seq_id] = seq
        m._tenant_seqs[seq.tenant] = m._tenant_seqs.get(seq.tenant, 0) + 1
        counts = m._tenant_blocks.setdefault(seq.tenant, {})
        for block in table:
            refcounts[block.worker_id][block.index] += 1
            counts[block] = counts.get(block, 0) + 1


def _restore_index(
    m: BlockManager, index: list[dict[str, Any]], refcounts: dict[str, list[int]]
) -> None:
    """Publish the recorded index entries, in their recorded order."""
    for e in index:
        block = _block_of([e["worker_id"], e["index"]], refcounts)
        entry = IndexEntry(
            block,
            bytes.fromhex(e["parent"]),
            e["owner"],
            encode_tokens(e["tokens"]),
            e.get("namespace", ""),
        )
        if not m._index.publish(bytes.fromhex(e["key"]), entry):
            raise InvalidRequest(f"index key {e['key'][:12]} appears twice")


def _restore_pins(
    m: BlockManager, pins: list[dict[str, Any]], refcounts: dict[str, list[int]]
) -> None:
    """Add the recorded pins, counting their references."""
    for pin_record in pins:
        blocks = [_block_of(pair, refcounts) for pair in pin_record["blocks"]]
        count = pin_record["count"]
        if type(count) is not int or count < 1:
            raise InvalidRequest(f"pin count must be a positive int, got {count!r}")
        data = encode_tokens(pin_record["tokens"])
        pin_key = (pin_record["tenant"], pin_record.get("namespace", ""), data)
        m._pins[pin_key] = Pin(blocks, count)
        for block in blocks:
            refcounts[block.worker_id][block.index] += count
            m._pinned[block] = m._pinned.get(block, 0) + count
