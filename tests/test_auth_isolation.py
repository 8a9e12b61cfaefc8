"""Tenant isolation through the real server: tokens from a file, a loopback gRPC port,
in-process worker pools.

Tenant B cannot see, attend, append to, fork, free or export tenant A's sequences (the
answer is NOT_FOUND, word for word what an unknown id gets), B's lookup of A's private
prompt finds 0 cached tokens (the timing side channel of prefix sharing is closed), and a
prefix A explicitly published as public is shared with B.
"""

from __future__ import annotations

import json

import pytest
import torch
from service_support import HQ, LAYOUT, Mirror, ServiceHarness, local_workers, service_config

from cache_service.client import (
    AttendItem,
    KVCacheClient,
    NotFoundError,
    PermissionDeniedError,
    UnauthenticatedError,
)

pytestmark = pytest.mark.timeout(60)

TOKEN_A = "token-of-acme-0123456789"
TOKEN_B = "token-of-globex-abcdefgh"
TOKEN_C = "token-of-initech-zyxwvut"
TOKEN_OPS = "token-of-operators-1111"
PROMPT = list(range(500, 513))  # 13 tokens: three full blocks of 4 and one more


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory):
    tokens = tmp_path_factory.mktemp("auth") / "tokens.json"
    tokens.write_text(
        json.dumps(
            {
                "tokens": {
                    TOKEN_A: "acme",
                    TOKEN_B: "globex",
                    TOKEN_C: "initech",
                    TOKEN_OPS: "ops",
                },
                "tenants": {"acme": {"publish_public": True}, "ops": {"admin": True}},
            }
        )
    )
    workers = local_workers(2, 32)
    h = ServiceHarness(service_config(auth_file=str(tokens)), workers=workers)
    try:
        yield h
    finally:
        h.stop()


def _client(harness: ServiceHarness, token: str | None) -> KVCacheClient:
    return KVCacheClient(harness.address, token=token, timeout_s=20, max_attempts=1)


def _kv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (LAYOUT.num_layers, n, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def _prefill(client: KVCacheClient, tokens: list[int], seed: int) -> tuple[str, Mirror, int]:
    """A sequence holding `tokens` on every layer; returns (id, mirror, cached tokens)."""
    seq = client.create_sequence(tokens)
    cached = seq.num_cached_tokens
    mirror = Mirror(seq.seq_id, LAYOUT.num_layers)
    k, v = _kv(len(tokens), seed)
    if cached < len(tokens):
        client.append(seq.seq_id, tokens[cached:], k[:, cached:], v[:, cached:])
    for layer in range(LAYOUT.num_layers):
        mirror.add(layer, k[layer], v[layer])
    mirror.tokens = list(tokens)
    return seq.seq_id, mirror, cached


def _check_attend(client: KVCacheClient, mirror: Mirror, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for layer in range(LAYOUT.num_layers):
        q = torch.randn((3, HQ, LAYOUT.head_dim), generator=g)
        (out,) = client.attend(layer, [AttendItem(mirror.seq_id, q)])
        ref, _ = mirror.reference(layer, q)
        torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)


def test_missing_or_unknown_tokens_are_unauthenticated(harness: ServiceHarness) -> None:
    for token in (None, "not-a-known-token-000000"):
        with _client(harness, token) as c:
            with pytest.raises(UnauthenticatedError):
                c.create_sequence([1, 2, 3])
            with pytest.raises(UnauthenticatedError):
                c.lookup([1, 2, 3])
    assert harness.stats().active_sequences == 0


def test_other_tenants_sequences_are_invisible(harness: ServiceHarness) -> None:
    with _client(harness, TOKEN_A) as a, _client(harness, TOKEN_B) as b:
        seq_a, mirror_a, cached = _prefill(a, PROMPT, seed=1)
        assert cached == 0
        before = harness.stats()

        q = torch.randn((1, HQ, LAYOUT.head_dim))
        k1, v1 = _kv(1, seed=9)
        attempts = {
            "attend": lambda s: b.attend(0, [AttendItem(s, q)]),
            "append": lambda s: b.append(s, [7], k1, v1),
            "fork": lambda s: b.fork(s),
            "free": lambda s: b.free(s),
            "export": lambda s: b.export_blocks(s),
        }
        for name, attempt in attempts.items():
            with pytest.raises(NotFoundError) as foreign:
                attempt(seq_a)
            with pytest.raises(NotFoundError) as unknown:
                attempt("no-such-sequence-id")
            # Word for word what an unknown id gets: nothing tells B the id exists.
            assert str(foreign.value).replace(seq_a, "<id>") == str(unknown.value).replace(
                "no-such-sequence-id", "<id>"
            ), name
        # B may not publish at all (no permission), so it learns nothing from that either.
        with pytest.raises(PermissionDeniedError):
            b.publish_public(seq_a)

        after = harness.stats()
        assert after.active_sequences == before.active_sequences
        assert after.workers == before.workers
        harness.check_integrity()
        # A's sequence is untouched by all of it.
        _check_attend(a, mirror_a, seed=2)
        a.free(seq_a)


def test_private_prefixes_are_not_shared_until_published(harness: ServiceHarness) -> None:
    prompt = list(range(900, 913))
    with (
        _client(harness, TOKEN_A) as a,
        _client(harness, TOKEN_B) as b,
        _client(harness, TOKEN_C) as c,
    ):
        seq_a, mirror_a, _ = _prefill(a, prompt, seed=3)
        # A itself hits its cached prefix: the cache works, so B's 0 below is isolation.
        assert a.lookup(prompt) == 12
        assert b.lookup(prompt) == 0
        # C computes and stores its own copy: nothing of A's is adopted.
        seq_c, _, cached_c = _prefill(c, prompt, seed=4)
        assert cached_c == 0
        c.free(seq_c)

        with pytest.raises(PermissionDeniedError, match="publish_public"):
            c.publish_public(c.create_sequence([1]).seq_id)

        a.publish_public(seq_a)
        assert b.lookup(prompt) == 12
        shared = b.create_sequence(prompt)
        assert shared.num_cached_tokens == 12
        # B attends over A's published blocks plus its own last token.
        mirror_b = mirror_a.fork(shared.seq_id)
        k_last, v_last = _kv(1, seed=5)
        b.append(shared.seq_id, prompt[12:], k_last, v_last)
        for layer in range(LAYOUT.num_layers):
            mirror_b.k[layer] = [mirror_a.k[layer][0][:12], k_last[layer]]
            mirror_b.v[layer] = [mirror_a.v[layer][0][:12], v_last[layer]]
        _check_attend(b, mirror_b, seed=6)
        # Sharing a prefix does not expose the sequence: B still cannot touch A's.
        with pytest.raises(NotFoundError):
            b.fork(seq_a)
        b.free(shared.seq_id)
        a.free(seq_a)
        harness.check_integrity()


def test_per_tenant_statistics_are_private(harness: ServiceHarness) -> None:
    with _client(harness, TOKEN_A) as a, _client(harness, TOKEN_B) as b:
        a.free(a.create_sequence([1, 2, 3, 4, 5]).seq_id)
        b.free(b.create_sequence([6, 7, 8]).seq_id)
        assert set(a.stats().prefix) == {"acme"}
        assert set(b.stats().prefix) == {"globex"}
    with _client(harness, TOKEN_OPS) as ops:
        assert {"acme", "globex"} <= set(ops.stats().prefix)
