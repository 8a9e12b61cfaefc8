"""The SQLite command log itself: generations, the log, checkpoints, the writer lock."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from cache_service.engine.store import (
    MetadataStore,
    StoreConfig,
    StoreCorruptError,
    StoreError,
    StoreLockedError,
)

pytestmark = pytest.mark.timeout(60)


def _open(path: Path, **kw: object) -> MetadataStore:
    store = MetadataStore(StoreConfig(str(path), **kw))  # type: ignore[arg-type]
    store.begin_generation()
    return store


def test_generation_increments_on_every_open(tmp_path: Path) -> None:
    path = tmp_path / "m.db"
    gens = []
    for _ in range(3):
        with MetadataStore(StoreConfig(str(path))) as store:
            assert store.stored_generation() == len(gens)
            gens.append(store.begin_generation())
            assert store.generation == gens[-1]
    assert gens == [1, 2, 3]
    with MetadataStore(StoreConfig(str(path))) as store, pytest.raises(StoreError, match="begin"):
        _ = store.generation


def test_a_new_store_is_readable_by_its_owner_only(tmp_path: Path) -> None:
    path = tmp_path / "m.db"
    store = _open(path)
    store.append("create_sequence", {"prompt_token_ids": [1, 2, 3]}, {"seq_id": "x"})
    for f in (path, Path(f"{path}-wal")):
        assert f.stat().st_mode & 0o077 == 0, oct(f.stat().st_mode)
    store.close()


def test_wal_mode_and_synchronous_setting(tmp_path: Path) -> None:
    for sync, code in (("FULL", 2), ("NORMAL", 1)):
        store = _open(tmp_path / f"{sync}.db", synchronous=sync)
        try:
            assert store._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
            assert store._db.execute("PRAGMA synchronous").fetchone()[0] == code
        finally:
            store.close()


def test_log_round_trip_and_checkpoint_truncation(tmp_path: Path) -> None:
    path = tmp_path / "m.db"
    store = _open(path)
    lsns = [store.append("op", {"i": i, "toks": list(range(i))}, {"r": i * 2}) for i in range(5)]
    assert lsns == [1, 2, 3, 4, 5]
    assert [r.args["i"] for r in store.records_after(2)] == [2, 3, 4]
    store.write_checkpoint(5, {"state": [1, 2, 3]}, {"w0": "e1"})
    assert store.log_length() == 0
    # lsns keep growing after the checkpoint deleted the rows they follow.
    assert store.append("op", {"i": 5}, None) == 6
    store.close()

    store = _open(path)
    assert store.generation == 2
    cp = store.latest_checkpoint()
    assert cp is not None and cp.lsn == 5 and cp.generation == 1
    assert cp.state == {"state": [1, 2, 3]} and cp.worker_epochs == {"w0": "e1"}
    rest = list(store.records_after(cp.lsn))
    assert [(r.lsn, r.generation, r.op, r.args, r.result) for r in rest] == [
        (6, 1, "op", {"i": 5}, None)
    ]
    assert store.last_lsn() == 6
    store.close()


def test_a_checkpoint_must_cover_the_whole_log(tmp_path: Path) -> None:
    store = _open(tmp_path / "m.db")
    store.append("a", {}, None)
    store.append("b", {}, None)
    with pytest.raises(StoreError, match="does not cover"):
        store.write_checkpoint(1, {}, {})
    assert store.latest_checkpoint() is None and store.log_length() == 2
    store.close()


def test_transaction_groups_and_rolls_back(tmp_path: Path) -> None:
    store = _open(tmp_path / "m.db")
    with store.transaction():
        store.append("a", {}, 1)
        store.append("b", {}, 2)
    with pytest.raises(RuntimeError, match="boom"), store.transaction():
        store.append("c", {}, 3)
        raise RuntimeError("boom")
    assert [r.op for r in store.records_after(0)] == ["a", "b"]
    assert store.last_lsn() == 2
    store.close()


def test_bad_values_are_refused_and_change_nothing(tmp_path: Path) -> None:
    store = _open(tmp_path / "m.db")
    with pytest.raises(ValueError, match="not JSON"):
        store.append("x", {"v": float("nan")}, None)
    with pytest.raises(ValueError, match="not JSON"):
        store.append("x", {"v": object()}, None)
    with pytest.raises(ValueError, match="non-empty"):
        store.append("", {}, None)
    with pytest.raises(ValueError, match="managed by the store"):
        store.set_meta("generation", "99")
    assert store.last_lsn() == 0 and store.stored_generation() == 1
    store.close()
    with pytest.raises(ValueError, match="synchronous"):
        StoreConfig(str(tmp_path / "x.db"), synchronous="OFF")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="checkpoint_every"):
        StoreConfig(str(tmp_path / "x.db"), checkpoint_every=0)


def test_a_second_writer_is_locked_out(tmp_path: Path) -> None:
    path = tmp_path / "m.db"
    store = _open(path)
    store.append("a", {}, None)
    with pytest.raises(StoreLockedError, match="another process"):
        MetadataStore(StoreConfig(str(path), busy_timeout_s=0.1))
    # Another process, too.
    probe = (
        "import sys\n"
        "from cache_service.engine.store import MetadataStore, StoreConfig, StoreLockedError\n"
        "try:\n"
        f"    MetadataStore(StoreConfig({str(path)!r}, busy_timeout_s=0.1))\n"
        "except StoreLockedError:\n"
        "    sys.exit(3)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=Path(__file__).parents[1])
    assert done.returncode == 3
    store.close()
    # Released on close.
    reopened = _open(path)
    assert reopened.last_lsn() == 1
    reopened.close()


def test_foreign_or_future_files_are_refused(tmp_path: Path) -> None:
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not a database" * 100)
    with pytest.raises(StoreCorruptError, match="not a readable store"):
        MetadataStore(StoreConfig(str(junk)))
    future = tmp_path / "future.db"
    _open(future).close()
    db = sqlite3.connect(future)
    db.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    db.commit()
    db.close()
    with pytest.raises(StoreCorruptError, match="schema version 99"):
        MetadataStore(StoreConfig(str(future)))
    with pytest.raises(StoreError, match="not a file"):
        MetadataStore(StoreConfig(str(tmp_path)))
