"""The servicer's hot path: replies encoded straight to wire bytes equal the protobuf API's,
and interceptors build their wrapped handlers once per method (per tenant for auth), still
timing, counting, limiting, decoding and authenticating every call."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import grpc
import pytest
import torch

from cache_service._proto.kvcache.v1 import kvcache_pb2 as pb
from cache_service.api.auth import AuthInterceptor, bearer_metadata, parse_token_document
from cache_service.api.inflight import InFlightLimiter, InFlightLimitInterceptor
from cache_service.api.result_codec import encode_batch_result, encode_results
from cache_service.api.wire_decode import RequestDecodeInterceptor
from cache_service.engine.worker_interface import AttentionResult
from cache_service.obs.metrics import ServiceMetrics
from cache_service.wire.handler_cache import HandlerCache
from cache_service.wire.tensor_codec import TensorCodecError, tensor_to_proto

# -- reply encoding ----------------------------------------------------------------------


def api_reply(cls: Any, results: list[AttentionResult], with_lse: bool) -> Any:
    """The same reply through the protobuf API."""
    reply = cls()
    for r in results:
        msg = reply.results.add(output=tensor_to_proto(r.out))
        if with_lse:
            msg.lse.CopyFrom(tensor_to_proto(r.lse))
    return reply


def _rows(out: torch.Tensor, lse: torch.Tensor, sizes: list[int]) -> list[AttentionResult]:
    return [
        AttentionResult(o, x)
        for o, x in zip(out.split(sizes), lse.split(sizes), strict=True)  # rows of one tensor
    ]


CASES: dict[str, Callable[[], list[AttentionResult]]] = {
    "decode batch": lambda: _rows(torch.randn(32, 8, 64), torch.randn(32, 8), [1] * 32),
    "bfloat16 rows": lambda: _rows(torch.randn(6, 4, 16).bfloat16(), torch.randn(6, 4), [2, 1, 3]),
    "uneven rows": lambda: _rows(torch.randn(5, 4, 3), torch.randn(5, 4), [1, 2, 1, 1, 0]),
    "mixed dtypes, separate tensors": lambda: [
        AttentionResult(torch.randn(2, 4, 3, dtype=torch.bfloat16), torch.randn(2, 4)),
        AttentionResult(torch.randn(1, 4, 3, dtype=torch.float16), torch.randn(1, 4)),
    ],
    "one large item": lambda: [AttentionResult(torch.randn(300, 32, 128), torch.randn(300, 32))],
    "empty outputs": lambda: [AttentionResult(torch.zeros(0, 4, 3), torch.zeros(0, 4))] * 3,
    "non-contiguous": lambda: [
        AttentionResult(torch.randn(4, 3, 2).transpose(0, 1), torch.randn(4, 3).t())
    ],
    "no items": lambda: [],
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("with_lse", [False, True])
@pytest.mark.parametrize("cls", [pb.AttendResponse, pb.AppendAttendResponse])
def test_reply_bytes_equal_the_protobuf_api(case: str, with_lse: bool, cls: Any) -> None:
    results = CASES[case]()
    raw = encode_results(results, with_lse)
    want = api_reply(cls, results, with_lse)
    assert type(raw) is bytes
    assert cls.FromString(raw) == want
    # Protobuf leaves an empty tensor's data field out; the codec frames it (same message).
    if all(r.out.numel() and (not with_lse or r.lse.numel()) for r in results):
        assert raw == want.SerializeToString()


def test_reply_refuses_what_cannot_travel() -> None:
    ints = [AttentionResult(torch.ones(1, 2, dtype=torch.int64), None)] * 2
    with pytest.raises(TensorCodecError):
        encode_results(ints, False)
    with pytest.raises(TypeError, match="no lse"):
        encode_results([AttentionResult(torch.ones(1, 2, 3), None)], True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cls", [pb.AttendBatchResponse, pb.AppendAttendBatchResponse])
def test_batch_reply_bytes_equal_the_protobuf_api(dtype: torch.dtype, cls: Any) -> None:
    out = torch.randn(6, 2, 8, 16).to(dtype)
    lse = torch.randn(6, 2, 8)
    for with_lse in (False, True):
        raw = encode_batch_result(out, lse if with_lse else None)
        want = cls(output=tensor_to_proto(out))
        if with_lse:
            want.lse.CopyFrom(tensor_to_proto(lse))
        assert type(raw) is bytes and raw == want.SerializeToString()
        assert cls.FromString(raw) == want
    with pytest.raises(TensorCodecError):
        encode_batch_result(out.long(), None)


# -- interceptors ------------------------------------------------------------------------


class Details:
    def __init__(self, method: str, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self.method = method
        self.invocation_metadata = metadata


class Context:
    def __init__(self) -> None:
        self.aborted: tuple[Any, str] | None = None

    def code(self) -> Any:
        return self.aborted[0] if self.aborted else None

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    async def abort(self, code: Any, message: str) -> None:
        self.aborted = (code, message)
        raise grpc.RpcError(message)


METHOD = "/kvcache.v1.KVCache/GetInfo"


def inner_handler() -> grpc.RpcMethodHandler:
    async def behave(request: Any, context: Any) -> str:
        return f"ok:{request}"

    return grpc.unary_unary_rpc_method_handler(
        behave, request_deserializer=bytes.decode, response_serializer=str.encode
    )


async def through(interceptor: Any, handler: Any, details: Details) -> Any:
    async def continuation(_: Any) -> Any:
        return handler

    return await interceptor.intercept_service(continuation, details)


def test_handler_cache_reuses_only_for_the_same_inner_handler() -> None:
    cache = HandlerCache(max_entries=2)
    built: list[object] = []

    def build(h: object) -> tuple[str, object]:
        built.append(h)
        return ("wrapped", h)

    a, b = object(), object()
    assert cache.get("m", a, build) is cache.get("m", a, build)
    assert cache.get("m", b, build) == ("wrapped", b)  # a new inner handler: rebuilt
    cache.get("n", a, build)
    cache.get("o", a, build)  # past the bound: starts over
    assert len(cache) <= 2
    assert built == [a, b, a, a]


@pytest.mark.parametrize(
    "make",
    [
        lambda: ServiceMetrics().rpc_interceptor(),
        lambda: InFlightLimitInterceptor(InFlightLimiter(4), "/kvcache.v1.KVCache/"),
        lambda: RequestDecodeInterceptor("/kvcache.v1.KVCache/"),
    ],
)
def test_interceptors_wrap_once_per_method(make: Callable[[], Any]) -> None:
    interceptor = make()
    inner = inner_handler()

    async def main() -> None:
        first = await through(interceptor, inner, Details(METHOD))
        assert first is not inner
        assert await through(interceptor, inner, Details(METHOD)) is first
        other = await through(interceptor, inner, Details("/kvcache.v1.KVCache/Lookup"))
        assert other is not first
        assert await through(interceptor, inner_handler(), Details(METHOD)) is not first
        raw = b"x" if isinstance(interceptor, RequestDecodeInterceptor) else "x"
        assert await first.unary_unary(raw, Context()) == "ok:x"

    asyncio.run(main())


def test_metrics_count_every_call_and_code_with_cached_children() -> None:
    metrics = ServiceMetrics()
    interceptor = metrics.rpc_interceptor()

    async def fail(request: Any, context: Context) -> None:
        await context.abort(grpc.StatusCode.NOT_FOUND, "no")

    failing = grpc.unary_unary_rpc_method_handler(fail)

    async def main() -> None:
        ok = await through(interceptor, inner_handler(), Details(METHOD))
        bad = await through(interceptor, failing, Details("/kvcache.v1.KVCache/Lookup"))
        for _ in range(3):
            await ok.unary_unary("r", Context())
        for _ in range(2):
            with pytest.raises(grpc.RpcError):
                await bad.unary_unary("r", Context())

    asyncio.run(main())

    def count(method: str, code: str) -> float | None:
        labels = {"service": "kvcache.v1.KVCache", "method": method, "code": code}
        return metrics.registry.get_sample_value("kvcache_rpc_requests_total", labels)

    assert count("GetInfo", "OK") == 3
    assert count("Lookup", "NOT_FOUND") == 2
    labels = {"service": "kvcache.v1.KVCache", "method": "GetInfo", "code": "OK"}
    assert metrics.registry.get_sample_value("kvcache_rpc_duration_seconds_count", labels) == 3


def test_auth_wraps_once_per_tenant_and_binds_the_right_one() -> None:
    from cache_service.api.auth import current_principal

    doc = {"tokens": {"tok-aaaaaaaaaaaaaaaa": "acme", "tok-bbbbbbbbbbbbbbbb": "globex"}}
    interceptor = AuthInterceptor(parse_token_document(doc))

    async def whoami(request: Any, context: Any) -> str:
        principal = current_principal()
        return principal.tenant if principal else "-"

    inner = grpc.unary_unary_rpc_method_handler(whoami)

    async def main() -> None:
        a1 = await through(
            interceptor, inner, Details(METHOD, bearer_metadata("tok-aaaaaaaaaaaaaaaa"))
        )
        a2 = await through(
            interceptor, inner, Details(METHOD, bearer_metadata("tok-aaaaaaaaaaaaaaaa"))
        )
        b = await through(
            interceptor, inner, Details(METHOD, bearer_metadata("tok-bbbbbbbbbbbbbbbb"))
        )
        assert a1 is a2 and b is not a1
        assert await a1.unary_unary(None, Context()) == "acme"
        assert await b.unary_unary(None, Context()) == "globex"
        refused = await through(interceptor, inner, Details(METHOD, bearer_metadata("tok-nope")))
        context = Context()
        with pytest.raises(grpc.RpcError):
            await refused.unary_unary(None, context)
        assert context.aborted is not None
        assert context.aborted[0] is grpc.StatusCode.UNAUTHENTICATED

    asyncio.run(main())


# -- request decoding --------------------------------------------------------------------


def test_joined_decode_hands_back_the_span_it_decoded_into() -> None:
    from cache_service.wire.tensor_codec import joined_from_protos, joined_view, tensor_to_proto

    rows = torch.randn(5, 1, 2, 3)
    tensors, span = joined_from_protos([tensor_to_proto(r) for r in rows], "k{}", ndim=3)
    assert span is not None and torch.equal(span, joined_view(tensors))
    assert span.data_ptr() == tensors[0].data_ptr() and torch.equal(span.view(5, 1, 2, 3), rows)
    uneven = [torch.randn(1, 2, 3), torch.randn(2, 2, 3)]
    tensors, span = joined_from_protos([tensor_to_proto(t) for t in uneven], "k{}", ndim=3)
    assert span is not None and torch.equal(span, torch.cat([t.reshape(-1) for t in uneven]))
    mixed = [torch.randn(1, 2, 3), torch.randn(1, 2, 3).half()]
    tensors, span = joined_from_protos([tensor_to_proto(t) for t in mixed], "k{}", ndim=3)
    assert span is None and [t.dtype for t in tensors] == [torch.float32, torch.float16]
    with pytest.raises(TensorCodecError, match=r"k\[1\]: expected 3 dimensions"):
        joined_from_protos([tensor_to_proto(rows[0]), tensor_to_proto(rows[0, 0])], "k[{}]", ndim=3)
    assert joined_from_protos([], "k{}") == ([], None)
