"""The CPython branch of the compat block's socket wait (lib/edgebroker.py,
`_asyncio()`): a wait never formats its socket (the loop's lookup of an
unregistered socket fails with a KeyError whose message is the socket's
repr: getsockname, getpeername and getpid, once per wait), keeps its reader
registered between waits (not two epoll_ctl calls a wake-up) until the
socket is readable with nobody waiting or forgotten, and neither a wait
cancelled after its socket closed nor a socket closed unforgotten leaves an
entry that would hide the next socket given the same number.
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


def test_a_wait_never_formats_its_socket_and_keeps_its_reader_between_waits():
    eb = _eb()

    async def main():
        loop = asyncio.get_running_loop()
        adds = []
        add_reader = loop.add_reader

        def counted(fd, cb, *args):
            adds.append(fd)
            return add_reader(fd, cb, *args)

        loop.add_reader = counted
        a, b = _pair()
        try:
            _Counted.reprs = 0
            for _ in range(5):
                b.send(b"x")
                async with asyncio.timeout(2):  # (not wait_for: no task of its own)
                    await eb._io_wait(a, False)
                assert a.recv(16) == b"x"
                # registered once, kept between waits (no epoll_ctl a wake-up)
                assert _registered(loop, a.fileno()) and len(adds) == 1
            await asyncio.wait_for(eb._io_wait(a, True), 2)  # writable at once
            key = loop._selector.get_key(a.fileno())
            assert key.data[1] is None  # the writer is not kept
            assert _Counted.reprs == 0
            # readable with nobody waiting: watched no longer after two turns
            # (level-triggered: it would run every turn), and a wait still wakes
            b.send(b"y")
            for _ in range(3):
                await asyncio.sleep(0)
            assert not _registered(loop, a.fileno())
            async with asyncio.timeout(2):
                await eb._io_wait(a, False)
            assert a.recv(16) == b"y" and len(adds) == 2
            eb._io_forget(a)
            assert not _registered(loop, a.fileno())
        finally:
            a.close()
            b.close()

    asyncio.run(main())


def test_a_closed_socket_left_registered_does_not_hide_the_next_one():
    # every close in lib forgets first; this holds even if one did not
    eb = _eb()

    async def main():
        a, b = _pair()
        fd = a.fileno()
        b.send(b"x")
        async with asyncio.timeout(2):
            await eb._io_wait(a, False)  # returns with its reader kept
        a.close()  # not forgotten
        b.close()
        c, d = _pair()
        try:
            if c.fileno() != fd:
                c, d = d, c
                c.setblocking(False)
            assert c.fileno() == fd
            d.send(b"y")
            async with asyncio.timeout(2):
                await eb._io_wait(c, False)
            assert c.recv(16) == b"y"
        finally:
            c.close()
            d.close()

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


def test_a_reader_kept_by_an_ended_loop_is_registered_again_in_the_next():
    # asyncio.run twice on one socket: the first loop ended with its reader kept
    eb = _eb()
    a, b = _pair()

    async def once(data):
        b.send(data)
        async with asyncio.timeout(2):
            await eb._io_wait(a, False)
        assert a.recv(16) == data

    try:
        asyncio.run(once(b"x"))
        asyncio.run(once(b"y"))
    finally:
        eb._io_forget(a)
        a.close()
        b.close()
