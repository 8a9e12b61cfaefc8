"""The load generator's filled-once contexts (`fill_bases`, `BenchConfig.bases`): runs
decode forks of sequences filled once, leave the bases as they were and free their forks;
`free_bases` leaves nothing behind. Against a real server over a real port."""

from __future__ import annotations

import pytest
from service_support import LAYOUT, ServiceHarness, local_workers, service_config

from cache_service.cli.bench import BenchConfig, fill_bases, free_bases, run_decode_bench

pytestmark = pytest.mark.timeout(120)

CONTEXT = 20  # not a multiple of the block size: a fork shares a partial block too


def _info(svc: ServiceHarness, seq_id: str):
    return svc.call(svc.coordinator.block_manager.sequence_info, "default", seq_id)


def _live(svc: ServiceHarness) -> int:
    return svc.call(lambda: svc.coordinator.block_manager.stats().active_sequences)


def test_runs_decode_forks_of_the_bases_and_leave_them_as_they_were() -> None:
    cfg = BenchConfig(batch=2, context=CONTEXT, steps=2, warmup_steps=1, clients=2, num_q_heads=4)
    with ServiceHarness(service_config(), local_workers(1, 64)) as svc:
        bases = fill_bases(svc.address, cfg)
        assert [len(b) for b in bases] == [2, 2] and len({s for b in bases for s in b}) == 4
        for ids in bases:
            for seq_id in ids:
                assert _info(svc, seq_id).written == (CONTEXT,) * LAYOUT.num_layers
        for _ in range(2):  # twice: every run starts from the same context
            result = run_decode_bench(svc.address, BenchConfig(**{**cfg.__dict__, "bases": bases}))
            assert len(result.call_seconds) == 2 * 2 * LAYOUT.num_layers
            assert result.tokens == 2 * 2 * 2
            assert _live(svc) == 4  # the forks were freed, the bases not
            for ids in bases:
                for seq_id in ids:
                    assert _info(svc, seq_id).written == (CONTEXT,) * LAYOUT.num_layers
        # One client can run on some of the bases (the first client's, or several joined).
        one = BenchConfig(
            **{**cfg.__dict__, "clients": 1, "batch": 4, "bases": (bases[0] + bases[1],)}
        )
        run_decode_bench(svc.address, one)
        svc.check_integrity()
        free_bases(svc.address, bases)
        assert _live(svc) == 0
        svc.check_integrity()


def test_bases_must_match_the_clients_and_the_batch() -> None:
    with pytest.raises(ValueError, match=r"bases must hold 2 tuple\(s\) of 2 sequence ids"):
        BenchConfig(batch=2, clients=2, bases=(("a", "b"),))
    with pytest.raises(ValueError, match=r"got \[2, 1\]"):
        BenchConfig(batch=2, clients=2, bases=(("a", "b"), ("c",)))


def test_a_failed_fill_frees_what_it_filled() -> None:
    # More context than the pool holds: the fill fails, and nothing stays allocated.
    cfg = BenchConfig(batch=2, context=64 * LAYOUT.block_size, clients=2, num_q_heads=4)
    with ServiceHarness(service_config(), local_workers(1, 64)) as svc:
        with pytest.raises(RuntimeError, match="filling the bench's sequences failed"):
            fill_bases(svc.address, cfg)
        assert _live(svc) == 0
        svc.check_integrity()
