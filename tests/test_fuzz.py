"""Fuzzing through the real server (loopback port, authentication on, in-process pools).

Hand-written malformed requests of every RPC, then a few hundred random ones: a valid
request with one random defect (wrong dtype, shape, byte length, NaN/Inf, token counts,
layer, unknown or another tenant's id, ...), each with the status that defect must get;
random truncations and bit flips of serialized requests sent as raw bytes. After every
refused request the fuzzer's own sequences are exactly as before; throughout, the server
stays up, check_integrity holds, and another tenant's sequence gives bit-identical output.
"""

from __future__ import annotations

import json
import random

import grpc
import pytest
import torch
from service_support import HQ, LAYOUT, ServiceHarness, local_workers, service_config

from cache_service._proto.kvcache.v1 import kvcache_pb2 as pb
from cache_service._proto.kvcache.v1 import kvcache_pb2_grpc as pb_grpc
from cache_service.wire.tensor_codec import tensor_to_proto

pytestmark = pytest.mark.timeout(90)

C = grpc.StatusCode
L, HKV, D = LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim
FUZZER, VICTIM = "fuzzer-token-0123456789", "victim-token-9876543210"
SERVICE = "/kvcache.v1.KVCache/"
ROUNDS = 300


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory):
    tokens = tmp_path_factory.mktemp("fuzz") / "tokens.json"
    tokens.write_text(
        json.dumps(
            {
                "tokens": {FUZZER: "fuzzer", VICTIM: "victim"},
                "tenants": {"fuzzer": {"publish_public": True}},
            }
        )
    )
    svc = ServiceHarness(service_config(auth_file=str(tokens)), local_workers(2, 16))
    channel = grpc.insecure_channel(svc.address, options=[("grpc.use_local_subchannel_pool", 1)])
    try:
        yield Env(svc, channel)
    finally:
        channel.close()
        svc.stop()


def meta(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


class Env:
    """The service, a raw stub, the victim's bystander sequence and the fuzzer's own."""

    def __init__(self, svc: ServiceHarness, channel: grpc.Channel) -> None:
        self.svc = svc
        self.channel = channel
        self.stub = pb_grpc.KVCacheStub(channel)
        gen = torch.Generator().manual_seed(1)
        self.victim_seq = self._create(VICTIM)
        self._append(VICTIM, self.victim_seq, None, list(range(6)), gen)
        self.victim_query = torch.randn(2, HQ, D, generator=gen)
        self.victim_out = self.victim_outputs()
        # The fuzzer's sequences: A written 6 tokens on layer 0 and 4 on layer 1 (positions
        # 4, 5 reserved with their ids), B 3 tokens on every layer.
        self.a = self._create(FUZZER)
        self._append(FUZZER, self.a, None, [10, 11, 12, 13], gen)
        self._append(FUZZER, self.a, 0, [14, 15], gen)
        self.b = self._create(FUZZER)
        self._append(FUZZER, self.b, None, [20, 21, 22], gen)

    def _create(self, token: str) -> str:
        return self.stub.CreateSequence(pb.CreateSequenceRequest(), metadata=meta(token)).seq_id

    def _append(self, token: str, seq: str, layer: int | None, ids: list[int], gen) -> None:
        shape = (len(ids), HKV, D) if layer is not None else (L, len(ids), HKV, D)
        k, v = torch.randn(*shape, generator=gen), torch.randn(*shape, generator=gen)
        head = append_head(seq, ids, k, v, layer)
        self.stub.Append(iter([head]), metadata=meta(token), timeout=20)

    def victim_outputs(self) -> list[bytes]:
        outs = []
        for layer in range(L):
            req = pb.AttendRequest(
                layer=layer,
                items=[
                    pb.AttendItem(seq_id=self.victim_seq, query=tensor_to_proto(self.victim_query))
                ],
            )
            outs.append(
                self.stub.Attend(req, metadata=meta(VICTIM), timeout=20).results[0].output.data
            )
        return outs

    def state(self) -> tuple:
        bm = self.svc.coordinator.block_manager

        def read() -> tuple:
            infos = [bm.sequence_info("fuzzer", s) for s in (self.a, self.b)]
            stats = bm.stats()
            used = tuple(sorted((w, s.used, s.cached_free) for w, s in stats.workers.items()))
            return tuple((tuple(i.token_ids), tuple(i.written)) for i in infos), used

        return self.svc.call(read)

    def assert_healthy(self) -> None:
        info = self.stub.GetInfo(pb.GetInfoRequest(), metadata=meta(FUZZER), timeout=20)
        assert all(w.up for w in info.workers)
        self.svc.check_integrity()
        assert self.victim_outputs() == self.victim_out  # bit for bit


def append_head(
    seq: str, ids: list[int], k: torch.Tensor, v: torch.Tensor, layer
) -> pb.AppendRequest:
    head = pb.AppendRequest(
        seq_id=seq,
        token_ids=ids,
        key=pb.TensorSpec(dtype=pb.DTYPE_FLOAT32, shape=list(k.shape)),
        value=pb.TensorSpec(dtype=pb.DTYPE_FLOAT32, shape=list(v.shape)),
        key_data=k.numpy().tobytes(),
        value_data=v.numpy().tobytes(),
    )
    if layer is not None:
        head.layer = layer
    return head


def refused(fn, code: grpc.StatusCode, needle: str | None = None) -> str:
    """Run fn, expect `code`; the message explains (never an internal error)."""
    with pytest.raises(grpc.RpcError) as info:
        fn()
    err = info.value
    assert err.code() == code, f"expected {code.name}, got {err.code().name}: {err.details()}"
    details = err.details() or ""
    assert details and "internal error" not in details
    if needle is not None:
        assert needle in details, details
    return details


def t(x: torch.Tensor) -> pb.Tensor:
    return tensor_to_proto(x)


# ------------------------------------------------------------------------- hand-written


def test_hand_written_malformed_requests(env: Env):
    stub, fz = env.stub, meta(FUZZER)
    before = env.state()
    q = t(torch.randn(1, HQ, D))
    unknown = "seq-does-not-exist"

    def attend(layer=0, seq=None, query=q, token=FUZZER):
        item = pb.AttendItem(seq_id=env.a if seq is None else seq, query=query)
        return stub.Attend(
            pb.AttendRequest(layer=layer, items=[item]), metadata=meta(token), timeout=20
        )

    # Authentication first.
    refused(lambda: stub.GetInfo(pb.GetInfoRequest(), timeout=20), C.UNAUTHENTICATED)
    refused(lambda: attend(token="not-a-token"), C.UNAUTHENTICATED)
    # Ids: unknown, another tenant's (same answer), empty, absurdly long.
    msg_unknown = refused(lambda: attend(seq=unknown), C.NOT_FOUND)
    msg_other = refused(lambda: attend(seq=env.victim_seq), C.NOT_FOUND)
    assert msg_other == msg_unknown.replace(unknown, env.victim_seq)
    refused(lambda: attend(seq=""), C.INVALID_ARGUMENT, "seq_id is empty")
    refused(lambda: attend(seq="x" * 100_000), C.NOT_FOUND)
    for call, req in (
        (stub.ForkSequence, pb.ForkSequenceRequest(seq_id=env.victim_seq)),
        (stub.FreeSequence, pb.FreeSequenceRequest(seq_id=env.victim_seq)),
        (stub.FreeSequences, pb.FreeSequencesRequest(seq_ids=[env.a, env.victim_seq])),
        (stub.PublishPublic, pb.PublishPublicRequest(seq_id=env.victim_seq)),
    ):
        refused(lambda call=call, req=req: call(req, metadata=fz, timeout=20), C.NOT_FOUND)
    refused(
        lambda: list(stub.ExportBlocks(pb.ExportBlocksRequest(seq_id=env.victim_seq), metadata=fz)),
        C.NOT_FOUND,
    )
    # Tensors: dtype, shape, bytes, NaN / Inf, layer, rows.
    bad_dtype = pb.Tensor(dtype=0, shape=[1, HQ, D], data=bytes(4 * HQ * D))
    refused(lambda: attend(query=bad_dtype), C.INVALID_ARGUMENT, "dtype")
    unknown_dtype = pb.Tensor(dtype=77, shape=[1, HQ, D], data=bytes(4 * HQ * D))
    refused(lambda: attend(query=unknown_dtype), C.INVALID_ARGUMENT, "dtype")
    short = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[1, HQ, D], data=bytes(4 * HQ * D - 1))
    refused(lambda: attend(query=short), C.INVALID_ARGUMENT)
    negative = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[-1, HQ, D], data=b"")
    refused(lambda: attend(query=negative), C.INVALID_ARGUMENT, "negative")
    huge = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[2**40, HQ, D], data=bytes(16))
    refused(lambda: attend(query=huge), C.INVALID_ARGUMENT)
    refused(lambda: attend(query=t(torch.randn(1, HQ, D + 1))), C.INVALID_ARGUMENT, "shape")
    refused(lambda: attend(query=t(torch.randn(1, 3, D))), C.INVALID_ARGUMENT, "heads")
    refused(lambda: attend(query=t(torch.randn(HQ, D))), C.INVALID_ARGUMENT)
    for bad in (float("nan"), float("inf"), float("-inf")):
        x = torch.randn(1, HQ, D)
        x[0, 1, 3] = bad
        refused(lambda x=x: attend(query=t(x)), C.INVALID_ARGUMENT, "NaN or infinite")
    refused(lambda: attend(layer=L), C.INVALID_ARGUMENT, "layer")
    refused(lambda: attend(layer=2**32 - 1), C.INVALID_ARGUMENT, "layer")
    refused(lambda: attend(layer=1, query=t(torch.randn(5, HQ, D))), C.FAILED_PRECONDITION)
    # Token ids: negative, empty, huge counts.
    refused(
        lambda: stub.Pin(pb.PinRequest(token_ids=[]), metadata=fz, timeout=20), C.INVALID_ARGUMENT
    )
    refused(
        lambda: stub.CreateSequence(
            pb.CreateSequenceRequest(prompt_token_ids=[1, -5]), metadata=fz, timeout=20
        ),
        C.INVALID_ARGUMENT,
    )
    k, v = torch.randn(1, HKV, D), torch.randn(1, HKV, D)
    many = list(range(100_000))
    refused(
        lambda: stub.Append(iter([append_head(env.b, many, k, v, 0)]), metadata=fz, timeout=20),
        C.INVALID_ARGUMENT,
    )
    big_k, big_v = torch.randn(L, 5000, HKV, D), torch.randn(L, 5000, HKV, D)
    refused(
        lambda: stub.Append(
            iter([append_head(env.b, list(range(5000)), big_k, big_v, None)]),
            metadata=fz,
            timeout=30,
        ),
        C.INVALID_ARGUMENT,  # longer than every block of every worker holds
        "more than any sequence can hold",
    )
    # Append streams: missing specs, header fields twice, bytes beyond / short of the shapes.
    head = append_head(env.b, [1], k, v, 0)
    no_spec = pb.AppendRequest(seq_id=env.b, token_ids=[1], layer=0)
    refused(lambda: stub.Append(iter([no_spec]), metadata=fz, timeout=20), C.INVALID_ARGUMENT)
    refused(
        lambda: stub.Append(iter([head, pb.AppendRequest(seq_id=env.b)]), metadata=fz, timeout=20),
        C.INVALID_ARGUMENT,
        "header",
    )
    refused(
        lambda: stub.Append(
            iter([head, pb.AppendRequest(key_data=b"\0" * 8)]), metadata=fz, timeout=20
        ),
        C.INVALID_ARGUMENT,
    )
    short_head = append_head(env.b, [1], k, v, 0)
    short_head.value_data = short_head.value_data[:-4]
    refused(lambda: stub.Append(iter([short_head]), metadata=fz, timeout=20), C.INVALID_ARGUMENT)
    refused(lambda: stub.Append(iter([]), metadata=fz, timeout=20), C.INVALID_ARGUMENT, "empty")
    huge_spec = append_head(env.b, [1], k, v, 0)
    huge_spec.key.shape[:] = [2**40, HKV, D]
    refused(lambda: stub.Append(iter([huge_spec]), metadata=fz, timeout=20), C.INVALID_ARGUMENT)
    # Imports: foreign layout, inconsistent header, missing header.
    info = stub.GetInfo(pb.GetInfoRequest(), metadata=fz, timeout=20)
    header = pb.ExportHeader(layout=info.layout, token_ids=[1, 2], num_tokens=2)
    header.block_shape[:] = [1, L, 2, HKV, LAYOUT.block_size, D]
    header.total_bytes = 4 * L * 2 * HKV * LAYOUT.block_size * D
    foreign = pb.ExportHeader()
    foreign.CopyFrom(header)
    foreign.layout.fingerprint = "0123abcd"
    wrong_bytes = pb.ExportHeader()
    wrong_bytes.CopyFrom(header)
    wrong_bytes.total_bytes += 1
    for hdr, needle in ((foreign, "fingerprint"), (wrong_bytes, "total_bytes")):
        refused(
            lambda hdr=hdr: stub.ImportBlocks(
                iter([pb.ImportBlocksRequest(header=hdr)]), metadata=fz, timeout=20
            ),
            C.INVALID_ARGUMENT,
            needle,
        )
    refused(
        lambda: stub.ImportBlocks(
            iter([pb.ImportBlocksRequest(data=b"x")]), metadata=fz, timeout=20
        ),
        C.INVALID_ARGUMENT,
    )
    # Raw bytes: garbage, truncated messages, unknown methods.
    raw = env.channel.unary_unary(SERVICE + "AppendAttend")
    refused(
        lambda: raw(b"\xff\xfe\xfd\xfc", metadata=fz, timeout=20), C.INVALID_ARGUMENT, "protobuf"
    )
    item = pb.AppendAttendItem(
        seq_id=env.b, token_ids=[1], key=t(k), value=t(v), query=t(torch.randn(1, HQ, D))
    )
    whole = pb.AppendAttendRequest(layer=0, items=[item]).SerializeToString()
    refused(lambda: raw(whole[: len(whole) // 2], metadata=fz, timeout=20), C.INVALID_ARGUMENT)
    raw_batch = env.channel.unary_unary(SERVICE + "AppendAttendBatch")
    refused(
        lambda: raw_batch(b"\xff\xfe\xfd\xfc", metadata=fz, timeout=20),
        C.INVALID_ARGUMENT,
        "protobuf",
    )
    batch = pb.AppendAttendBatchRequest(
        layer=0,
        seq_ids=[env.b],
        token_ids=[1],
        key=t(k[None]),
        value=t(v[None]),
        query=t(torch.randn(1, 1, HQ, D)),
    ).SerializeToString()
    refused(lambda: raw_batch(batch[: len(batch) - 5], metadata=fz, timeout=20), C.INVALID_ARGUMENT)
    raw_stream = env.channel.stream_unary(SERVICE + "Append")
    refused(
        lambda: raw_stream(iter([head.SerializeToString()[:-7]]), metadata=fz, timeout=20),
        C.INVALID_ARGUMENT,
        "message 0",
    )
    refused(
        lambda: env.channel.unary_unary(SERVICE + "DropAllTables")(b"", metadata=fz, timeout=20),
        C.UNIMPLEMENTED,
    )

    assert env.state() == before
    env.assert_healthy()


# ------------------------------------------------------------------------- random


def _valid_append_attend(env: Env, rng: random.Random) -> tuple[pb.AppendAttendRequest, list]:
    """A valid request on layer 0: 1-2 items (A and/or B), 1-3 new tokens each."""
    targets = rng.sample([(env.a, 6), (env.b, 3)], rng.randint(1, 2))
    items = []
    for seq, _ in targets:
        n = rng.randint(1, 3)
        items.append(
            pb.AppendAttendItem(
                seq_id=seq,
                token_ids=[rng.randrange(1000) for _ in range(n)],
                key=t(torch.randn(n, HKV, D)),
                value=t(torch.randn(n, HKV, D)),
                query=t(torch.randn(rng.randint(1, n), HQ, D)),
            )
        )
    return pb.AppendAttendRequest(layer=0, items=items), targets


def _poison(msg: pb.Tensor, rng: random.Random, value: float) -> None:
    x = torch.frombuffer(bytearray(msg.data), dtype=torch.float32).clone()
    x[rng.randrange(x.numel())] = value
    msg.data = x.numpy().tobytes()


def _mutations(env: Env) -> list:
    """(name, expected code, mutate(request, item, rng)) - each defect alone is enough for
    the request to be refused with that code."""

    def dtype(req, it, rng):
        getattr(it, rng.choice(["key", "value", "query"])).dtype = rng.choice([0, 4, 9, 1000])

    def cut_bytes(req, it, rng):
        f = getattr(it, rng.choice(["key", "value", "query"]))
        f.data = f.data[: rng.randrange(len(f.data))]

    def extra_bytes(req, it, rng):
        f = getattr(it, rng.choice(["key", "value", "query"]))
        f.data += bytes(rng.choice([1, 2, 4, 64]))

    def shape(req, it, rng):
        f = getattr(it, rng.choice(["key", "value"]))
        dims = list(f.shape)
        dims[rng.randrange(1, 3)] += rng.choice([-1, 1, 7])
        f.shape[:] = dims

    def rank(req, it, rng):
        f = getattr(it, rng.choice(["key", "value", "query"]))
        f.shape[:] = [*f.shape, 1]

    def nonfinite(req, it, rng):
        _poison(
            getattr(it, rng.choice(["key", "value", "query"])),
            rng,
            rng.choice([float("nan"), float("inf"), float("-inf")]),
        )

    def token_count(req, it, rng):
        if rng.random() < 0.5:
            it.token_ids.append(5)
        else:
            it.token_ids[:] = list(range(rng.choice([0, 10_000])))

    def negative_token(req, it, rng):
        it.token_ids[rng.randrange(len(it.token_ids))] = -rng.randrange(1, 2**40)

    def heads(req, it, rng):
        n = it.query.shape[0]
        it.query.CopyFrom(t(torch.randn(n, rng.choice([1, 3, 5]), D)))

    def rows(req, it, rng):
        it.query.CopyFrom(t(torch.randn(50, HQ, D)))

    def layer(req, it, rng):
        req.layer = rng.choice([L, L + 1, 2**31, 2**32 - 1])

    def unknown_id(req, it, rng):
        it.seq_id = "".join(rng.choice("0123456789abcdef") for _ in range(rng.choice([8, 32, 300])))

    def other_tenant(req, it, rng):
        it.seq_id = env.victim_seq

    def empty_id(req, it, rng):
        it.seq_id = ""

    def duplicate(req, it, rng):
        req.items.append(it)

    def reserved_ids(req, it, rng):
        # Layer 1 of A has positions 4, 5 reserved as tokens 14, 15 by layer 0.
        req.layer = 1
        del req.items[:]
        n = 2
        req.items.append(
            pb.AppendAttendItem(
                seq_id=env.a,
                token_ids=[14 + rng.randint(1, 50), 15],
                key=t(torch.randn(n, HKV, D)),
                value=t(torch.randn(n, HKV, D)),
                query=t(torch.randn(1, HQ, D)),
            )
        )

    bad, gone = C.INVALID_ARGUMENT, C.NOT_FOUND
    return [
        ("dtype", bad, dtype), ("cut_bytes", bad, cut_bytes), ("extra_bytes", bad, extra_bytes),
        ("shape", bad, shape), ("rank", bad, rank), ("nonfinite", bad, nonfinite),
        ("token_count", bad, token_count), ("negative_token", bad, negative_token),
        ("heads", bad, heads), ("rows", bad, rows), ("layer", bad, layer),
        ("unknown_id", gone, unknown_id), ("other_tenant", gone, other_tenant),
        ("empty_id", bad, empty_id), ("duplicate", bad, duplicate),
        ("reserved_ids", bad, reserved_ids),
    ]  # fmt: skip


def test_random_defective_requests_get_their_status_and_change_nothing(env: Env):
    rng = random.Random(20261130)
    mutations = _mutations(env)
    before = env.state()
    seen: dict[str, int] = {}
    for round_ in range(ROUNDS):
        req, _ = _valid_append_attend(env, rng)
        name, code, mutate = rng.choice(mutations)
        mutate(req, rng.choice(list(req.items)), rng)
        details = refused(
            lambda req=req: env.stub.AppendAttend(req, metadata=meta(FUZZER), timeout=20), code
        )
        if code is C.NOT_FOUND:
            # Another tenant's id reads exactly like an unknown one.
            assert details.startswith("no sequence ") and details.endswith(" for this tenant")
        seen[name] = seen.get(name, 0) + 1
        assert env.state() == before, f"round {round_}: {name} changed state"
        if round_ % 100 == 99:
            env.assert_healthy()
    assert set(seen) == {m[0] for m in mutations}, seen  # every defect was tried
    env.assert_healthy()


def test_random_truncations_and_bit_flips_of_raw_requests(env: Env):
    """Read-only requests (Attend on the fuzzer's own sequences) with random byte damage:
    whatever the damage decodes to, the answer is a proper status, never INTERNAL/UNKNOWN,
    and nothing changes."""
    rng = random.Random(7)
    raw = env.channel.unary_unary(SERVICE + "Attend")
    before = env.state()
    codes: dict[str, int] = {}
    allowed = {C.OK, C.INVALID_ARGUMENT, C.NOT_FOUND, C.FAILED_PRECONDITION}
    for _ in range(ROUNDS):
        req = pb.AttendRequest(
            layer=rng.randrange(L),
            items=[
                pb.AttendItem(seq_id=rng.choice([env.a, env.b]), query=t(torch.randn(1, HQ, D)))
            ],
        )
        data = bytearray(req.SerializeToString())
        if rng.random() < 0.5:
            data = data[: rng.randrange(len(data))]
        else:
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        try:
            raw(bytes(data), metadata=meta(FUZZER), timeout=20)
            code = C.OK
        except grpc.RpcError as err:
            code = err.code()
            assert "internal error" not in (err.details() or "")
        assert code in allowed, code
        codes[code.name] = codes.get(code.name, 0) + 1
    assert codes.get("INVALID_ARGUMENT", 0) > ROUNDS // 4, codes
    assert env.state() == before
    env.assert_healthy()
