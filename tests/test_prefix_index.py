"""Unit tests of the prefix-hash index (cache_service/control/prefix_index.py)."""

from __future__ import annotations

import hashlib

import pytest

from cache_service import prefix_keys
from cache_service.control.prefix_index import (
    ROOT_KEY,
    IndexEntry,
    PrefixIndex,
    block_key,
    decode_tokens,
    encode_tokens,
    make_salt,
)
from cache_service.control.types import PhysicalBlock
from cache_service.errors import InvalidRequest

BS = 4
FP = "layout-a"


def publish_chain(
    index: PrefixIndex, owner: str | None, tokens: list[int], worker: str = "w"
) -> list[bytes]:
    """Publish tokens (a multiple of BS) as consecutive blocks 0, 1, ... of `worker`."""
    salt = make_salt(owner, FP)
    parent = ROOT_KEY
    keys = []
    for i in range(len(tokens) // BS):
        chunk = encode_tokens(tokens[i * BS : (i + 1) * BS])
        key = block_key(parent, salt.salt, chunk)
        assert index.publish(key, IndexEntry(PhysicalBlock(worker, i), parent, owner, chunk))
        keys.append(key)
        parent = key
    return keys


def test_key_depends_on_parent_salt_and_tokens() -> None:
    tokens = encode_tokens([1, 2, 3, 4])
    salt = make_salt("t", FP).salt
    key = block_key(ROOT_KEY, salt, tokens)
    assert key == block_key(ROOT_KEY, salt, encode_tokens([1, 2, 3, 4]))
    assert len(key) == 32
    assert key != block_key(key, salt, tokens)
    assert key != block_key(ROOT_KEY, make_salt("u", FP).salt, tokens)
    assert key != block_key(ROOT_KEY, make_salt(None, FP).salt, tokens)
    assert key != block_key(ROOT_KEY, make_salt("t", "layout-b").salt, tokens)
    assert key != block_key(ROOT_KEY, salt, encode_tokens([1, 2, 3, 5]))


def test_tenant_name_cannot_impersonate_public_or_shift_fingerprint() -> None:
    assert make_salt("public", FP) != make_salt(None, FP)
    # The separator keeps ("a", "b\x00c") and ("a\x00b", "c") apart.
    assert make_salt("a", "b\x00c").salt != make_salt("a\x00b", "c").salt


def test_match_returns_longest_chain_and_respects_max_blocks() -> None:
    index = PrefixIndex(BS)
    tokens = list(range(12))
    publish_chain(index, "t", tokens)
    salts = [make_salt("t", FP)]
    found = index.match(salts, encode_tokens([*tokens, 99]), 10)
    assert [b.index for _, b in found] == [0, 1, 2]
    assert len(index.match(salts, encode_tokens(tokens), 2)) == 2
    # A different second block stops the chain after the first.
    other = [*tokens[:4], 7, 7, 7, 7, *tokens[8:]]
    assert len(index.match(salts, encode_tokens(other), 10)) == 1
    # Another tenant's salt finds nothing; public finds nothing that was not made public.
    assert index.match([make_salt("u", FP), make_salt(None, FP)], encode_tokens(tokens), 10) == []


def test_public_chain_is_found_by_every_tenant_and_tenant_blocks_continue_it() -> None:
    index = PrefixIndex(BS)
    public_keys = publish_chain(index, None, list(range(8)))
    # Tenant u continues the public prefix with a private block.
    chunk = encode_tokens([50, 51, 52, 53])
    u_salt = make_salt("u", FP)
    key = block_key(public_keys[-1], u_salt.salt, chunk)
    index.publish(key, IndexEntry(PhysicalBlock("w", 9), public_keys[-1], "u", chunk))
    prompt = encode_tokens([*range(8), 50, 51, 52, 53, 0])
    found_u = index.match([u_salt, make_salt(None, FP)], prompt, 10)
    found_v = index.match([make_salt("v", FP), make_salt(None, FP)], prompt, 10)
    assert [b.index for _, b in found_u] == [0, 1, 9]
    assert [b.index for _, b in found_v] == [0, 1]


def test_hash_collision_never_returns_other_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a hash that maps everything to one key, only the exact tokens may match."""
    constant = hashlib.sha256(b"collide")
    monkeypatch.setattr(prefix_keys, "_sha256", lambda data: constant)
    index = PrefixIndex(BS)
    publish_chain(index, "t", [1, 2, 3, 4])
    salts = [make_salt("t", FP)]
    assert index.match(salts, encode_tokens([9, 9, 9, 9, 0]), 5) == []
    assert len(index.match(salts, encode_tokens([1, 2, 3, 4, 0]), 5)) == 1
    # A colliding key under another owner is refused too.
    assert index.match([make_salt("u", FP)], encode_tokens([1, 2, 3, 4, 0]), 5) == []


def test_publish_keeps_the_first_block_and_remove_drops_every_key() -> None:
    index = PrefixIndex(BS)
    keys = publish_chain(index, "t", [1, 2, 3, 4])
    chunk = encode_tokens([1, 2, 3, 4])
    assert not index.publish(keys[0], IndexEntry(PhysicalBlock("w", 5), ROOT_KEY, "t", chunk))
    assert index.get(keys[0]).block == PhysicalBlock("w", 0)  # type: ignore[union-attr]
    public = block_key(ROOT_KEY, make_salt(None, FP).salt, chunk)
    index.publish(public, IndexEntry(PhysicalBlock("w", 0), ROOT_KEY, None, chunk))
    assert len(index.keys_of(PhysicalBlock("w", 0))) == 2
    assert index.blocks_on("w") == [PhysicalBlock("w", 0)]
    assert index.remove_block(PhysicalBlock("w", 0)) == 2
    assert len(index) == 0 and not index.is_published(PhysicalBlock("w", 0))


@pytest.mark.parametrize("bad", [[1, -1], [1.5], ["a"], "abc", [2**64], None])
def test_bad_token_ids_are_rejected(bad: object) -> None:
    with pytest.raises(InvalidRequest, match="token ids"):
        encode_tokens(bad)  # type: ignore[arg-type]


def test_encoding_round_trips_and_is_little_endian() -> None:
    ids = [0, 1, 2**63, 2**64 - 1]
    data = encode_tokens(ids)
    assert data[:16] == bytes(8) + b"\x01" + bytes(7)
    assert decode_tokens(data) == ids


def test_a_match_sharing_the_last_ones_start_finds_what_a_fresh_match_finds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Match reuses the blocks the previous match found for the bytes both prompts share
    # while the index is unchanged; its answers must be those of a match from scratch,
    # whatever was published or removed between the calls, under one owner or two.
    import random

    shared = []
    real = PrefixIndex._shared_start

    def counted(self, *args):
        got = real(self, *args)
        shared.append(len(got))
        return got

    monkeypatch.setattr(PrefixIndex, "_shared_start", counted)
    rng = random.Random(5)
    index = PrefixIndex(BS)
    system = [rng.randrange(3) for _ in range(6 * BS)]
    blocks = 0
    last: list = []

    def prompt() -> list[int]:
        head = system[: rng.randrange(len(system) + 1)]
        return head + [rng.randrange(3) for _ in range(rng.randrange(3 * BS))]

    for _ in range(400):
        op = rng.random()
        if op < 0.15:  # publish a prompt's blocks under an owner, on fresh blocks
            tokens, owner = prompt(), rng.choice(["t", None])
            salt, parent = make_salt(owner, FP), ROOT_KEY
            for i in range(len(tokens) // BS):
                chunk = encode_tokens(tokens[i * BS : (i + 1) * BS])
                key = block_key(parent, salt.salt, chunk)
                index.publish(key, IndexEntry(PhysicalBlock("w", blocks), parent, owner, chunk))
                blocks += 1
                parent = key
        elif op < 0.25 and blocks:  # evict a block, often one the last match found
            found = [b for _, b in last]
            index.remove_block(rng.choice(found) if found else PhysicalBlock("w", 0))
        else:
            salts = rng.choice([[make_salt("t", FP)], [make_salt("t", FP), make_salt(None, FP)]])
            data, limit = encode_tokens(prompt()), rng.randrange(10)
            got = index.match(salts, data, limit)
            index._last_match = None
            assert got == index.match(salts, data, limit)
            last = got
    assert sum(1 for n in shared if n) > 20  # the reuse was exercised


def test_the_shared_prefix_length_is_the_longest_run_of_whole_units_two_sequences_share():
    # The halving search the prefix index (token bytes, whole blocks) and the client's
    # batch creates (token id lists) use, against a step-by-step count.
    import random

    rnd = random.Random(3)
    for _ in range(3000):
        unit = rnd.choice([1, 2, 3])
        a = [rnd.randrange(3) for _ in range(rnd.randrange(0, 13))]
        b = a[: rnd.randrange(len(a) + 1)] + [rnd.randrange(3) for _ in range(rnd.randrange(6))]
        limit = min(len(a), len(b)) // unit
        expected = 0
        while expected < limit and a[: (expected + 1) * unit] == b[: (expected + 1) * unit]:
            expected += 1
        assert prefix_keys.shared_prefix_length(a, b, limit, unit) == expected
        assert prefix_keys.shared_prefix_length(bytes(a), bytes(b), limit, unit) == expected
