"""Bearer-token authentication: tokens map to tenants, a grpc.aio interceptor enforces it.

The token file (YAML or JSON, chosen by the file suffix) looks like::

    tokens:                      # bearer token -> tenant name
      "3f9c...long random...":  acme
      "a71b...long random...":  globex
    tenants:                     # optional, per tenant; absent fields mean "no limit"/"no"
      acme:
        max_blocks: 4096         # KV blocks the tenant may hold at once
        max_sequences: 256       # live sequences at once
        publish_public: true     # may publish prefixes that every tenant can reuse
        admin: false             # may call the methods the server marks as admin-only

The interceptor answers UNAUTHENTICATED when the `authorization` metadata is missing, is
not `Bearer <token>`, or names no known token, and PERMISSION_DENIED when a known tenant
calls a method that needs a permission it lacks. Health checking and reflection stay open
so load balancers and tooling work without a token. The authenticated tenant reaches the
servicer through a context variable (`current_principal()`).

The pure part (parsing, lookup) imports no gRPC; only the interceptor does.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import hashlib
import hmac
import inspect
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import yaml

from cache_service.wire.handler_cache import HandlerCache

__all__ = [
    "OPEN_SERVICE_PREFIXES",
    "AuthConfigError",
    "AuthInterceptor",
    "Permission",
    "Principal",
    "TenantPolicy",
    "TokenTable",
    "bearer_metadata",
    "current_principal",
    "load_token_table",
    "principal_scope",
]

# A token shorter than this is guessable by brute force over the network; refuse it at load
# time rather than run with it. 16 characters of a random hex token is 64 bits.
MIN_TOKEN_LENGTH = 16
# Tokens travel as HTTP/2 header values: visible ASCII, no spaces.
_TOKEN_RE = re.compile(r"^[\x21-\x7e]+$")
# Tenant names end up in metric labels, log lines and prefix-hash salts.
_TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_TENANT_FIELDS = {"max_blocks", "max_sequences", "publish_public", "admin"}
_TOP_FIELDS = {"tokens", "tenants"}

# Services reachable without a token: health checks (load balancers, Kubernetes probes)
# and server reflection (grpcurl). They expose no tenant data.
OPEN_SERVICE_PREFIXES: tuple[str, ...] = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)


class AuthConfigError(ValueError):
    """The token file is unreadable or malformed; the message names the file and the field."""


class Permission(enum.Enum):
    """An action a tenant may be allowed beyond ordinary use of its own sequences."""

    PUBLISH_PUBLIC = "publish_public"
    ADMIN = "admin"


@dataclass(frozen=True)
class TenantPolicy:
    """What one tenant may do. A quota of None means unlimited.

    max_blocks: KV blocks (all layers, K and V) the tenant's sequences may hold at once.
    max_sequences: live sequences at once.
    """

    max_blocks: int | None = None
    max_sequences: int | None = None
    publish_public: bool = False
    admin: bool = False

    def allows(self, permission: Permission) -> bool:
        """Whether this tenant holds `permission`."""
        if permission is Permission.PUBLISH_PUBLIC:
            return self.publish_public
        return self.admin


@dataclass(frozen=True)
class Principal:
    """The authenticated caller of one RPC: its tenant name and that tenant's policy."""

    tenant: str
    policy: TenantPolicy


def _digest(token: str) -> bytes:
    # Comparing fixed-length digests keeps the comparison time independent of the token's
    # length as well as of its content.
    return hashlib.sha256(token.encode("utf-8")).digest()


class TokenTable:
    """Bearer token -> Principal, looked up in time independent of which token matches.

    Only SHA-256 digests of the tokens are kept in memory.
    """

    def __init__(self, tokens: Mapping[str, str], tenants: Mapping[str, TenantPolicy]) -> None:
        """tokens: token -> tenant name; tenants: policies (tenants not listed get defaults)."""
        entries: list[tuple[bytes, Principal]] = []
        for token, tenant in tokens.items():
            _check_token(token, "tokens")
            _check_tenant(tenant, f"tokens[{_redact(token)}]")
            entries.append((_digest(token), Principal(tenant, tenants.get(tenant, TenantPolicy()))))
        for tenant in tenants:
            _check_tenant(tenant, "tenants")
        self._entries = tuple(entries)
        self._policies = dict(tenants)

    def __len__(self) -> int:
        return len(self._entries)

    def tenants(self) -> frozenset[str]:
        """Every tenant that at least one token maps to."""
        return frozenset(p.tenant for _, p in self._entries)

    def policy(self, tenant: str) -> TenantPolicy:
        """The policy of `tenant` (defaults when the file gives none)."""
        return self._policies.get(tenant, TenantPolicy())

    def authenticate(self, token: str) -> Principal | None:
        """The principal `token` belongs to, or None.

        Every stored digest is compared, with hmac.compare_digest and without an early
        exit, so the time taken says nothing about how close a guess came or which entry
        matched.
        """
        presented = _digest(token)
        found: Principal | None = None
        for digest, principal in self._entries:
            if hmac.compare_digest(presented, digest):
                found = principal
        return found


def _redact(token: str) -> str:
    return f"<token of {len(token)} chars>"


def _check_token(token: object, where: str) -> None:
    if not isinstance(token, str):
        raise AuthConfigError(f"{where}: a token must be a string, got {type(token).__name__}")
    if len(token) < MIN_TOKEN_LENGTH:
        raise AuthConfigError(
            f"{where}: {_redact(token)} is shorter than {MIN_TOKEN_LENGTH} characters"
        )
    if not _TOKEN_RE.match(token):
        raise AuthConfigError(
            f"{where}: {_redact(token)} has characters outside visible ASCII (or spaces)"
        )


def _check_tenant(tenant: object, where: str) -> None:
    if not isinstance(tenant, str) or not _TENANT_RE.match(tenant):
        raise AuthConfigError(
            f"{where}: tenant name {tenant!r} must be 1-64 characters of letters, digits, "
            "'_', '.', '-', starting with a letter or digit"
        )


def _parse_quota(value: object, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise AuthConfigError(f"{where}: must be a positive integer or null, got {value!r}")
    return value


def _parse_flag(value: object, where: str) -> bool:
    if not isinstance(value, bool):
        raise AuthConfigError(f"{where}: must be true or false, got {value!r}")
    return value


def _parse_policy(name: str, raw: object, source: str) -> TenantPolicy:
    where = f"{source}: tenants.{name}"
    if raw is None:
        return TenantPolicy()
    if not isinstance(raw, dict):
        raise AuthConfigError(f"{where}: must be a mapping, got {type(raw).__name__}")
    unknown = set(raw) - _TENANT_FIELDS
    if unknown:
        raise AuthConfigError(
            f"{where}: unknown field(s) {sorted(map(str, unknown))}; "
            f"allowed: {sorted(_TENANT_FIELDS)}"
        )
    return TenantPolicy(
        max_blocks=_parse_quota(raw.get("max_blocks"), f"{where}.max_blocks"),
        max_sequences=_parse_quota(raw.get("max_sequences"), f"{where}.max_sequences"),
        publish_public=_parse_flag(raw.get("publish_public", False), f"{where}.publish_public"),
        admin=_parse_flag(raw.get("admin", False), f"{where}.admin"),
    )


def parse_token_document(doc: object, source: str = "<token config>") -> TokenTable:
    """Build a TokenTable from an already-parsed document (see the module docstring).

    Raises AuthConfigError naming `source` and the offending field.
    """
    if not isinstance(doc, dict):
        raise AuthConfigError(f"{source}: the top level must be a mapping with 'tokens'")
    unknown = set(doc) - _TOP_FIELDS
    if unknown:
        raise AuthConfigError(
            f"{source}: unknown top-level field(s) {sorted(map(str, unknown))}; "
            f"allowed: {sorted(_TOP_FIELDS)}"
        )
    tokens = doc.get("tokens")
    if not isinstance(tokens, dict) or not tokens:
        raise AuthConfigError(f"{source}: 'tokens' must be a non-empty mapping token -> tenant")
    raw_tenants = doc.get("tenants") or {}
    if not isinstance(raw_tenants, dict):
        raise AuthConfigError(f"{source}: 'tenants' must be a mapping tenant -> policy")
    policies: dict[str, TenantPolicy] = {}
    for name, raw in raw_tenants.items():
        _check_tenant(name, f"{source}: tenants")
        policies[name] = _parse_policy(name, raw, source)
    try:
        return TokenTable(tokens, policies)
    except AuthConfigError as exc:
        raise AuthConfigError(f"{source}: {exc}") from None


def load_token_table(path: str | Path) -> TokenTable:
    """Read a token file: `.json` as JSON, `.yaml`/`.yml` as YAML.

    Raises AuthConfigError when the file is missing, unparsable or invalid.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in {".json", ".yaml", ".yml"}:
        raise AuthConfigError(f"{path}: token file must end in .json, .yaml or .yml")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise AuthConfigError(f"{path}: cannot read token file: {exc.strerror}") from None
    try:
        doc = json.loads(text) if suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise AuthConfigError(f"{path}: not valid {suffix[1:].upper()}: {exc}") from None
    return parse_token_document(doc, str(path))


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying `token`, for clients on channels without call credentials.

    On a TLS channel `grpc.access_token_call_credentials(token)` sends the same header.
    """
    return (("authorization", f"Bearer {token}"),)


# ---------------------------------------------------------------------------- interceptor

_current: contextvars.ContextVar[Principal | None] = contextvars.ContextVar(
    "kvcache_principal", default=None
)


def current_principal() -> Principal | None:
    """The caller of the RPC being served (None outside an authenticated handler)."""
    return _current.get()


@contextlib.contextmanager
def principal_scope(principal: Principal | None) -> Iterator[Principal | None]:
    """Make `principal` the current one inside the block (handlers, servicer tests)."""
    token = _current.set(principal)
    try:
        yield principal
    finally:
        _current.reset(token)


def _bearer_token(metadata: Any) -> str | None:
    """The token of the single `authorization: Bearer <token>` entry, else None."""
    values = [v for k, v in (metadata or ()) if k == "authorization"]
    if len(values) != 1 or not isinstance(values[0], str):
        return None
    scheme, _, token = values[0].partition(" ")
    if scheme.lower() != "bearer" or not token or " " in token:
        return None
    return token


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Authenticate every RPC outside OPEN_SERVICE_PREFIXES and authorise restricted ones.

    method_permissions maps a full method name ("/kvcache.v1.KVCache/PublishPublic") to the
    permission it needs. Rejected calls never reach the servicer and never deserialize the
    request, so an unauthenticated caller cannot probe the parser.
    """

    def __init__(
        self,
        table: TokenTable,
        method_permissions: Mapping[str, Permission] | None = None,
        open_prefixes: tuple[str, ...] = OPEN_SERVICE_PREFIXES,
    ) -> None:
        self._table = table
        self._permissions = dict(method_permissions or {})
        self._open = open_prefixes
        self._handlers = HandlerCache()

    def decide(self, method: str, metadata: Any) -> tuple[Principal | None, grpc.StatusCode, str]:
        """Pure decision: (principal, OK) or (None, error code, message)."""
        if method.startswith(self._open):
            return None, grpc.StatusCode.OK, ""
        token = _bearer_token(metadata)
        if token is None:
            return (
                None,
                grpc.StatusCode.UNAUTHENTICATED,
                "missing or malformed credentials: send metadata 'authorization: Bearer <token>'",
            )
        principal = self._table.authenticate(token)
        if principal is None:
            return None, grpc.StatusCode.UNAUTHENTICATED, "unknown bearer token"
        needed = self._permissions.get(method)
        if needed is not None and not principal.policy.allows(needed):
            return (
                None,
                grpc.StatusCode.PERMISSION_DENIED,
                f"tenant {principal.tenant!r} lacks the {needed.value!r} permission "
                f"needed by {method}",
            )
        return principal, grpc.StatusCode.OK, ""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        principal, code, message = self.decide(method, handler_call_details.invocation_metadata)
        if code is not grpc.StatusCode.OK:
            return _rejecting_handler(handler, code, message)
        if principal is None:  # an open service
            return handler
        # One wrapper per method and principal (tenants are few), not one per call.
        return self._handlers.get(
            (method, principal), handler, lambda h: _with_principal(h, principal)
        )


def _rejecting_handler(
    handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str
) -> grpc.RpcMethodHandler:
    async def reject(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, message)

    # No deserializer: the raw bytes are handed over untouched and ignored.
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(reject)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(reject)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(reject)
    return grpc.stream_stream_rpc_method_handler(reject)


def _bind_unary(behavior: Callable[..., Any], principal: Principal) -> Callable[..., Any]:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
        with principal_scope(principal):
            result = behavior(request, context)
            if inspect.isawaitable(result):
                result = await result
            return result

    return wrapped


def _bind_streaming(behavior: Callable[..., Any], principal: Principal) -> Callable[..., Any]:
    if not (inspect.isasyncgenfunction(behavior) or inspect.isgeneratorfunction(behavior)):
        return _bind_unary(behavior, principal)
    is_async = inspect.isasyncgenfunction(behavior)

    async def wrapped_gen(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        # grpc.aio drives one RPC's generator from one task, so the variable set here is
        # seen by the behaviour's code and by nothing else.
        with principal_scope(principal):
            if is_async:
                async for response in behavior(request, context):
                    yield response
            else:
                for response in behavior(request, context):
                    yield response

    return wrapped_gen


def _with_principal(handler: grpc.RpcMethodHandler, principal: Principal) -> grpc.RpcMethodHandler:
    common = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(
            _bind_unary(handler.unary_unary, principal), **common
        )
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(
            _bind_unary(handler.stream_unary, principal), **common
        )
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(
            _bind_streaming(handler.unary_stream, principal), **common
        )
    return grpc.stream_stream_rpc_method_handler(
        _bind_streaming(handler.stream_stream, principal), **common
    )
