"""Bearer-token authentication: the token file, the lookup, and the interceptor on a real
grpc.aio server (loopback port, generic byte handlers, the standard health service)."""

from __future__ import annotations

import asyncio
import hmac
import json
from pathlib import Path

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from cache_service.api import auth
from cache_service.api.auth import (
    AuthConfigError,
    AuthInterceptor,
    Permission,
    TenantPolicy,
    bearer_metadata,
    current_principal,
    load_token_table,
    parse_token_document,
)

pytestmark = pytest.mark.timeout(60)

TOKEN_A = "tok-a-0123456789abcdef"
TOKEN_B = "tok-b-fedcba9876543210"
TOKEN_ADMIN = "tok-admin-5555555555555555"

DOC = {
    "tokens": {TOKEN_A: "acme", TOKEN_B: "globex", TOKEN_ADMIN: "ops"},
    "tenants": {
        "acme": {"max_blocks": 128, "max_sequences": 8, "publish_public": True},
        "ops": {"admin": True},
    },
}

SERVICE = "test.v1.Echo"
WHOAMI = f"/{SERVICE}/WhoAmI"
PUBLISH = f"/{SERVICE}/Publish"
DRAIN = f"/{SERVICE}/Drain"
STREAM = f"/{SERVICE}/StreamWhoAmI"


# ------------------------------------------------------------------------- token file


def test_yaml_and_json_files_give_the_same_table(tmp_path: Path) -> None:
    import yaml

    (tmp_path / "t.yaml").write_text(yaml.safe_dump(DOC))
    (tmp_path / "t.json").write_text(json.dumps(DOC))
    for name in ("t.yaml", "t.json"):
        table = load_token_table(tmp_path / name)
        assert len(table) == 3
        assert table.tenants() == {"acme", "globex", "ops"}
        a = table.authenticate(TOKEN_A)
        assert a is not None and a.tenant == "acme"
        assert a.policy == TenantPolicy(max_blocks=128, max_sequences=8, publish_public=True)
        b = table.authenticate(TOKEN_B)
        assert b is not None and b.tenant == "globex" and b.policy == TenantPolicy()
        assert table.authenticate("tok-c-0000000000000000") is None
        assert table.authenticate(TOKEN_A + "x") is None
        assert table.authenticate(TOKEN_A[:-1]) is None


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ([], "top level must be a mapping"),
        ({"tokens": {}}, "non-empty mapping"),
        ({"tokens": {TOKEN_A: "acme"}, "extra": 1}, "unknown top-level"),
        ({"tokens": {"short": "acme"}}, "shorter than 16"),
        ({"tokens": {"has space 0123456789": "acme"}}, "visible ASCII"),
        ({"tokens": {TOKEN_A: "bad tenant!"}}, "tenant name"),
        ({"tokens": {TOKEN_A: 7}}, "tenant name"),
        ({"tokens": {TOKEN_A: "acme"}, "tenants": {"acme": {"max_block": 3}}}, "unknown field"),
        ({"tokens": {TOKEN_A: "acme"}, "tenants": {"acme": {"max_blocks": 0}}}, "positive"),
        ({"tokens": {TOKEN_A: "acme"}, "tenants": {"acme": {"max_blocks": True}}}, "positive"),
        (
            {"tokens": {TOKEN_A: "acme"}, "tenants": {"acme": {"publish_public": "yes"}}},
            "true or false",
        ),
        ({"tokens": {TOKEN_A: "acme"}, "tenants": ["acme"]}, "'tenants' must be a mapping"),
    ],
)
def test_invalid_documents_are_refused_with_the_field_named(doc: object, message: str) -> None:
    with pytest.raises(AuthConfigError, match=message):
        parse_token_document(doc, "cfg.yaml")


def test_errors_never_echo_a_token() -> None:
    secret = "s3cr3t tok with spaces"
    with pytest.raises(AuthConfigError) as info:
        parse_token_document({"tokens": {secret: "acme"}})
    assert secret not in str(info.value)


def test_file_level_errors(tmp_path: Path) -> None:
    with pytest.raises(AuthConfigError, match="cannot read"):
        load_token_table(tmp_path / "absent.yaml")
    (tmp_path / "t.toml").write_text("x = 1")
    with pytest.raises(AuthConfigError, match=r"\.json, \.yaml or \.yml"):
        load_token_table(tmp_path / "t.toml")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(AuthConfigError, match="not valid JSON"):
        load_token_table(tmp_path / "bad.json")
    (tmp_path / "bad.yaml").write_text("tokens: [unclosed")
    with pytest.raises(AuthConfigError, match="not valid YAML"):
        load_token_table(tmp_path / "bad.yaml")


def test_lookup_compares_every_entry_without_early_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    table = parse_token_document(DOC)
    calls: list[int] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append(1)
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    for token in (TOKEN_A, TOKEN_B, TOKEN_ADMIN, "tok-z-0000000000000000"):
        calls.clear()
        table.authenticate(token)
        assert len(calls) == len(table)


def test_decide_is_pure_and_covers_every_outcome() -> None:
    interceptor = AuthInterceptor(parse_token_document(DOC), {PUBLISH: Permission.PUBLISH_PUBLIC})
    ok = grpc.StatusCode.OK
    assert interceptor.decide("/grpc.health.v1.Health/Check", ())[1] is ok
    assert interceptor.decide(WHOAMI, ())[1] is grpc.StatusCode.UNAUTHENTICATED
    principal, code, _ = interceptor.decide(WHOAMI, bearer_metadata(TOKEN_A))
    assert code is ok and principal is not None and principal.tenant == "acme"
    _, code, message = interceptor.decide(PUBLISH, bearer_metadata(TOKEN_B))
    assert code is grpc.StatusCode.PERMISSION_DENIED and "publish_public" in message
    assert TOKEN_B not in message


# -------------------------------------------------------------------- through gRPC


class _Calls:
    def __init__(self) -> None:
        self.count = 0


def _echo_handler(calls: _Calls) -> grpc.GenericRpcHandler:
    def tenant() -> bytes:
        principal = current_principal()
        return b"" if principal is None else principal.tenant.encode()

    async def whoami(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        calls.count += 1
        await asyncio.sleep(0)  # the tenant must survive a suspension
        return tenant()

    async def stream(request: bytes, context: grpc.aio.ServicerContext):
        calls.count += 1
        for _ in range(3):
            await asyncio.sleep(0)
            yield tenant()

    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "WhoAmI": grpc.unary_unary_rpc_method_handler(whoami),
            "Publish": grpc.unary_unary_rpc_method_handler(whoami),
            "Drain": grpc.unary_unary_rpc_method_handler(whoami),
            "StreamWhoAmI": grpc.unary_stream_rpc_method_handler(stream),
        },
    )


async def _serve(calls: _Calls) -> tuple[grpc.aio.Server, int]:
    interceptor = AuthInterceptor(
        parse_token_document(DOC),
        {PUBLISH: Permission.PUBLISH_PUBLIC, DRAIN: Permission.ADMIN},
    )
    server = grpc.aio.server(interceptors=[interceptor])
    server.add_generic_rpc_handlers((_echo_handler(calls),))
    health_pb2_grpc.add_HealthServicer_to_server(HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


async def _unary(
    channel: grpc.aio.Channel, method: str, metadata: tuple | None
) -> tuple[grpc.StatusCode, bytes | str]:
    call = channel.unary_unary(method)
    try:
        return grpc.StatusCode.OK, await call(b"\xff\x00garbage", metadata=metadata, timeout=5)
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""


def test_interceptor_through_a_real_server() -> None:
    calls = _Calls()

    async def scenario() -> dict[str, tuple[grpc.StatusCode, bytes | str]]:
        server, port = await _serve(calls)
        out: dict[str, tuple[grpc.StatusCode, bytes | str]] = {}
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                out["none"] = await _unary(ch, WHOAMI, None)
                out["basic"] = await _unary(ch, WHOAMI, (("authorization", f"Basic {TOKEN_A}"),))
                out["empty"] = await _unary(ch, WHOAMI, (("authorization", "Bearer "),))
                out["two"] = await _unary(ch, WHOAMI, bearer_metadata(TOKEN_A) * 2)
                out["unknown"] = await _unary(ch, WHOAMI, bearer_metadata("x" * 32))
                after_rejections = calls.count
                out["a"] = await _unary(ch, WHOAMI, bearer_metadata(TOKEN_A))
                out["b"] = await _unary(ch, WHOAMI, bearer_metadata(TOKEN_B))
                out["a_lower"] = await _unary(ch, WHOAMI, (("authorization", f"bearer {TOKEN_A}"),))
                out["publish_a"] = await _unary(ch, PUBLISH, bearer_metadata(TOKEN_A))
                out["publish_b"] = await _unary(ch, PUBLISH, bearer_metadata(TOKEN_B))
                out["drain_a"] = await _unary(ch, DRAIN, bearer_metadata(TOKEN_A))
                out["drain_ops"] = await _unary(ch, DRAIN, bearer_metadata(TOKEN_ADMIN))
                out["no_such_method"] = await _unary(ch, f"/{SERVICE}/Nope", None)
                stream = ch.unary_stream(STREAM)(b"", metadata=bearer_metadata(TOKEN_B))
                out["stream"] = (grpc.StatusCode.OK, b",".join([r async for r in stream]))
                try:
                    reply = await health_pb2_grpc.HealthStub(ch).Check(
                        health_pb2.HealthCheckRequest(), timeout=5
                    )
                    out["health"] = (grpc.StatusCode.OK, str(reply.status))
                except grpc.aio.AioRpcError as exc:
                    out["health"] = (exc.code(), exc.details() or "")
                out["rejected_reached_servicer"] = (grpc.StatusCode.OK, str(after_rejections))
        finally:
            await server.stop(None)
        return out

    out = asyncio.run(scenario())
    for key in ("none", "basic", "empty", "two", "unknown"):
        assert out[key][0] is grpc.StatusCode.UNAUTHENTICATED, key
    assert "Bearer" in out["none"][1]
    assert out["unknown"][1] == "unknown bearer token"
    assert out["rejected_reached_servicer"][1] == "0"
    assert out["a"] == (grpc.StatusCode.OK, b"acme")
    assert out["b"] == (grpc.StatusCode.OK, b"globex")
    assert out["a_lower"] == (grpc.StatusCode.OK, b"acme")
    assert out["publish_a"] == (grpc.StatusCode.OK, b"acme")
    assert out["publish_b"][0] is grpc.StatusCode.PERMISSION_DENIED
    assert "globex" in out["publish_b"][1] and "publish_public" in out["publish_b"][1]
    assert out["drain_a"][0] is grpc.StatusCode.PERMISSION_DENIED
    assert out["drain_ops"] == (grpc.StatusCode.OK, b"ops")
    assert out["no_such_method"][0] is grpc.StatusCode.UNIMPLEMENTED
    assert out["stream"] == (grpc.StatusCode.OK, b"globex,globex,globex")
    assert out["health"] == (grpc.StatusCode.OK, str(health_pb2.HealthCheckResponse.SERVING))
    # The principal does not leak out of the handlers into the caller's context.
    assert current_principal() is None


def test_concurrent_callers_each_see_their_own_tenant() -> None:
    calls = _Calls()

    async def scenario() -> list[bytes]:
        server, port = await _serve(calls)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                call = ch.unary_unary(WHOAMI)
                tokens = [TOKEN_A, TOKEN_B, TOKEN_ADMIN] * 20
                return await asyncio.gather(
                    *(call(b"", metadata=bearer_metadata(t), timeout=10) for t in tokens)
                )
        finally:
            await server.stop(None)

    replies = asyncio.run(scenario())
    assert replies == [b"acme", b"globex", b"ops"] * 20
