"""The prefix cache's key encoding: one definition for the service's prefix index and for
the client's `block_hashes` (a router computes a prompt's keys to match KV events), so the
two cannot drift.

A block's key is sha256(parent key || salt || its token ids as uint64 little-endian), the
first block's parent being :data:`ROOT_KEY` (32 zero bytes). The salt is the sha256 of
length-prefixed fields (a 4-byte little-endian length before each, so no combination can
spell another's): b"tenant" + name + layout fingerprint for a tenant's keys, b"public" +
fingerprint for the public ones, then b"namespace" + namespace unless it is the default "".

Imports nothing of cache_service: the control plane and the client both use it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

__all__ = ["ROOT_KEY", "TOKEN_BYTES", "block_key", "salt_bytes", "shared_prefix_length"]

ROOT_KEY = bytes(32)
# Token ids are hashed as 8-byte little-endian unsigned ints.
TOKEN_BYTES = 8
# The block key's hash, apart from the salt's, so tests can make every key collide.
_sha256 = hashlib.sha256


def _field(data: bytes) -> bytes:
    return len(data).to_bytes(4, "little") + data


def salt_bytes(owner: str | None, layout_fingerprint: str, namespace: str = "") -> bytes:
    """The 32-byte salt of a tenant's keys (owner = its name) or of the public keys (owner
    None), in a namespace ("" = the default: nothing is added, so a namespace's salt never
    equals the default one's)."""
    fingerprint = _field(layout_fingerprint.encode())
    if owner is None:
        material = b"public" + fingerprint
    else:
        material = b"tenant" + _field(owner.encode()) + fingerprint
    if namespace:
        material += b"namespace" + _field(namespace.encode())
    return hashlib.sha256(material).digest()


def block_key(parent: bytes, salt: bytes, tokens: bytes) -> bytes:
    """Key of a block, 32 bytes: sha256(parent key || salt || tokens).

    Args:
        parent: key of the previous block of the prefix (ROOT_KEY for the first), 32 bytes.
        salt: the owner's salt (`salt_bytes`), 32 bytes.
        tokens: the block's token ids as uint64 little-endian (block_size * 8 bytes).
    """
    return _sha256(parent + salt + tokens).digest()


def shared_prefix_length(a: Sequence[Any], b: Sequence[Any], limit: int, unit: int = 1) -> int:
    """How many leading runs of `unit` items `a` and `b` share, at most `limit` runs:
    found by halving with slice comparisons (C loops, not a Python step per item), as a
    batch's prompts that begin with one system prompt are compared (token bytes in whole
    blocks by the prefix index, token id lists by the client)."""
    if a[: limit * unit] == b[: limit * unit]:
        return limit
    low, high = 0, limit  # `low` runs are shared, `high` are not
    while high - low > 1:
        mid = (low + high) // 2
        if a[: mid * unit] == b[: mid * unit]:
            low = mid
        else:
            high = mid
    return low
