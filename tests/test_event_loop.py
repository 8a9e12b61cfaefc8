"""The coordinator's event loop (cache_service.event_loop, server.event_loop).

The choice as pure logic (what each setting makes, with and without uvloop installed, and
what a bad one gets), then a real service on each loop: decode steps over a local session
and over gRPC, every output against dense attention, an error status that changes nothing,
and no block referenced after the frees. (Every other service test runs on the default,
asyncio's loop.)
"""

from __future__ import annotations

import asyncio
import importlib.util
import warnings

import pytest
import torch
from service_support import HQ, LAYOUT, Mirror, ServiceHarness, local_workers, service_config

from cache_service import cli
from cache_service import event_loop as ev
from cache_service.client import KVCacheClient, NotFoundError
from cache_service.config import ConfigError, ServiceConfig

pytestmark = pytest.mark.timeout(120)

HAVE_UVLOOP = importlib.util.find_spec("uvloop") is not None
needs_uvloop = pytest.mark.skipif(not HAVE_UVLOOP, reason="uvloop is not installed")


@pytest.fixture
def without_uvloop(monkeypatch):
    """This process as if uvloop were not installed."""
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "uvloop" else real(name, *args, **kwargs)

    monkeypatch.setattr(ev.importlib.util, "find_spec", find_spec)


# ------------------------------------------------------------------------------ the choice


def test_asyncio_is_the_default_and_uvloop_is_refused_where_it_is_missing(
    without_uvloop,
) -> None:
    assert ServiceConfig().server.event_loop == "asyncio"
    assert ev.loop_factory("asyncio") is asyncio.new_event_loop
    with pytest.raises(ev.EventLoopUnavailable, match="uvloop is not installed here"):
        ev.loop_factory("uvloop")


def test_an_unknown_loop_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="one of asyncio, uvloop, got 'libuv'"):
        ev.loop_factory("libuv")
    with pytest.raises(ConfigError, match=r"server\.event_loop must be one of asyncio, uvloop"):
        ServiceConfig().with_overrides({"server.event_loop": "libuv"})


@pytest.mark.parametrize("choice", ["asyncio", pytest.param("uvloop", marks=needs_uvloop)])
def test_run_runs_the_coroutine_on_the_loop_chosen_and_closes_it(choice) -> None:
    seen = []

    async def main() -> int:
        seen.append(asyncio.get_running_loop())
        await asyncio.sleep(0)
        return 7

    assert ev.run(main(), choice) == 7
    assert ev.loop_name(seen[0]) == choice
    assert seen[0].is_closed()


def test_a_loop_that_cannot_be_made_leaves_no_coroutine_unawaited(without_uvloop) -> None:
    async def main() -> None:
        raise AssertionError("must not run")

    coro = main()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "coroutine ... was never awaited" would fail here
        with pytest.raises(ev.EventLoopUnavailable):
            ev.run(coro, "uvloop")
    assert coro.cr_frame is None  # closed


def test_serve_with_an_unavailable_loop_says_why_and_starts_nothing(without_uvloop, capsys) -> None:
    assert cli.main(["serve", "--in-process", "--port", "0", "--event-loop", "uvloop"]) == 2
    assert "uvloop is not installed here" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        cli.main(["serve", "--event-loop", "libuv"])


# ------------------------------------------------------------------------------ a service


def _decode(client: KVCacheClient, seed: int, steps: int = 3, batch: int = 3) -> None:
    """Prefill then `steps` decode steps of `batch` sequences, layer by layer, every output
    checked against dense attention; the sequences freed at the end."""
    gen = torch.Generator().manual_seed(seed)
    d, hkv = LAYOUT.head_dim, LAYOUT.num_kv_heads
    ids = [client.create_sequence().seq_id for _ in range(batch)]
    mirrors = [Mirror(s, LAYOUT.num_layers) for s in ids]
    prompt = 5
    for step in range(steps + 1):
        n = prompt if step == 0 else 1
        tokens = [[100 * step + j for j in range(n)] for _ in ids]
        for layer in range(LAYOUT.num_layers):
            k = torch.randn(batch, n, hkv, d, generator=gen)
            v = torch.randn(batch, n, hkv, d, generator=gen)
            q = torch.randn(batch, n, HQ, d, generator=gen)
            out = client.append_attend_batch(layer, ids, tokens, k, v, q)
            for i, m in enumerate(mirrors):
                m.add(layer, k[i], v[i])
                ref, _ = m.reference(layer, q[i])
                torch.testing.assert_close(out[i], ref.float(), atol=1e-4, rtol=1e-4)
    for s in ids:
        client.free(s)


@pytest.mark.parametrize("choice", ["asyncio", pytest.param("uvloop", marks=needs_uvloop)])
def test_a_service_on_each_loop_serves_local_sessions_and_grpc(choice) -> None:
    config = service_config(**{"server.event_loop": choice})
    with ServiceHarness(config, local_workers(1, 64)) as svc:
        assert ev.loop_name(svc.loop) == choice
        for seed, local in ((1, "auto"), (2, False)):
            with KVCacheClient(svc.address, local_session=local) as client:
                _decode(client, seed)
                assert client.local_session_active is (local == "auto")
                before = svc.stats()
                with pytest.raises(NotFoundError, match="no-such-seq"):
                    client.append_attend_batch(
                        0,
                        ["no-such-seq"],
                        [[1]],
                        torch.zeros(1, 1, LAYOUT.num_kv_heads, LAYOUT.head_dim),
                        torch.zeros(1, 1, LAYOUT.num_kv_heads, LAYOUT.head_dim),
                        torch.zeros(1, 1, HQ, LAYOUT.head_dim),
                    )
                assert svc.stats() == before
        svc.checks_finished()
        svc.check_integrity()
        stats = svc.stats()
        assert stats.active_sequences == 0
        assert all(w.used == 0 for w in stats.workers.values()), stats.workers
