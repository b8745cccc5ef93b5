"""The CPython branch of the compat block's socket wait (lib/edgebroker.py,
`_asyncio()`): a wait never formats its socket (the loop's lookup of an
unregistered socket fails with a KeyError whose message is the socket's
repr: getsockname, getpeername and getpid, once per wait), leaves nothing
registered once it returns, and a wait cancelled after its socket closed
leaves no entry that would hide the next socket given the same number.
Real socket pairs on a real asyncio loop."""

import asyncio
import importlib.util
import socket
from pathlib import Path

LIB = Path(__file__).resolve().parents[2] / "lib"


def _eb():
    spec = importlib.util.spec_from_file_location("edgebroker_wait_test", LIB / "edgebroker.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod._asyncio()  # binds _io_wait/_io_forget for this interpreter
    return mod


class _Counted(socket.socket):
    reprs = 0

    def __repr__(self):
        _Counted.reprs += 1
        return super().__repr__()


def _pair():
    a, b = socket.socketpair()
    c = _Counted(a.family, a.type, a.proto, fileno=a.detach())
    c.setblocking(False)
    return c, b


def _registered(loop, fd):
    try:
        loop._selector.get_key(fd)
        return True
    except KeyError:
        return False


def test_a_wait_never_formats_its_socket_and_leaves_nothing_registered():
    eb = _eb()

    async def main():
        loop = asyncio.get_running_loop()
        a, b = _pair()
        try:
            _Counted.reprs = 0
            for _ in range(5):
                b.send(b"x")
                await asyncio.wait_for(eb._io_wait(a, False), 2)
                assert a.recv(16) == b"x"
                assert not _registered(loop, a.fileno())
            await asyncio.wait_for(eb._io_wait(a, True), 2)  # writable at once
            assert not _registered(loop, a.fileno())
            assert _Counted.reprs == 0
        finally:
            a.close()
            b.close()

    asyncio.run(main())


def test_forget_removes_the_reader_of_a_waiting_task():
    eb = _eb()

    async def main():
        loop = asyncio.get_running_loop()
        a, b = _pair()
        t = asyncio.ensure_future(eb._io_wait(a, False))
        await asyncio.sleep(0)
        assert _registered(loop, a.fileno())
        eb._io_stop([t], a)
        eb._io_forget(a)
        assert not _registered(loop, a.fileno())
        a.close()
        b.close()
        await asyncio.sleep(0)
        assert t.cancelled()

    asyncio.run(main())


def test_a_wait_cancelled_after_its_socket_closed_does_not_hide_the_next_socket():
    eb = _eb()

    async def main():
        a, b = _pair()
        fd = a.fileno()
        t = asyncio.ensure_future(eb._io_wait(a, False))
        await asyncio.sleep(0)
        a.close()  # closed under a waiting task, not forgotten
        b.close()
        t.cancel()
        await asyncio.sleep(0)
        c, d = _pair()
        try:
            if c.fileno() != fd:
                c, d = d, c  # the pair's other end took the number
                c.setblocking(False)
            assert c.fileno() == fd
            d.send(b"y")
            await asyncio.wait_for(eb._io_wait(c, False), 2)
            assert c.recv(16) == b"y"
        finally:
            c.close()
            d.close()

    asyncio.run(main())
