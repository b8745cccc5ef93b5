"""Crash safety of the flash retained store (docs/retained.md, "Crash
safety"; rule S8): a power cut at ANY byte of any store write (puts, deletes,
commits, compaction, the rewrite after a torn tail) leaves a store that
opens, holds every change committed before the cut, and holds no torn record.

Two models: here under CPython, every byte offset (what reaches the file is
a prefix of what was written; it cannot see a missing fsync); and in
host_tests/portable/lfs_crash.py under the MicroPython unix port, every
block write of littlefs v2 on a RAM block device (unsynced data is lost
there, so it does catch a missing sync), run by the last test below.

A power cut is simulated by a filesystem (FlashStore's `fs` hook) that lets
exactly N bytes reach the files and then stops: the write in progress keeps
its first bytes, and nothing after it happens (no more writes, no rename, no
remove, no file creation). The scripted sequence is run once to count its
bytes, then again for every N from 0 to that total, reopening each time.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "lib"))

import edgestore as es  # noqa: E402


class PowerCut(Exception):  # noqa: N818 (a power cut is not an error)
    """The simulated power cut (deliberately not an OSError: the store must
    not swallow it the way it tolerates a failed compaction)."""


class CutFs(es.Fs):
    """Writes at most `budget` bytes in total (None: no limit), then cuts."""

    def __init__(self, budget: int | None) -> None:
        self.budget = budget
        self.written = 0

    def _dead(self) -> bool:
        return self.budget is not None and self.written >= self.budget

    def open(self, path: str, mode: str) -> Any:
        if ("w" in mode or "a" in mode) and self._dead():
            raise PowerCut  # creating or truncating a file is a write
        return CutFile(Path(path).open(mode, buffering=0), self)

    def sync(self, f: Any) -> None:
        pass  # every byte written is on disk already (unbuffered)

    def rename(self, src: str, dst: str) -> None:
        if self._dead():
            raise PowerCut
        Path(src).replace(dst)

    def remove(self, path: str) -> None:
        if self._dead():
            raise PowerCut
        Path(path).unlink()

    def sync_dir(self, path: str) -> None:
        pass


class CutFile:
    def __init__(self, f: Any, fs: CutFs) -> None:
        self.f = f
        self.fs = fs

    def write(self, b: Any) -> int:
        b = bytes(b)
        fs = self.fs
        if fs.budget is not None:
            room = fs.budget - fs.written
            if room < len(b):
                if room > 0:
                    self.f.write(b[:room])
                fs.written = fs.budget
                raise PowerCut
        fs.written += len(b)
        n: int = self.f.write(b)
        return n

    def read(self, n: int = -1) -> bytes:
        data: bytes = self.f.read(n)
        return data

    def seek(self, *a: int) -> int:
        pos: int = self.f.seek(*a)
        return pos

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.f.close()


class NoSyncFs(es.Fs):
    """The real filesystem, without fsync: the checks need no durability
    (there is no real power cut) and fsync dominates their run time."""

    def sync(self, f: Any) -> None:
        f.flush()

    def sync_dir(self, path: str) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def msg(topic: str, payload: bytes, deadline: float = 0) -> tuple[Any, ...]:
    return (topic.encode(), payload, 1, b"", deadline, 1 if deadline else 0)


def script() -> list[tuple[Any, ...]]:
    """About 3 KB of writes: new topics, replacements, deletes, a record
    larger than the write buffer, CLOCK markers (a message with a lifetime,
    a clock moving 7 s per step) and compactions (low thresholds)."""
    ops: list[tuple[Any, ...]] = [("put", "life", b"long", 10**6)]
    for r in range(40):
        t = f"t/{r % 5}"
        ops.append(("put", t, b"v%d-" % r + b"x" * (r % 4) * 9, 0))
        if r % 3 == 2:
            ops.append(("delete", f"t/{(r + 2) % 5}"))
        if r == 16:
            ops.append(("put", "big", b"B" * 300, 0))  # > the 256-byte buffer
        if r % 2:
            ops.append(("commit",))
    ops.append(("commit",))
    return ops


def states(ops: list[tuple[Any, ...]]) -> list[dict[str, bytes]]:
    """The store's contents after each prefix of put/delete operations."""
    cur: dict[str, bytes] = {}
    out = [dict(cur)]
    for op in ops:
        if op[0] == "put":
            cur[op[1]] = op[2]
        elif op[0] == "delete":
            cur.pop(op[1], None)
        else:
            continue
        out.append(dict(cur))
    return out


def open_store(path: str, mode: str, fs: es.Fs, clock: Clock) -> es.FlashStore:
    return es.FlashStore(
        path,
        mode,
        capacity=16,
        clock=clock,
        fs=fs,
        compact_ratio=0.5,
        compact_min_bytes=600,
        buffer_size=256,
    )


def run(path: str, mode: str, ops: list[tuple[Any, ...]], fs: CutFs) -> tuple[int, int, Any]:
    """Runs ops until done or cut; returns (committed, attempted, store)."""
    clock = Clock()
    committed = attempted = done = 0
    st = None
    try:
        st = open_store(path, mode, fs, clock)
        for op in ops:
            clock.now += 7
            if op[0] == "commit":
                st.commit()
                committed = done
                continue
            attempted += 1
            if op[0] == "put":
                st.put(op[1], msg(op[1], op[2], op[3] and clock.now + op[3]))
            else:
                st.delete(op[1])
            done += 1
        st.close()
        committed = done
    except PowerCut:
        pass
    return committed, attempted, st


def contents(st: es.FlashStore) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for m in st.messages():
        assert m[0].decode() not in out
        out[m[0].decode()] = m[1]
    return out


def clean(d: Path) -> None:
    for p in d.iterdir():
        p.unlink()


@pytest.fixture
def fast_dir(tmp_path: Path) -> Iterator[Path]:
    """A RAM-backed directory where there is one (thousands of file opens)."""
    if not Path("/dev/shm").is_dir():
        yield tmp_path
        return
    d = Path(tempfile.mkdtemp(prefix="edgestore-crash-", dir="/dev/shm"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def check_reopen(path: str, mode: str, allowed: list[dict[str, bytes]], where: str) -> None:
    st = open_store(path, mode, NoSyncFs(), Clock())
    got = contents(st)
    assert got in allowed, f"{where}: recovered {got}"
    assert st.open_stats["corrupt"] == 0, where  # a cut never makes a bad CRC
    assert not Path(path + ".new").exists(), where
    # the store keeps working: the torn tail goes at the next write
    st.put("post", msg("post", b"p"))
    st.commit()
    st.close()
    st = open_store(path, mode, NoSyncFs(), Clock())
    assert contents(st) == {**got, "post": b"p"}, where
    assert st.open_stats["torn_bytes"] == 0, where
    st.close()


@pytest.mark.parametrize("mode", ["disc", "disc_only"])
def test_power_cut_at_every_byte_of_every_write(fast_dir: Path, mode: str) -> None:
    """Crash safety + S8: every byte offset of puts, deletes, commits,
    CLOCK markers and compactions."""
    tmp_path = fast_dir
    ops = script()
    path = str(tmp_path / "r.ebrs")
    full = CutFs(None)
    committed, attempted, st = run(path, mode, ops, full)
    assert st is not None and st.compactions >= 2, "the script must compact"
    total = full.written
    assert 2000 < total < 6000, total
    sts = states(ops)
    assert contents(open_store(path, mode, NoSyncFs(), Clock())) == sts[-1]
    for n in range(total + 1):
        clean(tmp_path)
        committed, attempted, _ = run(path, mode, ops, CutFs(n))
        if not Path(path).exists():
            assert committed == 0, f"cut at {n}: committed data but no file"
            continue
        check_reopen(path, mode, sts[committed : attempted + 1], f"cut at byte {n}")


@pytest.mark.parametrize("mode", ["disc", "disc_only"])
def test_power_cut_while_rewriting_a_torn_tail(fast_dir: Path, mode: str) -> None:
    """Crash safety: the rewrite that drops a torn tail is itself cut-safe."""
    tmp_path = fast_dir
    path = str(tmp_path / "r.ebrs")
    st = open_store(path, mode, NoSyncFs(), Clock())
    for i in range(12):
        st.put(f"k/{i}", msg(f"k/{i}", b"value %d" % i))
    st.close()
    good = Path(path).read_bytes()
    torn = good + bytes(es.encode(es.T_PUT, es.put_parts(b"k/x", 1, 0, 0, 0, 0, b"", b"x")))[:15]
    base = {f"k/{i}": b"value %d" % i for i in range(12)}
    full = CutFs(None)
    Path(path).write_bytes(torn)
    st = open_store(path, mode, full, Clock())
    st.put("new", msg("new", b"n"))
    st.commit()
    total = full.written
    for n in range(total + 1):
        clean(tmp_path)
        Path(path).write_bytes(torn)
        done = False
        try:
            st = open_store(path, mode, CutFs(n), Clock())
            st.put("new", msg("new", b"n"))
            st.commit()
            done = True
        except PowerCut:
            pass
        allowed = [{**base, "new": b"n"}] if done else [base, {**base, "new": b"n"}]
        check_reopen(path, mode, allowed, f"cut at byte {n} of the rewrite")


@pytest.mark.parametrize("torn", [False, True], ids=["whole", "torn-prog"])
def test_power_cut_at_every_littlefs_block_write_micropython(torn: bool) -> None:
    """Crash safety + S8 on littlefs v2 in the MicroPython unix port: the
    device keeps its first K write operations (and with torn-prog half of
    the next), for every K; see host_tests/portable/lfs_crash.py."""
    mp = Path(sys.executable).parent / "micropython"
    argv = [str(mp), str(REPO / "host_tests" / "portable" / "lfs_crash.py"), str(REPO / "lib")]
    r = subprocess.run(
        argv + (["--torn"] if torn else []),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 0 and " 0 failed" in r.stdout, r.stdout + r.stderr
    assert "block writes, 2 compactions" in r.stdout, r.stdout
