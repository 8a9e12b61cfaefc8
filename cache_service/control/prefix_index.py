"""The prefix-hash index: finds cached full blocks of a prompt, chained block by block.

A block's key is sha256(parent key || salt || its token ids as uint64 LE)
(`cache_service.prefix_keys`, the one place a key or salt is computed), where the salt folds
in the owner (one tenant, or the shared public salt), the KV layout fingerprint and the
sequence's namespace (the model identity a caller gives; empty = the default namespace), so
tenants never match each other's blocks and caches of different layouts never match at all.
The first block's parent is 32 zero bytes. Every part has a fixed width, so the encoding is
unambiguous.

On a hit the stored entry must also agree on parent key, owner and token bytes: since the
parent was itself verified, a match is exact token-for-token back to the first block, and a
hash collision can never hand out another prompt's KV.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from cache_service.control.kv_events import KvEventLog
from cache_service.control.types import PhysicalBlock
from cache_service.errors import InvalidRequest
from cache_service.prefix_keys import (
    ROOT_KEY,
    TOKEN_BYTES,
    block_key,
    salt_bytes,
    shared_prefix_length,
)

__all__ = [
    "ROOT_KEY",
    "IndexEntry",
    "PrefixIndex",
    "Salt",
    "block_key",
    "chain_keys",
    "decode_tokens",
    "encode_tokens",
    "make_salt",
    "pack_tokens",
    "token_bytes",
]


class Salt(NamedTuple):
    """An owner of index entries: a tenant name, or None for the public (shared) namespace,
    and the 32-byte salt its keys are hashed with."""

    owner: str | None
    salt: bytes


class IndexEntry(NamedTuple):
    """A published block: where it is, and what was hashed to find it.

    Attributes:
        block: the physical block holding the KV (in the host tier's entries: the
            `host_tier.HostBlock` holding it).
        parent: key of the previous block of the prefix (ROOT_KEY for the first).
        owner: tenant whose salt the key was hashed with; None for public.
        tokens: the block's token ids, uint64 little-endian bytes (block_size * 8 bytes).
        namespace: namespace whose salt the key was hashed with ("" = the default).
    """

    block: PhysicalBlock
    parent: bytes
    owner: str | None
    tokens: bytes
    namespace: str = ""


def make_salt(owner: str | None, layout_fingerprint: str, namespace: str = "") -> Salt:
    """The salt of a tenant (owner = its name) or of the public owner (owner None), in a
    namespace ("" = the default namespace: nothing is added to the salted material, so a
    namespace's salt never equals the default one's)."""
    return Salt(owner, salt_bytes(owner, layout_fingerprint, namespace))


def pack_tokens(token_ids: Iterable[int]) -> array:
    """Validate token ids and pack them as unsigned 64-bit ints (C speed, no per-id loop).

    Raises:
        InvalidRequest: not a sequence of ints, or an id outside [0, 2**64).
    """
    if isinstance(token_ids, (str, bytes, bytearray)):
        raise InvalidRequest("token ids must be a sequence of ints, not a string")
    try:
        # "Q" rejects negative ids and non-ints by itself, which is the whole validation.
        return array("Q", token_ids)
    except (TypeError, OverflowError, ValueError) as exc:
        raise InvalidRequest(f"token ids must be ints in [0, 2**64): {exc}") from None


def token_bytes(packed: array) -> bytes:
    """Packed token ids as little-endian bytes (8 per token): what keys are hashed over."""
    if sys.byteorder == "big":  # pragma: no cover - every supported machine is little-endian
        packed = array("Q", packed)
        packed.byteswap()
    return packed.tobytes()


def encode_tokens(token_ids: Iterable[int]) -> bytes:
    """`token_bytes(pack_tokens(token_ids))`."""
    return token_bytes(pack_tokens(token_ids))


def decode_tokens(data: bytes) -> list[int]:
    """Inverse of `encode_tokens`."""
    packed = array("Q")
    packed.frombytes(data)
    if sys.byteorder == "big":  # pragma: no cover
        packed.byteswap()
    return packed.tolist()


def chain_keys(
    parent: bytes, salt: bytes, tokens: bytes, block_size: int
) -> Iterator[tuple[bytes, bytes, bytes]]:
    """Keys of consecutive full blocks, each chained on the one before.

    Args:
        parent: key of the block before the first (ROOT_KEY at the start of a prompt).
        salt: the owner's `Salt.salt`.
        tokens: whole blocks of token bytes (`encode_tokens`), block_size * 8 bytes each.
        block_size: tokens per block.

    Yields:
        (parent key, key, the block's token bytes) per block, in order.
    """
    stride = block_size * TOKEN_BYTES
    for start in range(0, len(tokens) - stride + 1, stride):
        chunk = tokens[start : start + stride]
        key = block_key(parent, salt, chunk)
        yield parent, key, chunk
        parent = key


class PrefixIndex:
    """Published blocks by key, and the keys of each published block.

    A block may carry more than one key: one under its tenant's salt and one under the
    public salt once its prefix is published for everyone.

    Every key added or dropped is reported to `events` (a `KvEventLog`; None reports
    nothing, as when a snapshot is restored): this class is the one place the index
    changes, so the KV event stream cannot miss a change.
    """

    __slots__ = ("_by_block", "_changes", "_entries", "_last_match", "block_size", "events")

    def __init__(self, block_size: int) -> None:
        """An empty index for blocks of `block_size` tokens."""
        self.block_size = block_size
        self._entries: dict[bytes, IndexEntry] = {}
        self._by_block: dict[PhysicalBlock, list[bytes]] = {}
        self.events: KvEventLog | None = None
        # Bumped whenever a key is added or dropped: a remembered match holds only while
        # the index is as it was.
        self._changes = 0
        # The last match: (changes then, salts, prompt bytes, its leading GPU blocks).
        self._last_match: (
            tuple[int, Sequence[Salt], bytes, tuple[tuple[bytes, Any], ...]] | None
        ) = None

    def __len__(self) -> int:
        """Number of keys."""
        return len(self._entries)

    def is_published(self, block: PhysicalBlock) -> bool:
        """Whether any key points at `block` (it then stays findable when unreferenced)."""
        return block in self._by_block

    def keys_of(self, block: PhysicalBlock) -> list[bytes]:
        """The keys pointing at `block` (empty if none)."""
        return list(self._by_block.get(block, ()))

    def get(self, key: bytes) -> IndexEntry | None:
        """The entry under `key`, if any."""
        return self._entries.get(key)

    def entries(self) -> Iterable[tuple[bytes, IndexEntry]]:
        """Every (key, entry), in publication order."""
        return self._entries.items()

    def publish(self, key: bytes, entry: IndexEntry) -> bool:
        """Add `entry` under `key` unless the key is taken.

        Returns:
            True if added; False if another block already serves this exact prefix (the
            first one published stays; the caller's block is then simply not findable).
        """
        if not self._add(key, entry):
            return False
        if self.events is not None:
            self._report_stored([key], entry)
        return True

    def publish_chain(self, items: Iterable[tuple[bytes, IndexEntry]]) -> int:
        """`publish` each (key, entry) of one prompt's consecutive blocks, in order.

        Reported as one stored event per run of added keys that chain on one worker.

        Returns:
            How many keys were added.
        """
        added = 0
        run: list[bytes] = []
        first: IndexEntry | None = None
        for key, entry in items:
            if not self._add(key, entry):
                if run and first is not None:
                    self._report_stored(run, first)
                run, first = [], None
                continue
            added += 1
            if self.events is None:
                continue
            if first is not None and (
                entry.parent != run[-1]
                or entry.block.worker_id != first.block.worker_id
                or entry.owner != first.owner
                or entry.namespace != first.namespace
            ):
                self._report_stored(run, first)
                run, first = [], None
            if first is None:
                first = entry
            run.append(key)
        if run and first is not None:
            self._report_stored(run, first)
        return added

    def _add(self, key: bytes, entry: IndexEntry) -> bool:
        if key in self._entries:
            return False
        self._entries[key] = entry
        self._changes += 1
        keys = self._by_block.get(entry.block)
        if keys is None:
            self._by_block[entry.block] = [key]
        else:
            keys.append(key)
        return True

    def _report_stored(self, keys: list[bytes], first: IndexEntry) -> None:
        if self.events is not None:
            self.events.stored(
                keys,
                first.parent,
                first.owner,
                first.namespace,
                first.block.worker_id,
                self.block_size,
            )

    def remove_block(self, block: PhysicalBlock) -> int:
        """Drop every key of `block` (evicted, or its worker lost). Returns how many."""
        return self.remove_blocks((block,))

    def remove_blocks(self, blocks: Iterable[PhysicalBlock]) -> int:
        """Drop every key of each block; reported as one removed event per worker, owner
        and namespace. Returns how many keys were dropped."""
        dropped: dict[tuple[str, str | None, str], list[bytes]] = {}
        count = 0
        for block in blocks:
            for key in self._by_block.pop(block, ()):
                entry = self._entries.pop(key)
                count += 1
                self._changes += 1
                if self.events is not None:
                    group = (block.worker_id, entry.owner, entry.namespace)
                    dropped.setdefault(group, []).append(key)
        if self.events is not None:
            for (worker_id, owner, namespace), keys in dropped.items():
                self.events.removed(keys, owner, namespace, worker_id)
        return count

    def remove_worker(self, worker_id: str) -> int:
        """Drop every key of the worker's blocks (its pool is gone); reported as one
        cleared event for the worker. Returns how many keys were dropped."""
        count = 0
        for block in self.blocks_on(worker_id):
            for key in self._by_block.pop(block):
                del self._entries[key]
                count += 1
                self._changes += 1
        if self.events is not None:
            self.events.cleared(worker_id)
        return count

    def blocks_on(self, worker_id: str) -> list[PhysicalBlock]:
        """Published blocks of one worker (O(published blocks); for worker loss)."""
        return [b for b in self._by_block if b.worker_id == worker_id]

    def match(
        self,
        salts: Sequence[Salt],
        token_bytes: bytes,
        max_blocks: int,
        host: Mapping[bytes, IndexEntry] | None = None,
    ) -> list[tuple[bytes, Any]]:
        """The longest chain of published blocks that spells the start of a prompt.

        Args:
            salts: owners to try at each block, in order of preference (the tenant's own,
                then public).
            token_bytes: the prompt, from `encode_tokens`.
            max_blocks: stop after this many blocks.
            host: the host tier's entries by key (cache_service.control.host_tier), looked
                up where this index has no entry; None: this index only.

        Returns:
            (key, block) per matched block, in logical order: a PhysicalBlock, or the
            entry's HostBlock for a block found in `host`.
        """
        stride = self.block_size * TOKEN_BYTES
        max_blocks = min(max_blocks, len(token_bytes) // stride)
        entries = self._entries
        found = self._shared_start(salts, token_bytes, max_blocks, stride)
        parent = found[-1][0] if found else ROOT_KEY
        for i in range(len(found), max_blocks):
            chunk = token_bytes[i * stride : (i + 1) * stride]
            for owner, salt in salts:
                key = block_key(parent, salt, chunk)
                entry = entries.get(key)
                if entry is None and host is not None:
                    entry = host.get(key)
                if (
                    entry is not None
                    and entry.tokens == chunk
                    and entry.parent == parent
                    and entry.owner == owner
                ):
                    break
            else:
                break
            found.append((key, entry.block))
            parent = key
        gpu = 0
        while gpu < len(found) and type(found[gpu][1]) is PhysicalBlock:
            gpu += 1
        self._last_match = (self._changes, tuple(salts), token_bytes, tuple(found[:gpu]))
        return found

    def _shared_start(
        self, salts: Sequence[Salt], token_bytes: bytes, max_blocks: int, stride: int
    ) -> list[tuple[bytes, Any]]:
        """The leading blocks the last match found that this prompt shares with its prompt
        (the same owners and bytes, the index unchanged since: so the same blocks a match
        from scratch finds; GPU blocks only, as a host tier's entries come and go on their
        own). A batch of prompts with one system prompt (CreateSequences) hashes and looks
        up its blocks once, not once per prompt."""
        last = self._last_match
        if last is None or last[0] != self._changes or last[1] != tuple(salts):
            return []
        prompt, blocks = last[2], last[3]
        n = shared_prefix_length(token_bytes, prompt, min(len(blocks), max_blocks), stride)
        return list(blocks[:n])
