"""A seeded random workload over the block manager, shared by the store tests.

`Workload(manager, rng).step()` performs one random control-plane call (create with
prompts that share prefixes, fork, free, layer-by-layer and all-layer writes, writes left
uncommitted, pins, public publishing, eviction, a worker lost and re-added). It works on a
plain BlockManager or a DurableBlockManager alike, and its choices depend only on the rng
and on the manager's answers, so two runs with the same seed and the same seq ids make the
same calls.
"""

from __future__ import annotations

import random
import secrets as _secrets
from typing import Any

from cache_service.control.block_manager import BlockManager, BlockManagerConfig
from cache_service.errors import CacheError

CONFIG = BlockManagerConfig(
    block_size=4,
    num_layers=2,
    layout_fingerprint="test-layout",
    tenant_quota_blocks=40,
    tenant_quota_sequences=12,
)
WORKERS = {"w0": 10, "w1": 8}
TENANTS = ("acme", "globex")
# Prompts drawn as a prefix of one of these plus a random tail, so prefix hits happen.
BASES = (list(range(100, 120)), list(range(200, 216)), [7] * 20)

OPS = (
    "create",
    "create",
    "write",
    "write",
    "write",
    "write_uncommitted",
    "fork",
    "free",
    "free",
    "pin",
    "unpin",
    "publish",
    "evict",
    "lose_worker",
    "lookup",
)


class SeededIds:
    """Stand-in for the `secrets` module in block_manager: reproducible sequence ids."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def token_urlsafe(self, nbytes: int | None = None) -> str:
        return f"id{self._rng.getrandbits(64):016x}"


def seed_ids(seed: int) -> None:
    """Make block_manager draw reproducible ids (swaps its `secrets` module attribute)."""
    import cache_service.control.block_manager as bm

    bm.secrets = SeededIds(seed)  # type: ignore[assignment]


def restore_ids() -> None:
    """Undo seed_ids."""
    import cache_service.control.block_manager as bm

    bm.secrets = _secrets  # type: ignore[assignment]


class Workload:
    """Random calls against `manager` (a BlockManager or DurableBlockManager).

    `mutations` counts the calls that succeeded and change state (what the log holds).
    """

    def __init__(self, manager: Any, rng: random.Random) -> None:
        self.m = manager
        self.rng = rng
        self.live: list[tuple[str, str]] = []  # (tenant, seq_id)
        # The prompt each sequence was created with: writes follow it first, so written
        # blocks match later prompts and prefix hits happen.
        self.prompts: dict[str, list[int]] = {}
        self.pins: list[tuple[str, list[int]]] = []
        self.epoch = 0
        self.mutations = 0
        self.errors = 0

    def setup(self) -> None:
        for worker_id, blocks in WORKERS.items():
            self._add_worker(worker_id, blocks)

    def _add_worker(self, worker_id: str, blocks: int) -> None:
        self.epoch += 1
        epoch = f"e{self.epoch}"
        if isinstance(self.m, BlockManager):
            self.m.add_worker(worker_id, blocks)
        else:
            self.m.add_worker(worker_id, blocks, epoch=epoch)
        self.mutations += 1

    def _prompt(self) -> list[int]:
        base = self.rng.choice(BASES)
        head = base[: self.rng.randrange(0, len(base) + 1)]
        tail = [self.rng.randrange(1, 50) for _ in range(self.rng.randrange(0, 4))]
        return head + tail

    def _pick(self) -> tuple[str, str] | None:
        return self.rng.choice(self.live) if self.live else None

    def step(self) -> str:
        """One random call; returns its name. CacheErrors are expected and counted."""
        op = self.rng.choice(OPS)
        try:
            self._do(op)
        except CacheError:
            self.errors += 1
        return op

    def _do(self, op: str) -> None:
        m, rng = self.m, self.rng
        if op == "create":
            tenant = rng.choice(TENANTS)
            prompt = self._prompt() if rng.random() < 0.8 else None
            created = m.create_sequence(tenant, prompt)
            self.mutations += 1
            self.live.append((tenant, created.seq_id))
            self.prompts[created.seq_id] = prompt or []
        elif op == "fork":
            picked = self._pick()
            if picked:
                new_id = m.fork(*picked)
                self.mutations += 1
                self.live.append((picked[0], new_id))
                self.prompts[new_id] = list(self.prompts.get(picked[1], []))
        elif op == "free":
            picked = self._pick()
            if picked:
                m.free(*picked)
                self.mutations += 1
                self.live.remove(picked)
        elif op in ("write", "write_uncommitted"):
            picked = self._pick()
            if picked:
                self._write(picked, commit=op == "write")
        elif op == "pin":
            tenant = rng.choice(TENANTS)
            tokens = self._prompt()
            if m.pin(tenant, tokens) > 0:
                self.pins.append((tenant, tokens))
            self.mutations += 1
        elif op == "unpin":
            if self.pins:
                tenant, tokens = self.pins.pop(rng.randrange(len(self.pins)))
                m.unpin(tenant, tokens)
                self.mutations += 1
        elif op == "publish":
            picked = self._pick()
            if picked:
                m.publish_public(*picked)
                self.mutations += 1
        elif op == "evict":
            m.evict(rng.choice([None, 1, 3]), rng.choice([None, "w0", "w1"]))
            self.mutations += 1
        elif op == "lose_worker":
            # Rare: it wipes a lot of state.
            if rng.random() < 0.15:
                worker_id = rng.choice(sorted(WORKERS))
                m.lose_worker(worker_id)
                self.mutations += 1
                self._add_worker(worker_id, WORKERS[worker_id])
        elif op == "lookup":
            m.lookup(rng.choice(TENANTS), self._prompt())

    def _write(self, picked: tuple[str, str], commit: bool) -> None:
        m, rng = self.m, self.rng
        info = m.sequence_info(*picked)
        layer = None if rng.random() < 0.6 else rng.randrange(CONFIG.num_layers)
        start = info.written[0] if layer is None else info.written[layer]
        n = rng.randrange(1, 7)
        reserved = list(info.token_ids)
        prompt = self.prompts.get(picked[1], [])
        tokens = reserved[start : start + n]
        for pos in range(start + len(tokens), start + n):
            tokens.append(prompt[pos] if pos < len(prompt) else rng.randrange(1, 50))
        m.prepare_write(*picked, layer, tokens)
        self.mutations += 1
        if commit:
            if rng.random() < 0.5:
                m.commit_write(*picked, layer, n)
            else:  # the batch form a decode step's other layers commit with
                m.commit_writes(picked[0], layer, [(picked[1], n)])
            self.mutations += 1


def _child_main(argv: list[str]) -> None:
    """Run the workload into a store until killed, printing each acknowledged lsn.

    argv: store path, seed, checkpoint_every[, group_every: flush (group commit) every this
    many steps; absent or 0: every call commits on its own]. Used by test_store_crash.py as a child
    process that the test SIGKILLs.
    """
    import sys

    from cache_service.engine.recovery import DurableBlockManager
    from cache_service.engine.store import MetadataStore, StoreConfig

    path, seed, checkpoint_every = argv[0], int(argv[1]), int(argv[2])
    group_every = int(argv[3]) if len(argv) > 3 else 0
    seed_ids(seed)
    store = MetadataStore(StoreConfig(path, synchronous="FULL", checkpoint_every=checkpoint_every))
    store.begin_generation()
    durable = DurableBlockManager(BlockManager(CONFIG), store, group_commit=group_every > 0)
    work = Workload(durable, random.Random(seed))
    work.setup()
    durable.flush()
    print(f"ack {store.last_lsn()}", flush=True)
    for step in range(1_000_000):
        work.step()
        if group_every and step % group_every:
            continue
        durable.flush()
        # Everything up to here is committed: this is the acknowledgement a client gets.
        sys.stdout.write(f"ack {store.last_lsn()}\n")
        sys.stdout.flush()


if __name__ == "__main__":
    import sys

    _child_main(sys.argv[1:])
