"""A small KV-aware router: send a prompt to the service and worker holding its longest
cached prefix, learned from the services' KV events.

    python examples/kv_router.py --target 127.0.0.1:50051 --target 127.0.0.1:50052 \\
        --prompt 1,2,3,4,5,6,7,8,9

For each service the router keeps the keys it holds, per worker, from `kv_events` (stored
adds keys, removed drops them, cleared drops a worker's), resuming each subscription where
it stopped; a new `stream_id` (a service restarted without a write-ahead log) or an
OUT_OF_RANGE (it fell behind the service's ring) makes it rebuild that service's view from
the oldest kept event. To route, it computes the prompt's block keys with
`cache_service.client.block_hashes` (the service's own key function, salted with the
router's tenant and the namespace) and walks them while a worker holds each one.

The events are hints: a block may be evicted between the event and the request; the
service's CreateSequence adopts what is really cached.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from cache_service.client import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    KVCacheClient,
    KvEvent,
    block_hashes,
)

__all__ = ["KvRouter", "Route", "ServiceView"]


@dataclass
class ServiceView:
    """What the router knows of one service: its keys, per worker, as of `position`."""

    client: KVCacheClient
    block_size: int
    fingerprint: str
    position: int = 0
    stream_id: str = ""
    keys: dict[bytes, set[str]] = field(default_factory=dict)
    on_worker: dict[str, set[bytes]] = field(default_factory=dict)

    def apply(self, event: KvEvent) -> None:
        """Update the view with one event."""
        body = event.body
        if isinstance(body, BlockStored):
            for key in body.hashes:
                self.keys.setdefault(key, set()).add(body.worker_id)
                self.on_worker.setdefault(body.worker_id, set()).add(key)
        elif isinstance(body, BlockRemoved):
            for key in body.hashes:
                self._drop(key, body.worker_id)
        elif isinstance(body, AllCleared):
            workers = [body.worker_id] if body.worker_id else list(self.on_worker)
            for worker in workers:
                for key in list(self.on_worker.get(worker, ())):
                    self._drop(key, worker)

    def _drop(self, key: bytes, worker: str) -> None:
        holders = self.keys.get(key)
        if holders is not None:
            holders.discard(worker)
            if not holders:
                del self.keys[key]
        self.on_worker.get(worker, set()).discard(key)

    def reset(self) -> None:
        """Forget everything (the numbering restarted, or events were missed)."""
        self.position = 0
        self.keys.clear()
        self.on_worker.clear()


@dataclass(frozen=True)
class Route:
    """Where to send a prompt: the service (its target), the worker, and how many of the
    prompt's leading tokens it holds (0: no cached prefix anywhere; target is the first)."""

    target: str
    worker_id: str
    cached_tokens: int


class KvRouter:
    """Routes prompts across services by their cached prefixes.

    Args:
        targets: the services' host:port.
        token: the bearer token (its tenant's keys are the ones matched).
        tenant: the tenant the token names ("default" on a server without authentication).
        namespace: the prefix-cache namespace of the model being served.
    """

    def __init__(
        self, targets: list[str], token: str | None = None, tenant: str = "default",
        namespace: str = "",
    ) -> None:  # fmt: skip
        self.tenant = tenant
        self.namespace = namespace
        self.services: dict[str, ServiceView] = {}
        for target in targets:
            client = KVCacheClient(target, token=token)
            info = client.info()
            self.services[target] = ServiceView(client, info.layout.block_size, info.fingerprint)

    def close(self) -> None:
        """Close every connection."""
        for view in self.services.values():
            view.client.close()

    def refresh(self) -> None:
        """Read every service's events up to its newest one."""
        from cache_service.client import InvalidArgumentError

        for view in self.services.values():
            try:
                self._catch_up(view)
            except InvalidArgumentError:  # OUT_OF_RANGE: events were missed; rebuild
                view.reset()
                self._catch_up(view)

    def _catch_up(self, view: ServiceView) -> None:
        with view.client.kv_events(view.position, namespace=self.namespace) as sub:
            for batch in sub.batches():
                if sub.stream_id != view.stream_id:
                    if view.stream_id:  # another numbering: start over from its oldest
                        view.reset()
                        view.stream_id = sub.stream_id
                        return self._catch_up(view)
                    view.stream_id = sub.stream_id
                for event in batch:
                    view.apply(event)
                view.position = sub.position
                if sub.caught_up:
                    return None
        return None

    def route(self, prompt: list[int]) -> Route:
        """The service and worker holding the longest cached prefix of `prompt`."""
        self.refresh()
        best: Route | None = None
        for target, view in self.services.items():
            keys = block_hashes(
                prompt, view.block_size, view.fingerprint,
                tenant=self.tenant, namespace=self.namespace,
            )  # fmt: skip
            for worker in view.on_worker:
                blocks = 0
                for key in keys:
                    if worker not in view.keys.get(key, ()):
                        break
                    blocks += 1
                cached = blocks * view.block_size
                if best is None or cached > best.cached_tokens:
                    best = Route(target, worker, cached)
        if best is None or best.cached_tokens == 0:
            return Route(next(iter(self.services)), "", 0)
        return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", action="append", required=True, help="host:port")
    parser.add_argument("--token", help="bearer token")
    parser.add_argument("--tenant", default="default", help="the token's tenant")
    parser.add_argument("--namespace", default="", help="prefix-cache namespace")
    parser.add_argument("--prompt", required=True, help="token ids, comma-separated")
    args = parser.parse_args()
    router = KvRouter(args.target, args.token, args.tenant, args.namespace)
    try:
        route = router.route([int(t) for t in args.prompt.split(",")])
    finally:
        router.close()
    where = f"{route.target} worker {route.worker_id}" if route.worker_id else route.target
    print(f"send to {where}: {route.cached_tokens} prompt tokens cached there")


if __name__ == "__main__":
    main()
