"""Step leases: a co-located client runs a planned step on the worker's pool itself
(engine.leases, workers.step_leases, workers.lease_server, workers.lease_client).

Against a real server (in-process CPU pools, the local session, the lease socket): leased
layers give what dense attention over everything written gives; the lease commits exactly
the layers its client reported when it ends (the client's next call, a free, a waiter, the
timeout), and an opened lease is waited for until its client reports, or revoked; a layer
outside the lease, twice, of the wrong size or with NaN is refused and writes nothing; a
lease is refused over the network and where no step was planned. (Generation through
transformers with leases: test_integration_transformers; across processes on Ray workers,
the pool in a shared memory file: test_service_e2e; on a GPU through CUDA IPC:
test_step_leases_gpu.)
"""

from __future__ import annotations

import json
import secrets
import socket
import threading
import time

import grpc
import pytest
import torch
from service_support import (
    HQ,
    LAYOUT,
    Mirror,
    ServiceHarness,
    dense_attention,
    local_workers,
    run_coordinator,
    service_config,
)

from cache_service._proto.kvcache.v1 import kvcache_pb2 as pb
from cache_service._proto.kvcache.v1 import kvcache_pb2_grpc as pb_grpc
from cache_service.client import InvalidArgumentError, KVCacheClient
from cache_service.engine.coordinator import Coordinator
from cache_service.errors import InvalidRequest, PoolExhausted
from workers.errors import InvalidWorkerRequest, WorkerUnavailable
from workers.lease_client import LeaseClient
from workers.lease_server import _layers, layer_mask, local_pool
from workers.pool import KVPool
from workers.step_leases import LeaseEnded, LeaseReport, StepLeases, StepPlan

pytestmark = pytest.mark.timeout(90)

D, HKV, NL = LAYOUT.head_dim, LAYOUT.num_kv_heads, LAYOUT.num_layers
CPU = torch.device("cpu")


def test_a_plan_and_a_layer_mask_survive_the_wire() -> None:
    plan = StepPlan(
        torch.tensor([[3, 1, 0], [2, 5, 4]], dtype=torch.int32),
        torch.tensor([40, 9], dtype=torch.int32),
        torch.tensor([0, 3, 4], dtype=torch.int32),
        torch.tensor([70, 71, 72, 41]),
        8,
        (1, 2, 5),
    )
    back = StepPlan.unpack(plan.pack())
    for name in ("block_tables", "seq_lens", "query_start_loc", "slot_mapping"):
        assert torch.equal(getattr(back, name), getattr(plan, name)), name
    assert (back.num_q_heads, back.layers) == (8, (1, 2, 5))
    with pytest.raises(ValueError, match="expected"):
        StepPlan.unpack(plan.pack()[:-1])
    assert _layers(layer_mask([0, 9, 63, 64], 9)) == [0, 9, 63, 64]


@pytest.fixture
def harness():
    with ServiceHarness(service_config(), local_workers(1, 64)) as h:
        yield h


@pytest.fixture
def client(harness):
    with KVCacheClient(harness.address) as c:
        yield c


class Batch:
    """A batch of sequences with their client-side truth (prompt written on every layer by
    calls), and the next decode step's tensors per layer."""

    def __init__(self, client: KVCacheClient, prompts: list[list[int]], seed: int) -> None:
        self.client = client
        self.gen = torch.Generator().manual_seed(seed)
        self.mirrors = []
        for prompt in prompts:
            handle = client.create_sequence(prompt)
            m = Mirror(handle.seq_id, NL)
            m.tokens = list(prompt)
            self.mirrors.append(m)
        for layer in range(NL):
            for m in self.mirrors:
                k, v = torch.randn(2, len(m.tokens), HKV, D, generator=self.gen)
                client.append(m.seq_id, m.tokens, k, v, layer)
                m.add(layer, k, v)

    @property
    def seq_ids(self) -> list[str]:
        return [m.seq_id for m in self.mirrors]

    def step(self) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per layer (k, v, q) of one decode step, ``[b, 1, H, D]`` each; the mirrors hold
        the new K/V once the caller wrote them (`wrote`)."""
        b = len(self.mirrors)
        out = {}
        for layer in range(NL):
            k, v = torch.randn(2, b, 1, HKV, D, generator=self.gen)
            q = torch.randn(b, 1, HQ, D, generator=self.gen)
            out[layer] = (k, v, q)
        return out

    def wrote(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        for i, m in enumerate(self.mirrors):
            m.add(layer, k[i], v[i])

    def reference(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        return torch.stack([m.reference(layer, q[i])[0] for i, m in enumerate(self.mirrors)])


def _first_layer(batch: Batch, step: dict, token: int) -> torch.Tensor:
    """Layer 0 of the step by call (which plans it), the token appended to every row."""
    k, v, q = step[0]
    ids = [[token]] * len(batch.mirrors)
    out = batch.client.append_attend_batch(0, batch.seq_ids, ids, k, v, q)
    batch.wrote(0, k, v)
    return out


def _opened_lease(client: KVCacheClient, prompts: list[list[int]], seed: int, token: int):
    """A batch whose step's layer 0 went by call (`token` appended to every row), the
    lease on its other layers, a lease connection and the lease opened on it:
    (batch, step, lease, lease client, opened step)."""
    batch = Batch(client, prompts, seed=seed)
    step = batch.step()
    _first_layer(batch, step, token)
    lease = client.lease_step(batch.seq_ids, HQ)
    lc = LeaseClient(lease.socket, CPU)
    return batch, step, lease, lc, lc.open(lease.lease_id)


def _close(a: torch.Tensor, ref: torch.Tensor) -> None:
    assert torch.allclose(a.double(), ref.double(), atol=2e-5), (a.double() - ref).abs().max()


def _written(harness, seq_id: str) -> list[int]:
    info = harness.call(harness.coordinator.block_manager.sequence_info, "default", seq_id)
    return list(info.written)


def _run_layers(batch, lease_client, opened, step, layers) -> None:
    for layer in layers:
        k, v, q = step[layer]
        out = lease_client.run_layer(opened, layer, k, v, q)
        batch.wrote(layer, k, v)
        _close(out.view(q.shape), batch.reference(layer, q))


def test_leased_layers_equal_dense_attention_and_commit_at_the_next_call(harness, client):
    batch = Batch(client, [[1, 2, 3], [4, 5, 6, 7, 8, 9]], seed=0)
    step = batch.step()
    _close(_first_layer(batch, step, 11), batch.reference(0, step[0][2]))
    lease = client.lease_step(batch.seq_ids, HQ)
    assert lease.granted, lease.reason
    assert list(lease.layers) == list(range(1, NL)) and lease.timeout_us > 0
    lc = LeaseClient(lease.socket, CPU)
    opened = lc.open(lease.lease_id)
    _run_layers(batch, lc, opened, step, lease.layers)
    assert lc.end(opened) == LeaseReport(tuple(range(1, NL)), ())
    # The lease still holds the batch: nothing committed yet on the leased layers.
    assert _written(harness, batch.seq_ids[0]) == [4] + [3] * (NL - 1)
    # The next call (another step) ends it: every leased layer committed, then planned on.
    step2 = batch.step()
    _close(_first_layer(batch, step2, 12), batch.reference(0, step2[0][2]))
    assert _written(harness, batch.seq_ids[0]) == [5] + [4] * (NL - 1)
    assert lc.open(lease.lease_id) is None  # ended
    lease2 = client.lease_step(batch.seq_ids, HQ)
    assert lease2.granted and lease2.lease_id != lease.lease_id
    opened = lc.open(lease2.lease_id)
    _run_layers(batch, lc, opened, step2, lease2.layers)
    lc.end(opened)
    for s in batch.seq_ids:
        client.free(s)
    lc.close()
    harness.check_integrity()
    stats = harness.stats()
    assert stats.active_sequences == 0
    assert all(w.used == 0 for w in stats.workers.values()), stats.workers


def test_a_grant_naming_the_clients_connection_opens_the_lease_and_sends_its_plan(harness, client):
    # The request names this process's lease connection: the worker opens the lease for
    # it at the grant and the answer carries the plan, so no OPEN goes over the socket.
    batch = Batch(client, [[1, 2, 3], [4, 5]], seed=21)
    step = batch.step()
    _first_layer(batch, step, 4)
    first = client.lease_step(batch.seq_ids, HQ)
    assert first.granted and first.plan == b""  # no connection named: OPEN as before
    lc = LeaseClient(first.socket, CPU)
    opened = lc.open(first.lease_id)
    _run_layers(batch, lc, opened, step, first.layers)
    lc.end(opened)
    step2 = batch.step()
    _first_layer(batch, step2, 5)
    # Another connection's token, or one that closed, gets no plan: the lease waits for
    # an OPEN.
    _, leases = local_pool(lc.path)
    other = LeaseClient(first.socket, CPU)
    gone = other.connection
    other.close()
    deadline = time.monotonic() + 10
    while gone in leases._connections and time.monotonic() < deadline:
        time.sleep(0.01)  # the worker's connection thread sees the close
    for token in (gone, secrets.token_bytes(16)):
        # (Each request ends the one before: never opened, nothing written.)
        stray = client.lease_step(batch.seq_ids, HQ, lease_connections={lc.path: token})
        assert stray.granted and stray.plan == b"", token
    lease = client.lease_step(batch.seq_ids, HQ, lease_connections={lc.path: lc.connection})
    assert lease.granted and lease.plan
    asked = []
    worker_open = leases.open
    leases.open = lambda lease_id, conn: asked.append(lease_id) or worker_open(lease_id, conn)
    opened = lc.open(lease.lease_id, lease.plan)
    assert asked == []  # nothing asked of the worker
    with pytest.raises(InvalidWorkerRequest, match="open already"):
        lc.open(lease.lease_id)  # the grant opened it for this connection
    assert asked == [lease.lease_id]
    del leases.open
    _run_layers(batch, lc, opened, step2, lease.layers)
    assert lc.end(opened) == LeaseReport(tuple(range(1, NL)), ())
    step3 = batch.step()  # the next call commits the leased layers
    _close(_first_layer(batch, step3, 6), batch.reference(0, step3[0][2]))
    assert _written(harness, batch.seq_ids[0]) == [6] + [5] * (NL - 1)
    for s in batch.seq_ids:
        client.free(s)
    lc.close()
    harness.check_integrity()


def test_a_lease_ended_before_it_was_opened_sends_its_layers_by_call(harness, client):
    batch = Batch(client, [[1, 2, 3, 4, 5]], seed=1)
    step = batch.step()
    _first_layer(batch, step, 7)
    lease = client.lease_step(batch.seq_ids, HQ)
    # The client's own call on layer 1 ends the lease (never opened: nothing written)
    # and writes the layer itself.
    k, v, q = step[1]
    out = client.append_attend_batch(1, batch.seq_ids, [[7]], k, v, q)
    batch.wrote(1, k, v)
    _close(out, batch.reference(1, q))
    lc = LeaseClient(lease.socket, CPU)
    assert lc.open(lease.lease_id) is None
    assert lc.open(secrets.token_bytes(16)) is None  # never granted
    harness.check_integrity()


def test_a_layer_outside_the_lease_twice_or_of_another_size_is_refused(harness, client):
    batch, step, lease, lc, opened = _opened_lease(client, [[1, 2], [3, 4, 5]], 2, 3)
    with pytest.raises(InvalidWorkerRequest, match="open already"):
        lc.open(lease.lease_id)
    with pytest.raises(InvalidWorkerRequest, match="layer 0 is not the lease's"):
        lc.run_layer(opened, 0, *step[0])
    k, v, q = step[1]
    with pytest.raises(InvalidWorkerRequest, match="2 query rows"):
        lc.run_layer(opened, 1, k[:1], v[:1], q[:1])
    with pytest.raises(InvalidWorkerRequest, match="2 query rows"):
        lc.run_layer(opened, 1, k, v, q[..., :HKV, :])
    _run_layers(batch, lc, opened, step, [1])
    with pytest.raises(InvalidWorkerRequest, match="layer 1 is not the lease's"):
        lc.run_layer(opened, 1, k, v, q)
    assert lc.end(opened).written == (1,)
    client.free(batch.seq_ids[0])  # ends the lease: layer 1 committed, the others not
    assert _written(harness, batch.seq_ids[1]) == [4, 4] + [3] * (NL - 2)
    harness.check_integrity()


def test_a_non_finite_leased_layer_writes_nothing_and_is_reported(harness, client):
    batch, step, _, lc, opened = _opened_lease(client, [[1, 2, 3]], 3, 4)
    k, v, q = step[1]
    lc.run_layer(opened, 1, k * float("nan"), v, q)
    assert lc.end(opened) == LeaseReport((), (1,))
    # Ending the lease commits nothing on layer 1: it is still short by the step's token,
    # and the call that writes it gives what dense attention gives.
    out = client.append_attend_batch(1, batch.seq_ids, [[4]], k, v, q)
    batch.wrote(1, k, v)
    _close(out, batch.reference(1, q))
    harness.check_integrity()


def test_a_free_waits_for_an_opened_lease_and_leaks_nothing(harness, client):
    batch, step, _, lc, opened = _opened_lease(client, [[1, 2, 3], [9, 9]], 4, 5)
    _run_layers(batch, lc, opened, step, [1])
    freed = threading.Event()

    def free() -> None:
        with KVCacheClient(harness.address) as other:
            other.free(batch.seq_ids[0])
        freed.set()

    thread = threading.Thread(target=free)
    thread.start()
    # The lease's client is still writing: the free waits for its report.
    assert not freed.wait(0.5)
    lc.end(opened)
    assert freed.wait(10)
    thread.join()
    assert _written(harness, batch.seq_ids[1]) == [3, 3] + [2] * (NL - 2)
    client.free(batch.seq_ids[1])
    harness.check_integrity()
    stats = harness.stats()
    assert stats.active_sequences == 0
    assert all(w.used == 0 for w in stats.workers.values()), stats.workers
    assert len(harness.coordinator._leases) == 0


def test_a_lease_ends_at_its_timeout_and_an_unreported_one_is_revoked():
    config = service_config(**{"coordinator.step_lease_timeout_s": 0.2})
    with (
        ServiceHarness(config, local_workers(1, 64)) as harness,
        KVCacheClient(harness.address) as client,
    ):
        batch = Batch(client, [[1, 2, 3]], seed=5)
        step = batch.step()
        _first_layer(batch, step, 6)
        lease = client.lease_step(batch.seq_ids, HQ)
        assert lease.timeout_us == 200_000
        lc = LeaseClient(lease.socket, CPU)
        deadline = time.monotonic() + 10
        while len(harness.coordinator._leases) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lc.open(lease.lease_id) is None
        # Opened and never reported: waited for, then revoked; nothing committed and the
        # connection closed.
        batch = Batch(client, [[4, 5]], seed=15)
        step = batch.step()
        _first_layer(batch, step, 7)
        lease = client.lease_step(batch.seq_ids, HQ)
        assert lease.granted, lease.reason
        opened = lc.open(lease.lease_id)
        lc.run_layer(opened, 1, *step[1])
        while len(harness.coordinator._leases) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not harness.coordinator._leases
        with pytest.raises(WorkerUnavailable):  # the report, or the next request, fails
            lc.end(opened)
            lc.open(secrets.token_bytes(16))
        assert _written(harness, batch.seq_ids[0]) == [3] + [2] * (NL - 1)
        harness.check_integrity()


def test_a_report_the_worker_no_longer_expects_fails_the_next_request(harness, client):
    # END is not waited for: its answer is read by the connection's next request, which
    # raises when the report came after the lease was gone (here: a newer coordinator's
    # claim cleared the worker's leases).
    _, step, _, lc, opened = _opened_lease(client, [[1, 2, 3]], 16, 4)
    lc.run_layer(opened, 1, *step[1])
    harness.coordinator._clients["w0"].worker._leases.clear()
    assert lc.end(opened).written == (1,)  # what the client did; not yet confirmed
    with pytest.raises(LeaseEnded, match="none of it was kept"):
        lc.open(secrets.token_bytes(16))
    assert lc.open(secrets.token_bytes(16)) is None  # the connection still serves
    lc.close()


def test_no_lease_without_a_planned_step_or_with_bad_arguments(client):
    batch = Batch(client, [[1, 2, 3]], seed=6)
    reply = client.lease_step(batch.seq_ids, HQ)
    assert not reply.granted and "no planned step" in reply.reason
    with pytest.raises(InvalidArgumentError, match="num_q_heads"):
        client.lease_step(batch.seq_ids, HKV + 1)
    with pytest.raises(InvalidArgumentError):
        client.lease_step([], HQ)
    step = batch.step()
    _first_layer(batch, step, 8)
    # Another batch order is another batch: no step planned for it.
    assert not client.lease_step([*batch.seq_ids[::-1], "x"], HQ).granted


def test_a_lease_is_refused_over_the_network(harness):
    channel = grpc.insecure_channel(harness.address)
    stub = pb_grpc.KVCacheStub(channel)
    request = pb.SessionRequest(
        call_id=1, step_lease=pb.StepLeaseRequest(seq_ids=["a"], num_q_heads=HQ)
    )
    (reply,) = list(stub.Session(iter([request])))
    assert reply.WhichOneof("result") == "error"
    assert reply.error.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert "local session" in reply.error.message
    channel.close()
    # And a client without a local session gets no lease (it sends every layer by call).
    with KVCacheClient(harness.address, local_session=False) as c:
        assert c.lease_step(["a"], HQ) is None


def test_the_worker_refuses_a_bad_hello_or_request(client):
    batch = Batch(client, [[1, 2, 3]], seed=8)
    _first_layer(batch, batch.step(), 10)
    lease = client.lease_step(batch.seq_ids, HQ)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as raw:
        raw.connect(lease.socket)
        raw.send(json.dumps({"version": 1}).encode())
        reply = json.loads(raw.recv(1 << 16))
        assert not reply["ok"] and "version 3 only" in reply["error"]
    with pytest.raises(WorkerUnavailable, match="lease socket"):
        LeaseClient(lease.socket + ".missing", CPU)
    lc = LeaseClient(lease.socket, CPU)
    code, body = lc._request(b"\x07junk")
    assert code == 2 and b"a request is OPEN" in body
    # A head of (width 1, 1 step, 0 tokens) followed by one byte where two masks belong.
    head = b"\x02" + lease.lease_id + b"\x01\x00" + b"\x01\x00" + b"\x00" * 4
    code, body = lc._request(head + b"\xff")
    assert code == 2 and b"two bitmasks" in body
    lc.close()


def test_a_report_is_checked_against_the_lease():
    pool = KVPool(LAYOUT, 8)
    leases = StepLeases(pool)
    lease_id = secrets.token_bytes(16)
    leases.grant(lease_id, [0, 1], [[0]], [1], [0, 1], [0], HQ)
    with pytest.raises(InvalidWorkerRequest):
        leases.grant(lease_id, [1], [[0]], [1], [0, 1], [0], HQ)  # id in use
    with pytest.raises(InvalidWorkerRequest, match="block"):
        leases.grant(secrets.token_bytes(16), [1], [[8]], [1], [0, 1], [0], HQ)
    mine, other = object(), object()
    leases.open(lease_id, mine)
    with pytest.raises(InvalidWorkerRequest, match="not opened on this connection"):
        leases.report(lease_id, other, [1], [])
    with pytest.raises(InvalidWorkerRequest, match="does not cover"):
        leases.report(lease_id, mine, [3], [])
    with pytest.raises(InvalidWorkerRequest, match="does not cover"):
        leases.report(lease_id, mine, [1], [1])
    assert leases.end(lease_id) is None  # opened, not reported
    leases.report(lease_id, mine, [1], [0])
    with pytest.raises(InvalidWorkerRequest, match="reported already"):
        leases.report(lease_id, mine, [1], [])
    assert leases.end(lease_id) == LeaseReport((1,), (0,))
    assert leases.end(lease_id) == LeaseReport((), ())
    with pytest.raises(LeaseEnded):
        leases.open(lease_id, mine)
    # A connection that closes reports nothing for its open leases.
    leases.grant(lease_id, [1], [[0]], [1], [0, 1], [0], HQ)
    leases.open(lease_id, mine)
    leases.disconnected(mine)
    assert leases.wait(lease_id, 0.0) == LeaseReport((), ())
    assert len(leases) == 0


def test_a_step_planned_for_a_lease_writes_every_layer_by_lease(harness, client):
    # No call at all: the service plans the step of these tokens and leases every layer.
    batch = Batch(client, [[1, 2, 3], [4, 5, 6, 7, 8, 9]], seed=9)
    step = batch.step()
    lease = client.lease_step(batch.seq_ids, HQ, [[21], [22]])
    assert lease.granted, lease.reason
    assert list(lease.layers) == list(range(NL))
    with LeaseClient(lease.socket, CPU) as lc:
        opened = lc.open(lease.lease_id)
        _run_layers(batch, lc, opened, step, range(NL))
        lc.end(opened)
    client.free(batch.seq_ids[1])  # ends the lease: every layer of the step committed
    info = harness.call(
        harness.coordinator.block_manager.sequence_info, "default", batch.seq_ids[0]
    )
    assert list(info.written) == [4] * NL and list(info.token_ids) == [1, 2, 3, 21]
    harness.check_integrity()


def test_a_planned_step_no_layer_wrote_gives_its_positions_back(harness, client):
    batch = Batch(client, [[1, 2, 3]], seed=10)
    lease = client.lease_step(batch.seq_ids, HQ, [[31, 32]])
    assert lease.granted
    # The client's call with other tokens ends the lease first: nothing was written, so
    # the reservation of 31, 32 is gone and the call's own tokens are planned.
    k, v, q = (t for t in batch.step()[0])
    out = client.append_attend_batch(0, batch.seq_ids, [[41]], k, v, q)
    batch.wrote(0, k, v)
    _close(out, batch.reference(0, q))
    info = harness.call(
        harness.coordinator.block_manager.sequence_info, "default", batch.seq_ids[0]
    )
    assert list(info.token_ids) == [1, 2, 3, 41]
    harness.check_integrity()


def test_a_planned_step_with_bad_tokens_reserves_nothing(harness, client):
    batch = Batch(client, [[1, 2, 3], [4, 5]], seed=11)
    with pytest.raises(ValueError, match="1 rows for 2 sequences"):
        client.lease_step(batch.seq_ids, HQ, [[1]])
    with pytest.raises(InvalidArgumentError, match="at least one new token"):
        client.lease_step(batch.seq_ids, HQ, [[1], []])
    with pytest.raises(InvalidArgumentError, match="distinct sequences"):
        client.lease_step([batch.seq_ids[0]] * 2, HQ, [[1], [2]])
    # A lease planned and partly written leaves positions reserved for its tokens: a
    # later plan naming other tokens there is refused, naming the position.
    lease = client.lease_step(batch.seq_ids, HQ, [[7], [8]])
    lc = LeaseClient(lease.socket, CPU)
    opened = lc.open(lease.lease_id)
    lc.run_layer(opened, 1, *batch.step()[1])
    lc.end(opened)
    with pytest.raises(InvalidArgumentError, match="position 3 holds token 7"):
        client.lease_step(batch.seq_ids, HQ, [[9], [8]])
    harness.check_integrity()
    before = harness.stats()
    with pytest.raises(InvalidArgumentError):
        client.lease_step(batch.seq_ids, HQ, [[9], [8]])
    assert harness.stats().workers == before.workers


def test_a_ragged_step_planned_for_a_lease(harness, client):
    # Sequences sending different numbers of new tokens (a ragged prefill): one step, the
    # queries each sequence's own new tokens, causal within them.
    batch = Batch(client, [[1, 2, 3], [4, 5, 6, 7, 8]], seed=12)
    counts = [3, 1]
    lease = client.lease_step(batch.seq_ids, HQ, [[11, 12, 13], [14]])
    assert lease.granted, lease.reason
    lc = LeaseClient(lease.socket, CPU)
    opened = lc.open(lease.lease_id)
    gen = torch.Generator().manual_seed(13)
    for layer in range(NL):
        k, v = torch.randn(2, sum(counts), HKV, D, generator=gen)
        q = torch.randn(sum(counts), HQ, D, generator=gen)
        out = lc.run_layer(opened, layer, k, v, q)
        start = 0
        for m, c in zip(batch.mirrors, counts, strict=True):
            m.add(layer, k[start : start + c], v[start : start + c])
            for j in range(c):
                # Row j sees the keys up to its own position.
                length = m.length(layer) - (c - 1 - j)
                keys = torch.cat(m.k[layer])[:length]
                values = torch.cat(m.v[layer])[:length]
                ref = dense_attention(q[start + j : start + j + 1], keys, values)[0]
                _close(out[start + j : start + j + 1], ref)
            start += c
    lc.end(opened)
    client.free(batch.seq_ids[0])
    info = harness.call(
        harness.coordinator.block_manager.sequence_info, "default", batch.seq_ids[1]
    )
    assert list(info.written) == [6] * NL
    harness.check_integrity()


def test_differing_tokens_are_named_by_item_before_an_earlier_item_exhausts_the_pool():
    # The block manager checks the tokens at reserved positions itself; the items are
    # checked one by one only once it refused the batch, and that error (naming the item)
    # still comes first, as when every item was checked before reserving anything.
    async def scenario(coord: Coordinator) -> None:
        a, b = [(await coord.create_sequence("default")).seq_id for _ in range(2)]
        leases = coord._clients["w0"].worker._leases  # type: ignore[attr-defined]
        me = object()
        grant = await coord.lease_step("default", [a], HQ, [[1, 2, 3, 4]])  # a full block
        leases.open(grant.lease_id, me)
        leases.report(grant.lease_id, me, grant.layers, [])
        grant = await coord.lease_step("default", [b], HQ, [[5]])
        leases.open(grant.lease_id, me)
        leases.report(grant.lease_id, me, [1], [])  # layer 0's position 0 stays reserved
        # a's next token needs a third block of two; b's differs from the reserved one.
        with pytest.raises(InvalidRequest, match=r"items\[1\]: position 0 holds token 5"):
            await coord.lease_step("default", [a, b], HQ, [[9], [6]])
        info = coord.block_manager.sequence_info
        assert list(info("default", a).token_ids) == [1, 2, 3, 4]
        assert list(info("default", b).token_ids) == [5]
        with pytest.raises(PoolExhausted):  # the same step with b's own token
            await coord.lease_step("default", [a, b], HQ, [[9], [5]])
        coord.block_manager.check_integrity()

    run_coordinator(scenario, blocks=2)


# ---- leases of several decode steps ------------------------------------------------------


def _run_step(batch, lc, opened, layers) -> None:
    """One decode step of `batch` under the opened lease, on `layers`, checked against
    dense attention."""
    _run_layers(batch, lc, opened, batch.step(), layers)


def test_a_lease_of_several_steps_runs_them_and_commits_what_ran(harness, client):
    batch = Batch(client, [[1, 2, 3], [4, 5, 6, 7, 8, 9]], seed=30)
    lease = client.lease_step(batch.seq_ids, HQ, [[21], [22]], steps=4)
    assert lease.granted, lease.reason
    assert lease.steps == 4 and list(lease.layers) == list(range(NL))
    # The later steps' positions are reserved; their tokens are not known yet.
    assert _written(harness, batch.seq_ids[0]) == [3] * NL
    with LeaseClient(lease.socket, CPU) as lc:
        opened = lc.open(lease.lease_id)
        assert (opened.steps, opened.index) == (4, 0)
        _run_step(batch, lc, opened, range(NL))
        lc.advance(opened, [23, 24])
        _run_step(batch, lc, opened, range(NL))
        lc.advance(opened, [25, 26])
        _run_step(batch, lc, opened, [0])  # the third step ends part way
        report = lc.end(opened)
        assert report == LeaseReport((0,), (), 3, (23, 24, 25, 26))
    client.free(batch.seq_ids[1])  # ends the lease
    info = harness.call(
        harness.coordinator.block_manager.sequence_info, "default", batch.seq_ids[0]
    )
    assert list(info.token_ids) == [1, 2, 3, 21, 23, 25]
    assert list(info.written) == [6] + [5] * (NL - 1)
    # The sequence carries on by call from what was committed.
    step = batch.step()
    for layer in range(1, NL):
        k, v, q = step[layer]
        out = client.append_attend_batch(layer, batch.seq_ids[:1], [[25]], k[:1], v[:1], q[:1])
        batch.mirrors[0].add(layer, k[0], v[0])
        _close(out[0], batch.mirrors[0].reference(layer, q[0])[0])
    client.free(batch.seq_ids[0])
    harness.check_integrity()
    stats = harness.stats()
    assert stats.active_sequences == 0
    assert all(w.used == 0 for w in stats.workers.values()), stats.workers


def test_the_steps_not_run_go_back_and_a_lease_never_opened_keeps_nothing(harness, client):
    batch = Batch(client, [[1, 2, 3]], seed=31)
    used = harness.stats().workers["w0"].used
    lease = client.lease_step(batch.seq_ids, HQ, [[5]], steps=8)  # blocks for 11 tokens
    assert lease.granted and lease.steps == 8
    assert harness.stats().workers["w0"].used > used
    # The client's next call ends the lease: never opened, nothing committed, every
    # reserved position given back.
    lease = client.lease_step(batch.seq_ids, HQ, [[6]], steps=2)
    with LeaseClient(lease.socket, CPU) as lc:
        opened = lc.open(lease.lease_id)
        _run_step(batch, lc, opened, range(NL))
        lc.end(opened)  # one step of two
    client.lease_step(batch.seq_ids, HQ, [[7]])  # ends it
    info = harness.call(
        harness.coordinator.block_manager.sequence_info, "default", batch.seq_ids[0]
    )
    assert list(info.token_ids) == [1, 2, 3, 6, 7] and list(info.written) == [4] * NL
    harness.check_integrity()


def test_a_lease_covers_at_most_the_configured_steps_and_fewer_without_room():
    config = service_config(**{"coordinator.max_lease_steps": 8})
    with (
        ServiceHarness(config, local_workers(1, 4)) as harness,
        KVCacheClient(harness.address) as client,
    ):
        batch = Batch(client, [[1, 2, 3]], seed=32)
        assert client.lease_step(batch.seq_ids, HQ, [[4]], steps=50).steps == 8
        client.free(batch.seq_ids[0])
        other = Batch(client, [[1] * 9], seed=33)  # three of the four blocks taken
        # No room for 8 steps' positions (they need two more blocks): one step.
        lease = client.lease_step(other.seq_ids, HQ, [[2]], steps=8)
        assert lease.granted and lease.steps == 1, lease
        harness.check_integrity()


def test_a_multi_step_lease_refuses_what_does_not_fit_it(harness, client):
    batch = Batch(client, [[1, 2, 3], [4, 5]], seed=34)
    with pytest.raises(InvalidArgumentError, match="one new token per sequence a step"):
        client.lease_step(batch.seq_ids, HQ, [[1, 2], [3]], steps=2)
    with pytest.raises(InvalidArgumentError, match="needs token_ids"):
        client.lease_step(batch.seq_ids, HQ, None, steps=2)
    assert _written(harness, batch.seq_ids[0]) == [3] * NL
    lease = client.lease_step(batch.seq_ids, HQ, [[6], [7]], steps=2)
    with LeaseClient(lease.socket, CPU) as lc:
        opened = lc.open(lease.lease_id)
        step = batch.step()
        _run_layers(batch, lc, opened, step, [0])
        with pytest.raises(InvalidWorkerRequest, match="not complete"):
            lc.advance(opened, [8, 9])  # layers 1.. not run yet
        _run_layers(batch, lc, opened, step, range(1, NL))
        with pytest.raises(InvalidWorkerRequest, match="one token id"):
            lc.advance(opened, [8])
        with pytest.raises(InvalidWorkerRequest, match="one token id"):
            lc.advance(opened, [8, -9])
        assert opened.index == 0
        lc.advance(opened, [8, 9])
        with pytest.raises(InvalidWorkerRequest, match="all run"):
            lc.advance(opened, [10, 11])
        lc.end(opened)
    for seq_id in batch.seq_ids:
        client.free(seq_id)
    harness.check_integrity()
    assert all(w.used == 0 for w in harness.stats().workers.values())


def test_a_non_finite_layer_ends_a_multi_step_lease_at_its_step(harness, client):
    batch = Batch(client, [[1, 2, 3]], seed=35)
    lease = client.lease_step(batch.seq_ids, HQ, [[6]], steps=3)
    with LeaseClient(lease.socket, CPU) as lc:
        opened = lc.open(lease.lease_id)
        _run_step(batch, lc, opened, range(NL))
        lc.advance(opened, [7])
        step = batch.step()
        k, v, q = step[1]
        k = k.clone()
        k[0, 0, 0, 0] = float("nan")
        _run_layers(batch, lc, opened, step, [0])
        lc.run_layer(opened, 1, k, v, q)
        assert lc.step_refused(opened) == (1,)
        with pytest.raises(InvalidWorkerRequest, match="refused"):
            lc.advance(opened, [8])
        assert lc.end(opened) == LeaseReport((0,), (1,), 2, (7,))
    client.free(batch.seq_ids[0])
    harness.check_integrity()


def test_a_report_of_steps_is_checked_against_the_lease():
    pool = KVPool(LAYOUT, 8)
    leases = StepLeases(pool)
    lease_id = secrets.token_bytes(16)
    tables, lens, starts = [[0, 1], [2, 3]], [3, 5], [0, 1, 2]
    with pytest.raises(InvalidWorkerRequest, match="one token per sequence a step"):
        leases.grant(lease_id, [0], tables, lens, starts, [3, 5, 4], HQ, steps=2)
    with pytest.raises(InvalidWorkerRequest, match="1 to"):
        leases.grant(lease_id, [0], tables, lens, starts, [3, 5], HQ, steps=0)
    # The tables must hold the last step's keys: 5 + 4 - 1 = 8 of the 2 blocks' 8.
    with pytest.raises(InvalidWorkerRequest):
        leases.grant(
            lease_id, [0], tables, lens, starts, [3, 13, 4, 14, 5, 15, 6, 16, 7, 17], HQ, steps=5
        )
    slots = [3, 13, 4, 14, 5, 15, 6, 16]
    packed = leases.grant(lease_id, [0, 1], tables, lens, starts, slots, HQ, steps=4)
    assert packed is None
    plan = StepPlan.unpack(leases.open(lease_id, me := object()))
    assert plan.steps == 4 and plan.slot_mapping.tolist() == slots
    assert plan.seq_lens.tolist() == lens
    with pytest.raises(InvalidWorkerRequest, match="report of 5 steps"):
        leases.report(lease_id, me, [0, 1], [], 5, [1] * 8)
    with pytest.raises(InvalidWorkerRequest, match="report of 3 steps with 2 token ids"):
        leases.report(lease_id, me, [0, 1], [], 3, [1, 2])
    with pytest.raises(InvalidWorkerRequest, match="non-negative"):
        leases.report(lease_id, me, [0, 1], [], 2, [1, -2])
    leases.report(lease_id, me, [0], [], 2, [7, 8])
    assert leases.end(lease_id) == LeaseReport((0,), (), 2, (7, 8))
