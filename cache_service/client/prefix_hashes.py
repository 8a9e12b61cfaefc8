"""A prompt's prefix keys, computed as the service's prefix index computes them
(`cache_service.prefix_keys`: the encoding both use).

A router matches these against the `block_hashes` of KV events (`KVCacheClient.kv_events`)
to find where a prompt's longest cached prefix lives. Only full blocks have keys.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from cache_service.prefix_keys import ROOT_KEY, TOKEN_BYTES, block_key, salt_bytes

__all__ = ["ROOT_BLOCK_HASH", "block_hashes", "prefix_salt"]

# The parent key of a prompt's first block.
ROOT_BLOCK_HASH = ROOT_KEY


def prefix_salt(tenant: str | None, layout_fingerprint: str, namespace: str = "") -> bytes:
    """The 32-byte salt of a tenant's keys (tenant None: the public keys) in a namespace.

    Args:
        tenant: the tenant name ("default" on a server without authentication), or None.
        layout_fingerprint: the service's layout fingerprint (`ServiceInfo.fingerprint`).
        namespace: the prefix-cache namespace ("" = the default).
    """
    return salt_bytes(tenant, layout_fingerprint, namespace)


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
    parent = ROOT_KEY
    stride = block_size * TOKEN_BYTES
    for start in range(0, len(data), stride):
        parent = block_key(parent, salt, data[start : start + stride])
        keys.append(parent)
    return keys
