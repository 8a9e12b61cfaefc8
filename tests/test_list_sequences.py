"""ListSequences: a tenant lists its own sequences (live and lost), a page at a time, over
the RPC, the client and the CLI; never another tenant's."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
from service_support import ServiceHarness, local_workers, service_config

from cache_service._proto.kvcache.v1 import kvcache_pb2 as pb
from cache_service._proto.kvcache.v1 import kvcache_pb2_grpc as pb_grpc
from cache_service.cli import main
from cache_service.client import KVCacheClient
from cache_service.control.block_manager import BlockManager, BlockManagerConfig

pytestmark = pytest.mark.timeout(120)

TOKEN_A, TOKEN_B = "token-of-acme-0123456789", "token-of-globex-0123456789"


def test_the_block_manager_pages_a_tenants_sequences_in_id_order_with_lost_ones() -> None:
    bm = BlockManager(BlockManagerConfig(block_size=4, num_layers=2, layout_fingerprint="fp"))
    bm.add_worker("w0", 8)
    bm.add_worker("w1", 8)
    mine = [bm.create_sequence("a", seq_id=f"s{i}") for i in range(5)]
    bm.create_sequence("b", seq_id="other")
    plan = bm.prepare_write("a", "s1", None, [1, 2, 3])
    bm.commit_write("a", "s1", None, 3)
    assert plan.start == 0
    lost_worker = plan.slots[0][0]
    lost = set(bm.lose_worker(lost_worker))
    assert {r.seq_id for r in lost} == {"s1"}

    page, more = bm.list_sequences("a", "", 2)
    assert [e.seq_id for e in page] == ["s0", "s1"] and more
    assert page[1].lost and page[1].num_tokens == 0 and page[1].written == ()
    assert not page[0].lost and page[0].written == (0, 0)
    page, more = bm.list_sequences("a", "s1", 10)
    assert [e.seq_id for e in page] == ["s2", "s3", "s4"] and not more
    assert len(mine) == 5
    assert [e.seq_id for e in bm.list_sequences("b")[0]] == ["other"]
    assert bm.list_sequences("nobody") == ([], False)


@pytest.fixture(scope="module")
def authed(tmp_path_factory: pytest.TempPathFactory):
    tokens = tmp_path_factory.mktemp("auth") / "tokens.json"
    tokens.write_text(json.dumps({"tokens": {TOKEN_A: "acme", TOKEN_B: "globex"}}))
    with ServiceHarness(service_config(auth_file=str(tokens)), local_workers(1, 64)) as h:
        yield h


def test_a_tenant_lists_only_its_own_sequences_page_by_page(authed, capsys) -> None:
    with (
        KVCacheClient(authed.address, token=TOKEN_A) as a,
        KVCacheClient(authed.address, token=TOKEN_B) as b,
    ):
        created = {a.create_sequence([1, 2, 3, 4, 5]).seq_id for _ in range(5)}
        theirs = b.create_sequence().seq_id
        entries = a.list_sequences(page_size=2)  # three pages
        assert [e.seq_id for e in entries] == sorted(created)
        assert all(e.num_tokens == 0 and e.written == (0, 0) and not e.lost for e in entries)
        assert [e.seq_id for e in b.list_sequences()] == [theirs]
        # A page token naming the other tenant's id shows nothing of theirs.
        channel = grpc.insecure_channel(authed.address)
        stub = pb_grpc.KVCacheStub(channel)
        meta = (("authorization", f"Bearer {TOKEN_A}"),)
        r = stub.ListSequences(pb.ListSequencesRequest(page_token=theirs), metadata=meta)
        assert theirs not in {e.seq_id for e in r.sequences}
        with pytest.raises(grpc.RpcError) as info:
            stub.ListSequences(pb.ListSequencesRequest(page_size=1001), metadata=meta)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "page_size" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            stub.ListSequences(pb.ListSequencesRequest())
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        channel.close()
        # The CLI lists the same.
        assert main(["sequences", "--target", authed.address, "--token", TOKEN_A]) == 0
        out = capsys.readouterr().out
        assert all(s in out for s in created) and theirs not in out
        for s in created:
            a.free(s)
        assert a.list_sequences() == []
        b.free(theirs)


def test_an_orphan_create_is_found_and_freed(tmp_path: Path) -> None:
    """A create whose caller never learned its id (e.g. answered UNAVAILABLE without a
    request id) is found by listing and freed, giving its blocks back."""
    with (
        ServiceHarness(service_config(), local_workers(1, 64)) as h,
        KVCacheClient(h.address) as client,
    ):
        channel = grpc.insecure_channel(h.address)
        pb_grpc.KVCacheStub(channel).CreateSequence(
            pb.CreateSequenceRequest(prompt_token_ids=list(range(9)))
        )  # its answer ignored: the caller lost it
        channel.close()
        (orphan,) = client.list_sequences()
        client.free(orphan.seq_id)
        assert client.list_sequences() == []
        assert h.stats().active_sequences == 0
        h.check_integrity()
