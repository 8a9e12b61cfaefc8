"""A prompt's prefix keys, computed the way the service's prefix index computes them.

A router matches these against the `block_hashes` of KV events (`KVCacheClient.kv_events`)
to find where a prompt's longest cached prefix lives. The encoding is the service's
(cache_service/control/prefix_index.py; a test keeps the two equal):

- salt = sha256(material), material = b"tenant" + len32(name) + name + len32(fingerprint)
  + fingerprint for a tenant's keys, b"public" + len32(fingerprint) + fingerprint for
  public ones, then b"namespace" + len32(ns) + ns unless the namespace is the default "";
  len32 is a 4-byte little-endian length;
- key of a block = sha256(parent key || salt || its token ids as uint64 little-endian),
  the first block's parent being 32 zero bytes. Only full blocks have keys.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

__all__ = ["ROOT_BLOCK_HASH", "block_hashes", "prefix_salt"]

# The parent key of a prompt's first block.
ROOT_BLOCK_HASH = bytes(32)


def _field(data: bytes) -> bytes:
    return len(data).to_bytes(4, "little") + data


def prefix_salt(tenant: str | None, layout_fingerprint: str, namespace: str = "") -> bytes:
    """The 32-byte salt of a tenant's keys (tenant None: the public keys) in a namespace.

    Args:
        tenant: the tenant name ("default" on a server without authentication), or None.
        layout_fingerprint: the service's layout fingerprint (`ServiceInfo.fingerprint`).
        namespace: the prefix-cache namespace ("" = the default).
    """
    fingerprint = layout_fingerprint.encode()
    if tenant is None:
        material = b"public" + _field(fingerprint)
    else:
        material = b"tenant" + _field(tenant.encode()) + _field(fingerprint)
    if namespace:
        material += b"namespace" + _field(namespace.encode())
    return hashlib.sha256(material).digest()


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    layout_fingerprint: str,
    *,
    tenant: str | None = "default",
    namespace: str = "",
) -> list[bytes]:
    """The prefix keys of the full blocks of a prompt, in order (32 bytes each).

    Args:
        token_ids: the prompt's token ids, ints in [0, 2**64).
        block_size: tokens per block (`ServiceLayout.block_size`).
        layout_fingerprint: `ServiceInfo.fingerprint`.
        tenant: whose keys (None: the public keys).
        namespace: the prefix-cache namespace ("" = the default).

    Raises:
        ValueError: a token id that is not an int in [0, 2**64), or block_size < 1.
    """
    if type(block_size) is not int or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    salt = prefix_salt(tenant, layout_fingerprint, namespace)
    full = len(token_ids) // block_size * block_size
    try:
        data = struct.pack(f"<{full}Q", *token_ids[:full])
    except struct.error as exc:
        raise ValueError(f"token ids must be ints in [0, 2**64): {exc}") from None
    keys: list[bytes] = []
    parent = ROOT_BLOCK_HASH
    stride = block_size * 8
    for start in range(0, len(data), stride):
        parent = hashlib.sha256(parent + salt + data[start : start + stride]).digest()
        keys.append(parent)
    return keys
