"""CreateSequences / FreeSequences: a batch of sequences made or freed in one call, all or
nothing, through a real gRPC server."""

from __future__ import annotations

import re

import grpc
import pytest
import torch
from service_support import HQ, LAYOUT, ServiceHarness, local_workers, service_config

from cache_service._proto.kvcache.v1 import kvcache_pb2 as pb
from cache_service._proto.kvcache.v1 import kvcache_pb2_grpc as pb_grpc
from cache_service.client import (
    AppendAttendItem,
    InvalidArgumentError,
    KVCacheClient,
    NotFoundError,
)

D, HKV, BS = LAYOUT.head_dim, LAYOUT.num_kv_heads, LAYOUT.block_size


@pytest.fixture(scope="module")
def svc():
    with ServiceHarness(service_config(), local_workers(1, 64)) as h:
        yield h


def _live(client: KVCacheClient) -> int:
    return client.stats().active_sequences


def _write_prompt(client: KVCacheClient, seq_id: str, prompt: list[int]) -> None:
    """Append the prompt's K/V on every layer (so its full blocks become cached)."""
    gen = torch.Generator().manual_seed(len(prompt))
    n = len(prompt)
    for layer in range(LAYOUT.num_layers):
        kv = torch.randn(n, HKV, D, generator=gen)
        client.append_attend(
            layer, [AppendAttendItem(seq_id, prompt, kv, kv, torch.randn(n, HQ, D))]
        )


def test_a_batch_is_created_and_freed_in_one_call_each(svc: ServiceHarness) -> None:
    with KVCacheClient(svc.address) as client:
        before = _live(client)
        prompt = list(range(1, 2 * BS + 3))
        (first,) = client.create_sequences([prompt])
        _write_prompt(client, first.seq_id, prompt)
        # Prompts, empty sequences and a cached prefix in one call, answered in order.
        handles = client.create_sequences([prompt, None, prompt[: BS - 1], [*prompt, 7]])
        assert [h.num_cached_tokens for h in handles] == [2 * BS, 0, 0, 2 * BS]
        assert len({h.seq_id for h in handles} | {first.seq_id}) == 5
        assert _live(client) == before + 5
        client.free_sequences([h.seq_id for h in handles] + [first.seq_id])
        assert _live(client) == before
    svc.check_integrity()


def test_an_item_that_fails_leaves_nothing_created(svc: ServiceHarness) -> None:
    with KVCacheClient(svc.address) as client:
        before = _live(client)
        too_long = [1] * (64 * BS + 1)  # more tokens than the pool holds
        with pytest.raises(InvalidArgumentError, match=r"sequences\[2\]: "):
            client.create_sequences([[1, 2], None, too_long, [3]])
        assert _live(client) == before
        # A request id given twice in one batch would answer one sequence for two rows.
        with pytest.raises(InvalidArgumentError, match="share a request_id"):
            client.create_sequences([None, None], request_ids=["r-1", "r-1"])
        with pytest.raises(ValueError, match=r"prompts\[1\] must be token ids"):
            client.create_sequences([[1], [1, 2.5]])
        with pytest.raises(InvalidArgumentError, match=r"sequences\[0\]: "):
            client.create_sequences([[1, -3]])  # the server's check of the values
        with pytest.raises(ValueError, match="2 request ids for 3 prompts"):
            client.create_sequences([None] * 3, request_ids=["a", "b"])
        stub = pb_grpc.KVCacheStub(grpc.insecure_channel(svc.address))
        for request, message in (
            (pb.CreateSequencesRequest(), "1 to 4096 sequences, got 0"),
            (pb.CreateSequencesRequest(sequences=[pb.CreateSequenceRequest()] * 4097), "4097"),
            (
                pb.CreateSequencesRequest(
                    sequences=[
                        pb.CreateSequenceRequest(),
                        pb.CreateSequenceRequest(request_id="x" * 10_000),
                    ]
                ),
                r"sequences\[1\]: request_id is 10000 bytes",
            ),
        ):
            with pytest.raises(grpc.RpcError) as caught:
                stub.CreateSequences(request, timeout=20)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert re.search(message, caught.value.details() or "")
        assert _live(client) == before
    svc.check_integrity()


def test_a_shared_system_prompt_goes_once_and_every_row_gets_its_whole_prompt(
    svc: ServiceHarness,
) -> None:
    # The SDK sends the tokens every prompt begins with once
    # (CreateSequencesRequest.shared_prompt_token_ids); each sequence holds its whole
    # prompt, adopts the cached system prompt, and the server takes the same request
    # built by hand; a negative shared id is refused naming the field, nothing created.
    system = list(range(100, 100 + 2 * BS))
    sent: list[pb.CreateSequencesRequest] = []
    with KVCacheClient(svc.address) as client:
        before = _live(client)
        (first,) = client.create_sequences([[*system, 1]])
        _write_prompt(client, first.seq_id, [*system, 1])
        stub = client._stub
        real = stub.CreateSequences

        def spy(request: pb.CreateSequencesRequest, *args: object, **kwargs: object) -> object:
            sent.append(request)
            return real(request, *args, **kwargs)

        stub.CreateSequences = spy
        try:
            prompts = [[*system, 5, 6], [*system, 7], system]
            handles = client.create_sequences(prompts)
        finally:
            stub.CreateSequences = real
        assert list(sent[0].shared_prompt_token_ids) == system
        assert [list(item.prompt_token_ids) for item in sent[0].sequences] == [[5, 6], [7], []]
        assert [h.num_cached_tokens for h in handles] == [2 * BS, 2 * BS, BS]
        for handle, prompt in zip(handles, prompts, strict=True):
            info = svc.call(svc.coordinator.block_manager.sequence_info, "default", handle.seq_id)
            assert list(info.token_ids) == prompt[: handle.num_cached_tokens]
        raw = pb_grpc.KVCacheStub(grpc.insecure_channel(svc.address))
        reply = raw.CreateSequences(
            pb.CreateSequencesRequest(
                shared_prompt_token_ids=system,
                sequences=[
                    pb.CreateSequenceRequest(prompt_token_ids=[9]),
                    pb.CreateSequenceRequest(),
                ],
            ),
            timeout=20,
        )
        assert [c.num_cached_tokens for c in reply.sequences] == [2 * BS, BS]
        with pytest.raises(grpc.RpcError) as caught:
            raw.CreateSequences(
                pb.CreateSequencesRequest(
                    shared_prompt_token_ids=[1, -2],
                    sequences=[pb.CreateSequenceRequest(prompt_token_ids=[3])],
                ),
                timeout=20,
            )
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "shared_prompt_token_ids" in (caught.value.details() or "")
        with pytest.raises(grpc.RpcError) as caught:
            raw.CreateSequences(
                pb.CreateSequencesRequest(
                    shared_prompt_token_ids=system,
                    sequences=[
                        pb.CreateSequenceRequest(prompt_token_ids=[3]),
                        pb.CreateSequenceRequest(prompt_token_ids=[4, -1]),
                    ],
                ),
                timeout=20,
            )
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert re.search(r"sequences\[1\]: ", caught.value.details() or "")
        assert _live(client) == before + 6
        client.free_sequences([h.seq_id for h in handles] + [first.seq_id])
        client.free_sequences([c.seq_id for c in reply.sequences])
        assert _live(client) == before
    svc.check_integrity()


def test_a_retried_batch_answers_the_same_sequences(svc: ServiceHarness) -> None:
    with KVCacheClient(svc.address) as client:
        before = _live(client)
        ids = ["batch-retry-0", "batch-retry-1", "batch-retry-2"]
        first = client.create_sequences([[1, 2, 3], None, [4]], request_ids=ids)
        again = client.create_sequences([[1, 2, 3], None, [4]], request_ids=ids)
        assert [h.seq_id for h in again] == [h.seq_id for h in first]
        assert _live(client) == before + 3
        client.free_sequences([h.seq_id for h in first])
        assert _live(client) == before


def test_freeing_an_unknown_id_frees_none_of_the_batch(svc: ServiceHarness) -> None:
    with KVCacheClient(svc.address) as client:
        before = _live(client)
        handles = client.create_sequences([None, None])
        names = [handles[0].seq_id, "no-such-sequence", handles[1].seq_id]
        with pytest.raises(NotFoundError, match=r"seq_ids\[1\]: .*no-such-sequence"):
            client.free_sequences(names)
        assert _live(client) == before + 2
        with pytest.raises(InvalidArgumentError, match="more than once"):
            client.free_sequences([handles[0].seq_id, handles[0].seq_id])
        with pytest.raises(InvalidArgumentError, match=r"seq_ids\[1\] is empty"):
            client.free_sequences([handles[0].seq_id, ""])
        assert _live(client) == before + 2
        client.free_sequences([h.seq_id for h in handles])
        assert _live(client) == before
        with pytest.raises(NotFoundError, match=r"seq_ids\[0\]"):
            client.free_sequences([handles[0].seq_id])
