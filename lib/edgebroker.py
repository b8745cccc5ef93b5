# edgebroker: an MQTT 3.1.1 + 5.0 broker for MicroPython gateways and CPython hosts.
#
# One file, sectioned like a table of contents:
#   1. compat            the only place that knows there are two interpreters
#   2. constants         packet types, reason codes, property ids
#   3. limits            the profile: limits(), with_secrets() (its defaults,
#                        allowed values and checks: lib/edgeconf.py, boot-only)
#   4. codec             reading and writing the wire format
#   5. topics            validation and the subscription tree
#   6. retained store    the message tuple, the store interface (its RAM
#                        backend is lib/edgeram.py, its flash one edgestore)
#   7. client state      Conn (one connection) and Session (outlives connections)
#   8. engine            sans-IO protocol core: handlers, routing, delivery,
#                        durability, housekeeping, $SYS, the local client
#   9. servers           Broker: the poll server and the asyncio server,
#                        both moving bytes for one Engine
#  10. the API           start(profile, host, port, data_dir) -> Broker
#  11. main              command line entry point (host build and emulator)
#
# Nothing happens at import: the limits, store and clock are handed to start().
# Comments cite the OASIS specifications: MQTT-x.y.z-n statements are MQTT 5.0
# unless marked 3.1.1. Bytecode drops the comments, so they are free on a board.

# ---------------------------------------------------------------- 1. compat
import errno
import gc
import os
import select
import sys
import time

try:
    import socket
except ImportError:  # a port without a network stack (qemu, WebAssembly):
    socket = None  # the Engine runs; only Broker (listening) needs sockets

try:
    from micropython import const
except ImportError:  # CPython

    def const(x):
        return x


try:  # MicroPython: wrapping millisecond and microsecond ticks
    from time import ticks_diff as _ticks_diff
    from time import ticks_ms as _ticks_ms
    from time import ticks_us as _ticks_us
except ImportError:  # CPython

    def _ticks_ms():
        return int(time.monotonic() * 1000)

    def _ticks_us():
        return time.monotonic_ns() // 1000

    def _ticks_diff(a, b):
        return a - b


try:  # MicroPython heap figures and collection threshold; CPython has none
    _mem_free = gc.mem_free
    _mem_alloc = gc.mem_alloc
    _gc_threshold = gc.threshold
except AttributeError:
    _mem_free = None
    _mem_alloc = None
    _gc_threshold = None

_IMPL = sys.implementation.name

# Unix seconds from the wall clock, or None while it was never set (a board
# without NTP starts near its epoch: 2000 on ESP32, 1970 elsewhere, so any
# time before 2020 means "not set"). Boards pass their own to open_store().
# A port may be built without time.gmtime and time.time (qemu): no wall clock.
try:
    _EPOCH_2000 = 946684800 if time.gmtime(0)[0] == 2000 else 0
except AttributeError:
    _EPOCH_2000 = 0
_time = getattr(time, "time", None)


def _wallclock():
    if _time is None:
        return None
    t = _time() + _EPOCH_2000
    return int(t) if t > 1577836800 else None


# A thread that fsyncs beside the loop (CPython only, see Engine.commit);
# MicroPython has none: there a commit writes and syncs in the loop.
_Syncer = None
# Bytes of upstream packets a bridge may encode ahead of its window
# (edgebridge Bridge._prep); 0 on a board, where heap counts more than the
# round trip it saves.
_PREP_BYTES = 0

if hasattr(select.poll(), "ipoll"):
    # MicroPython: ipoll yields (socket, event) without allocating a result
    # list; sockets are registered and looked up by object.
    def _poll(p, timeout):
        return p.ipoll(timeout)

    _poller = select.poll

    def _key(sock):
        return sock

    def _recv_into(sock, mv):
        # readinto returns None when no data is waiting on a non-blocking
        # socket (and while a TLS handshake needs more bytes); its TLS
        # raises ValueError for a certificate it refuses: an OSError here
        try:
            n = sock.readinto(mv)
        except ValueError as e:
            raise OSError(str(e)) from None
        return -1 if n is None else n

    def _send(sock, data):
        # write: what plain and TLS sockets both have; None = would block
        try:
            n = sock.write(data)
        except ValueError as e:
            raise OSError(str(e)) from None
        return 0 if n is None else n

    def _tls_server(cfg):
        # its mbedtls may be built without PEM: DER from the files
        import ssl

        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(_der(cfg["tls_cert"]), _der(cfg["tls_key"] or cfg["tls_cert"]))
        if cfg["tls_client_ca"]:
            ctx.load_verify_locations(cadata=_der(cfg["tls_client_ca"]))
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def _pending(sock):
        return 0  # its poll already sees bytes the TLS layer holds
# >>> host only: CPython (a board build leaves these lines out)
else:
    if hasattr(select, "epoll"):
        # Linux: epoll reports ready sockets in the order their bytes came
        # (its ready list), poll in descriptor order. So a SUBSCRIBE that
        # came before another client's PUBLISH is served first, as
        # mosquitto (epoll) and the asyncio server serve it; under poll the
        # older connection always went first (README, "Order"; docs/design.md,
        # "Servers"). The POLL* masks are the EPOLL* values on Linux.
        _poller = select.epoll

        def _poll(p, timeout):
            return p.poll(timeout / 1000)

    else:
        _poller = select.poll

        def _poll(p, timeout):
            return p.poll(timeout)

    def _key(sock):
        return sock.fileno()

    def _recv_into(sock, mv):
        try:
            return sock.recv_into(mv)
        except BlockingIOError:
            return -1
        except OSError as e:
            if _tls_wants(e):
                return -1  # TLS: a handshake or record needs more bytes
            raise

    def _send(sock, data):
        try:
            return sock.send(data)
        except OSError as e:
            if _tls_wants(e):
                return 0
            raise

    def _tls_server(cfg):
        import ssl

        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cfg["tls_cert"], cfg["tls_key"] or None)
        if cfg["tls_client_ca"]:
            ctx.load_verify_locations(cafile=cfg["tls_client_ca"])
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def _pending(sock):
        # decrypted bytes poll cannot see (TLS only)
        return sock.pending()

    _PREP_BYTES = 4096

    class _Syncer:
        """Pipelined group commit (CPython): the loop writes a durable
        sink's queue and goes on reading while this thread fsyncs it; the
        acknowledgements of that turn wait for the fsync (Engine.commit). One
        job at a time: what is written meanwhile goes into the next one. The
        loop hands over dup()s of the file descriptors, so a compaction that
        closes the file cannot pull one from under an fsync."""

        def __init__(self):
            import queue
            import threading

            self.fds = []  # loop: [(file, its dup'd fd)] written since the last start()
            self.busy = False  # loop: a job was started and not yet collected
            self.done = False  # the thread: the job is over
            self.err = None  # ... and how (an OSError, or None)
            self.wake = None  # the server's: called by the thread when done
            # C-level primitives, no Condition: a job is handed over through
            # a SimpleQueue, and `_held` is held from start() until the job
            # is over (a Lock may be released by another thread). A Condition's
            # notify() was 4% of the loop's samples at 45,000 msg/s.
            self._jobs = queue.SimpleQueue()
            self._held = threading.Lock()
            self._t = threading.Thread(target=self._run, name="edgebroker-fsync", daemon=True)
            self._t.start()  # waits for jobs; made only for a broker with a durable bridge

        def add(self, f):
            # one fsync per file and job, however many turns wrote to it
            for g, _ in self.fds:
                if g is f:
                    return
            self.fds.append((f, os.dup(f.fileno())))

        def start(self):
            # only when not busy (Engine.commit): the lock is free here
            job = self.fds
            self.fds = []
            self.busy = True
            self.done = False
            self._held.acquire()
            self._jobs.put(job)

        def _run(self):
            while True:
                job = self._jobs.get()
                if job == "stop":
                    return
                self.err = _sync_fds(job)
                self.done = True
                self._held.release()
                w = self.wake
                if w is not None:
                    try:
                        w()
                    except (RuntimeError, OSError):
                        pass  # the loop is gone (stopping): nothing waits

        def bind(self, event):
            # the asyncio server's wake event, set from this thread
            loop = _aio.get_running_loop()
            self.wake = lambda: loop.call_soon_threadsafe(event.set)

        def wait(self):
            # the loop waits for the job in flight (a local publish: see commit)
            self._held.acquire()
            self._held.release()

        def collect(self):
            """The finished job's error (None: synced); the loop calls it once done is set."""
            self.busy = False
            self.done = False
            return self.err

        def stop(self):
            # waits for the job in flight (bounded by one fsync), ends the thread
            self.wait()
            if self._t is not None:
                self._t = None
                self._jobs.put("stop")
            self.sync_pending()  # nothing waits for it: no acknowledgement left

        def sync_pending(self):
            # in the loop: what waits for the next job (commit(now), stop)
            fds = self.fds
            self.fds = []
            return _sync_fds(fds)

    def _sync_fds(fds):
        # [(file, dup'd fd)]: each fsynced (data and size) and closed; the last error
        err = None
        sync = getattr(os, "fdatasync", os.fsync)
        for _, fd in fds:
            try:
                sync(fd)
            except OSError as e:
                err = e
            os.close(fd)
        return err


def _tls_wants(e):
    return type(e).__name__ in ("SSLWantReadError", "SSLWantWriteError")


# <<< host only


def _der(path):
    """A certificate or key file's first PEM block as DER (or the file as
    it is when it is DER already): MicroPython's TLS may lack PEM."""
    import binascii

    with open(path, "rb") as f:
        data = f.read()
    i = data.find(b"-----BEGIN")
    if i < 0:
        return data
    i = data.find(b"\n", i) + 1
    j = data.find(b"-----END", i)
    return binascii.a2b_base64(data[i:j].replace(b"\n", b"").replace(b"\r", b""))


# A keyed hash for dicts of attacker-chosen topics: MicroPython's string
# hash is 16 bits and unkeyed, so a flood of colliding topics would make
# every lookup a long probe. 30 bits of SHA-256 over a per-store random key.
try:
    from hashlib import sha256 as _sha256
except ImportError:  # a build without hashlib: unkeyed
    _sha256 = None


def _new_key():
    try:
        return os.urandom(8)
    except (AttributeError, OSError, NotImplementedError):
        return b"%d" % _ticks_ms()


def _topic_key(key, topic):
    if _sha256 is None:
        return hash(topic) & 0x3FFFFFFF
    h = _sha256(key)
    h.update(topic.encode())
    d = h.digest()
    return (d[0] & 0x3F) << 24 | d[1] << 16 | d[2] << 8 | d[3]


# MicroPython's decoder accepts UTF-16 surrogates and overlong forms that
# MQTT-1.5.4-1 forbids; an extra byte check runs only where it is lax.
try:
    str(b"\xed\xa0\x80", "utf-8")
    _LAX_UTF8 = True
except UnicodeError:
    _LAX_UTF8 = False

try:  # MicroPython (its default file is stdout: logs go to stderr)
    _pe = sys.print_exception

    def _print_exc(e):
        _pe(e, sys.stderr)
except AttributeError:  # CPython

    def _print_exc(e):
        import traceback

        traceback.print_exception(e)


# >>> host only: the command line (a board build leaves these lines out)
try:  # CPython: SIGTERM stops the broker the way SIGINT does
    import signal as _signal

    def _on_sigterm(signum, frame):
        raise KeyboardInterrupt

    def _install_signals():
        _signal.signal(_signal.SIGTERM, _on_sigterm)
        # a shell starts background jobs with SIGINT ignored; we want it
        _signal.signal(_signal.SIGINT, _signal.default_int_handler)
except ImportError:  # MicroPython: SIGINT raises KeyboardInterrupt already

    def _install_signals():
        pass
# <<< host only


# MicroPython's socket module names neither; these are Linux and lwIP values
_IPPROTO_TCP = getattr(socket, "IPPROTO_TCP", 6)
_TCP_NODELAY = getattr(socket, "TCP_NODELAY", 1)
_SHUT_WR = getattr(socket, "SHUT_WR", 1)
_DRAIN_S = const(2)  # graceful close: seconds a closing socket is drained at most
_QUIET_S = 0.2  # ... and closed once nothing arrived for this long


# errno values by name: they differ between ports (EINPROGRESS is 115 on
# Linux, 119 on the ESP32's newlib, 36 on BSD). MicroPython's errno module
# names only some; a name it lacks falls back to the numbers Linux and lwIP
# use for it (the unix port, and lwIP boards whose errno module lacks it).
def _errnos(names, fallback):
    got = tuple(getattr(errno, n) for n in names if hasattr(errno, n))
    return got if got else fallback


_EAGAIN = _errnos(("EAGAIN", "EWOULDBLOCK"), (11,))
_EMFILE = _errnos(("EMFILE", "ENFILE"), (24, 23))  # no socket can be accepted now
_EADDRINUSE = _errnos(("EADDRINUSE",), (98, 112))
_EINPROGRESS = _errnos(("EINPROGRESS",), (115, 119))


def _peer(a):
    """accept()'s address as "host:port", for logs: a tuple on CPython and
    lwIP boards, raw sockaddr bytes on MicroPython's unix port."""
    try:
        if not isinstance(a, tuple):
            a = socket.sockaddr(a)
            ip = a[1]
            if len(ip) == 4:
                return "%d.%d.%d.%d:%d" % (ip[0], ip[1], ip[2], ip[3], a[2])
            return "?:%d" % a[2]
        return "%s:%d" % (a[0], a[1])
    except (AttributeError, TypeError, IndexError, ValueError, OSError):
        return "?"


# asyncio, loaded on first use (a poll-only host run never imports it).
# The async server waits for a socket with _io_wait(sock, write):
#   MicroPython: the scheduler's own poller (what its Stream and
#     start_server use); cancelling the waiting task takes the socket out of
#     that poller at once, before the server closes it.
#   CPython: the running loop's add_reader/add_writer; _io_forget() removes
#     them before the socket is closed (a closed fd left in the selector
#     breaks the next socket that gets its number).
_aio = None
_io_wait = None
_io_forget = None
_io_stop = None


def _asyncio():
    global _aio, _io_wait, _io_forget, _io_stop
    if _aio is not None:
        return _aio
    try:
        import asyncio
    except ImportError:  # older MicroPython (1.16 checked) has uasyncio only
        import uasyncio as asyncio

    core = getattr(asyncio, "core", None)
    if core is not None and hasattr(core, "_io_queue"):  # MicroPython

        def _queue(sock, write):
            q = core._io_queue  # looked up each time: new_event_loop() replaces it
            try:
                (q.queue_write if write else q.queue_read)(sock)
            except MemoryError:
                # select.poll.register adds its map entry before it allocates:
                # a MemoryError leaves an empty entry that the next poll (or
                # unregister) dereferences: SIGSEGV in poll_poll_internal
                # (modselect.c says "This case is not handled"). The poller
                # is never touched again: a new one gets every other socket.
                e = q.map.get(id(sock))
                if e is not None and e[1 - write] is None:
                    del q.map[id(sock)]
                q.poller = _repoll(q.map.values())
                raise

        def _wait(sock, write):
            # What a waiting task holds while it waits, one per connection:
            # kept to two locals (its frame is part of the idle cost)
            _queue(sock, write)
            yield

        def _forget(sock):
            # A socket about to be closed must not stay in the scheduler's
            # poller: its number is soon another socket's, and a stale entry
            # would wake (and re-run) a task that has ended.
            q = core._io_queue
            e = q.map.get(id(sock))
            if e is not None and e[-1] is sock:
                del q.map[id(sock)]
                try:
                    q.poller.unregister(sock)
                except (OSError, ValueError, KeyError):
                    pass

        def _stop(tasks, sock):
            # Cancel only a task that waits in the poller for this socket.
            # One the poller already woke is on the run queue with its
            # `data` still naming the poller, and cancel() would push it a
            # second time: it then runs after it finished and corrupts the
            # scheduler (seen as "Task exception wasn't retrieved" and
            # methods resolving to the wrong function). Such a task sees
            # its connection closed when it runs and ends by itself. The
            # entry is read before any cancel: the first one removes it.
            e = core._io_queue.map.get(id(sock))
            if e is not None:
                for t in tasks:
                    if t is not None and (e[0] is t or e[1] is t):
                        t.cancel()
    # >>> host only: CPython (a board build leaves these lines out)
    else:  # CPython

        def _done(fut):
            if not fut.done():
                fut.set_result(None)

        class _Fd:
            # What the loop registers instead of the socket: the loop looks
            # a socket up before it adds it, and the miss raises a KeyError
            # whose message formats the socket (getsockname, getpeername,
            # getpid: three syscalls, about 5% of the loop when the bridge
            # forwards). Lookups by number or by this object work as before.
            # fut: the read waiting now; idle: woken with nobody waiting;
            # loop: the one it is registered with
            __slots__ = ("s", "fut", "idle", "loop")

            def __init__(self, s, loop):
                self.s = s
                self.fut = None
                self.idle = False
                self.loop = loop

            def fileno(self):
                return self.s.fileno()

            def __repr__(self):
                return "<socket>"

        # A socket's reader stays registered between waits (until _forget or
        # until it is readable twice with nobody waiting): adding and removing
        # it on every wait cost two epoll_ctl calls and a new Handle a wake-up,
        # about 4% of the loop when the bridge forwards. Readable once with
        # nobody waiting is the normal case: the woken task runs only after
        # the next select. Bounded by the sockets open (every close forgets).
        _readers = {}

        def _readable(fd):
            fut = fd.fut
            if fut is not None:
                fd.fut = None
                if not fut.done():
                    fut.set_result(None)
            elif fd.idle:
                # the task is busy elsewhere: stop watching (level-triggered
                # epoll would call this on every turn of the loop)
                _readers.pop(fd.s, None)
                fd.loop.remove_reader(fd)
            else:
                fd.idle = True

        async def _wait(sock, write):
            loop = asyncio.get_running_loop()
            fut = loop.create_future()
            if not write:
                fd = _readers.get(sock)
                if fd is None or fd.loop is not loop:
                    # (or kept by a loop that has ended: asyncio.run again)
                    fd = _Fd(sock, loop)
                    try:
                        # an entry under this number left by a socket closed
                        # unforgotten would take the new one's place unpolled
                        loop.remove_reader(sock.fileno())
                    except (ValueError, KeyError, OSError):
                        pass
                    loop.add_reader(fd, _readable, fd)
                    _readers[sock] = fd
                fd.idle = False
                fd.fut = fut
                try:
                    await fut
                except BaseException:
                    # cancelled (its socket may be closed already): watched
                    # no longer, as before this wait
                    fd.fut = None
                    _readers.pop(sock, None)
                    try:
                        loop.remove_reader(fd)
                    except (ValueError, KeyError, OSError):
                        pass
                    raise
                return
            sock = _Fd(sock, loop)
            loop.add_writer(sock, _done, fut)
            try:
                await fut
            finally:
                try:
                    loop.remove_writer(sock)
                except (ValueError, KeyError, OSError):
                    pass  # already forgotten and closed

        def _forget(sock):
            _readers.pop(sock, None)
            try:
                loop = asyncio.get_running_loop()
                loop.remove_reader(sock)
                loop.remove_writer(sock)
            except (RuntimeError, ValueError, KeyError, OSError):
                pass

        def _stop(tasks, sock):
            for t in tasks:
                if t is not None and not t.done():
                    t.cancel()
    # <<< host only

    _io_wait = _wait
    _io_forget = _forget
    _io_stop = _stop
    _aio = asyncio
    return asyncio


def _current():
    return _aio.current_task()


# >>> host only: the poll server's (a board runs the asyncio server)
def _unpoll(p):
    # an epoll holds a descriptor of its own; a select.poll has none
    close = getattr(p, "close", None)
    if close is not None:
        close()


# <<< host only


def _repoll(entries):
    """A new poller (_poller) for [read waiter, write waiter, socket]
    entries, after a MemoryError left the old one with a half-made entry."""
    gc.collect()
    p = _poller()
    for e in entries:
        p.register(
            e[2],
            (select.POLLIN if e[0] is not None else 0)
            | (select.POLLOUT if e[1] is not None else 0),
        )
    return p


# ------------------------------------------------------------- 2. constants
VERSION = "0.1.0"

_CONNECT = const(1)
_CONNACK = const(2)
_PUBLISH = const(3)
_PUBACK = const(4)
_PUBREC = const(5)
_PUBREL = const(6)
_PUBCOMP = const(7)
_SUBSCRIBE = const(8)
_SUBACK = const(9)
_UNSUBSCRIBE = const(10)
_UNSUBACK = const(11)
_PINGREQ = const(12)
_PINGRESP = const(13)
_DISCONNECT = const(14)
_AUTH = const(15)

# MQTT 5.0 reason codes (2.4)
_RC_SUCCESS = const(0x00)
_RC_NO_SUBSCRIPTION = const(0x11)
_RC_UNSPECIFIED = const(0x80)
_RC_MALFORMED = const(0x81)
_RC_PROTOCOL = const(0x82)
_RC_IMPL_SPECIFIC = const(0x83)
_RC_BAD_VERSION = const(0x84)
_RC_BAD_CLIENT_ID = const(0x85)
_RC_BAD_AUTH = const(0x86)
_RC_NOT_AUTHORIZED = const(0x87)
_RC_SERVER_BUSY = const(0x89)
_RC_BAD_AUTH_METHOD = const(0x8C)
_RC_KEEPALIVE = const(0x8D)
_RC_TAKEN_OVER = const(0x8E)
_RC_BAD_FILTER = const(0x8F)
_RC_BAD_TOPIC = const(0x90)
_RC_PID_NOT_FOUND = const(0x92)
_RC_RECV_MAX = const(0x93)
_RC_ALIAS_INVALID = const(0x94)
_RC_TOO_LARGE = const(0x95)
_RC_QUOTA = const(0x97)
_RC_RETAIN_UNSUPPORTED = const(0x9A)
_RC_QOS_UNSUPPORTED = const(0x9B)

# 3.1.1 CONNACK return codes (3.2.2.3)
_RC3_BAD_VERSION = const(1)
_RC3_BAD_ID = const(2)
_RC3_UNAVAILABLE = const(3)
_RC3_BAD_AUTH = const(4)
_RC3_NOT_AUTHORIZED = const(5)

# Property identifiers (2.2.2.2) and their wire types
_P_PAYLOAD_FORMAT = const(0x01)
_P_MESSAGE_EXPIRY = const(0x02)
_P_CONTENT_TYPE = const(0x03)
_P_RESPONSE_TOPIC = const(0x08)
_P_CORRELATION = const(0x09)
_P_SUB_ID = const(0x0B)
_P_SESSION_EXPIRY = const(0x11)
_P_ASSIGNED_ID = const(0x12)
_P_SERVER_KEEPALIVE = const(0x13)
_P_AUTH_METHOD = const(0x15)
_P_AUTH_DATA = const(0x16)
_P_REQ_PROBLEM = const(0x17)
_P_WILL_DELAY = const(0x18)
_P_REQ_RESPONSE = const(0x19)
_P_REASON_STRING = const(0x1F)
_P_RECEIVE_MAX = const(0x21)
_P_ALIAS_MAX = const(0x22)
_P_ALIAS = const(0x23)
_P_MAX_QOS = const(0x24)
_P_RETAIN_AVAILABLE = const(0x25)
_P_USER = const(0x26)
_P_MAX_PACKET = const(0x27)

_T_BYTE = const(1)
_T_U16 = const(2)
_T_U32 = const(3)
_T_VBI = const(4)
_T_STR = const(5)
_T_BIN = const(6)
_T_PAIR = const(7)

# Wire type of each property id (index = id, 0 = no such property): a
# 43-byte table instead of a dict, which costs more heap.
_PROP_TYPES = (
    b"\x00\x01\x03\x05\x00\x00\x00\x00\x05\x06\x00\x04\x00\x00\x00\x00"
    b"\x00\x03\x05\x02\x00\x05"
    b"\x06\x01\x03\x01\x05\x00\x05\x00\x00\x05\x00\x02\x02\x02\x01\x01\x07\x03\x01\x01\x01"
)
# Where a client may send each property (Table 2-4), one byte per id: a
# bit for each packet the broker reads properties of (_K_ below; the
# properties only a server sends are 0). A property where its packet may
# not carry it is a Malformed Packet (2.2.2.2).
_PROP_WHERE = (
    b"\x00\x05\x05\x05\x00\x00\x00\x00\x05\x05\x00\x0c\x00\x00\x00\x00"
    b"\x00\x22\x00\x00\x00\x02\x02\x02\x01\x02\x00\x00\x20\x00\x00\x20"
    b"\x00\x02\x02\x04\x00\x00\x3f\x02\x00\x00\x00"
)
_K_WILL = const(1)
_K_CONNECT = const(2)
_K_PUBLISH = const(4)
_K_SUBSCRIBE = const(8)
_K_UNSUBSCRIBE = const(16)
_K_DISCONNECT = const(32)
# Properties a PUBLISH carries to subscribers unchanged (3.3.2.3); Message
# Expiry is re-encoded with the remaining time, Topic Alias and Subscription
# Identifier are never forwarded.
_FORWARDED = (_P_PAYLOAD_FORMAT, _P_CONTENT_TYPE, _P_RESPONSE_TOPIC, _P_CORRELATION, _P_USER)

_MAX_VBI = const(268435455)
_NO_LIMIT_PACKET = const(268435460)


# --------------------------------------------------------------- 3. limits
# Every key of a board profile the broker reads, its default and allowed
# values, and the check of a profile live in lib/edgeconf.py: needed while a
# broker is built, not while it runs. limits() and with_secrets() import it;
# load_modules() drops it (its bytecode leaves the heap).
def limits(profile=None):
    """The effective limits: edgeconf.DEFAULTS overridden by a profile dict
    (only the keys the broker reads). A bad value raises ValueError naming
    the key, the value and what is allowed."""
    import edgeconf

    return edgeconf.limits(profile)


def with_secrets(profile, secrets):
    """The profile with a secrets file's credentials merged in
    (edgeconf.with_secrets: users, bridge usernames and passwords)."""
    import edgeconf

    return edgeconf.with_secrets(profile, secrets)


_LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40}


class MqttError(Exception):
    """A protocol violation: the connection ends with this reason code
    (5.0 DISCONNECT) or is closed (3.1.1). Raised only from handlers."""

    def __init__(self, code, text):
        self.code = code
        self.text = text


# ---------------------------------------------------------------- 4. codec
def vbi(n):
    """Variable Byte Integer (1.5.5)."""
    if n < 128:
        return bytes((n,))
    out = bytearray()
    while True:
        d = n & 0x7F
        n >>= 7
        if n:
            out.append(d | 0x80)
        else:
            out.append(d)
            return bytes(out)


def read_vbi(b, i, end):
    """Returns (value, next index). At most 4 bytes (MQTT-1.5.5-1)."""
    v = 0
    shift = 0
    while True:
        if i >= end:
            raise MqttError(_RC_MALFORMED, "truncated variable byte integer")
        d = b[i]
        i += 1
        v |= (d & 0x7F) << shift
        if not d & 0x80:
            return v, i
        shift += 7
        if shift > 21:
            raise MqttError(_RC_MALFORMED, "variable byte integer over 4 bytes")


def u16(n):
    return bytes((n >> 8 & 0xFF, n & 0xFF))


def u32(n):
    return bytes((n >> 24 & 0xFF, n >> 16 & 0xFF, n >> 8 & 0xFF, n & 0xFF))


def mqstr(s):
    """UTF-8 Encoded String (1.5.4) from str or bytes."""
    if isinstance(s, str):
        s = s.encode()
    return u16(len(s)) + s


def _need(i, k, end):
    if i + k > end:
        raise MqttError(_RC_MALFORMED, "packet shorter than its fields")


def read_u16(b, i, end):
    _need(i, 2, end)
    return b[i] << 8 | b[i + 1], i + 2


def read_bin(b, i, end):
    n, i = read_u16(b, i, end)
    _need(i, n, end)
    return bytes(b[i : i + n]), i + n


def check_utf8(raw):
    """Decodes an MQTT string; malformed if not well-formed UTF-8 or if it
    holds U+0000 (MQTT-1.5.4-1, MQTT-1.5.4-2)."""
    try:
        s = str(raw, "utf-8")
    except UnicodeError:
        raise MqttError(_RC_MALFORMED, "invalid UTF-8") from None
    if "\x00" in s:
        raise MqttError(_RC_MALFORMED, "U+0000 in a string")
    if _LAX_UTF8 and len(s) != len(raw):
        _strict_utf8(raw)
    return s


def _strict_utf8(raw):
    # Overlong forms (C0, C1, E0 80-9F, F0 80-8F) and surrogates (ED A0-BF).
    n = len(raw)
    i = 0
    while i < n:
        c = raw[i]
        if c < 0x80:
            i += 1
            continue
        nxt = raw[i + 1] if i + 1 < n else 0
        if (
            c in (0xC0, 0xC1)
            or (c == 0xE0 and nxt < 0xA0)
            or (c == 0xED and nxt >= 0xA0)
            or (c == 0xF0 and nxt < 0x90)
        ):
            raise MqttError(_RC_MALFORMED, "invalid UTF-8")
        i += 2 if c < 0xE0 else 3 if c < 0xF0 else 4


def read_str(b, i, end):
    raw, i = read_bin(b, i, end)
    return check_utf8(raw), i


def read_props(b, i, end, maxu=65535, kind=0):
    """Properties (2.2.2): returns (dict id -> value, raw forwardable bytes,
    next index). User Properties collect in a list under P_USER, at most
    maxu of them (max_user_properties: 0x83 past it); a repeated property
    that may appear once is a Protocol Error; with kind (a _K_ bit) one the
    packet may not carry is Malformed. Linear in the packet's size."""
    if i < end and b[i] == 0:
        # no properties, the usual PUBLISH: answered here, in a frame small
        # enough for MicroPython's C stack (the parser's comes from the heap:
        # 4.7 us a call on the unix port, docs/boards.md)
        return {}, b"", i + 1
    return _read_props(b, i, end, maxu, kind)


def _read_props(b, i, end, maxu, kind):
    plen, i = read_vbi(b, i, end)
    stop = i + plen
    if stop > end:
        raise MqttError(_RC_MALFORMED, "properties longer than the packet")
    props = {}
    fwd = None
    nu = 0
    while i < stop:
        start = i
        pid = b[i]
        i += 1
        t = _PROP_TYPES[pid] if pid < len(_PROP_TYPES) else 0
        if t == 0:
            raise MqttError(_RC_MALFORMED, "unknown property 0x%02x" % pid)
        if kind and not _PROP_WHERE[pid] & kind:
            # 2.2.2.2: not valid for its packet type
            raise MqttError(_RC_MALFORMED, "property 0x%02x not allowed in this packet" % pid)
        if t == _T_BYTE:
            _need(i, 1, stop)
            v = b[i]
            i += 1
        elif t == _T_U16:
            v, i = read_u16(b, i, stop)
        elif t == _T_U32:
            _need(i, 4, stop)
            v = b[i] << 24 | b[i + 1] << 16 | b[i + 2] << 8 | b[i + 3]
            i += 4
        elif t == _T_VBI:
            v, i = read_vbi(b, i, stop)
        elif t == _T_STR:
            v, i = read_str(b, i, stop)
        elif t == _T_BIN:
            v, i = read_bin(b, i, stop)
        else:
            k, i = read_str(b, i, stop)
            v, i = read_str(b, i, stop)
            v = (k, v)
        if pid == _P_USER:
            nu += 1
            if nu > maxu:
                raise MqttError(_RC_IMPL_SPECIFIC, "more User Properties than max_user_properties")
            lst = props.get(_P_USER)
            if lst is None:
                props[_P_USER] = [v]
            else:
                lst.append(v)
        elif pid in props:
            raise MqttError(_RC_PROTOCOL, "property 0x%02x repeated" % pid)
        else:
            props[pid] = v
        if pid in _FORWARDED:
            if fwd is None:
                fwd = bytearray()
            fwd.extend(b[start:i])
    return props, bytes(fwd) if fwd else b"", stop


def reason(conn, text, size):
    """The Reason String property for a packet of size bytes (fixed header
    and property length aside), or none: the client asked for no problem
    information (MQTT-3.1.2-29), or it would take the packet past the
    client's Maximum Packet Size (MQTT-3.2.2-19, 3.9.2-1, 3.14.2-3)."""
    if not text or not conn.problem:
        return b""
    p = prop_str(_P_REASON_STRING, text)
    # 5: the fixed header at most, 2: the property length at most
    return p if size + len(p) + 7 <= conn.maxpkt else b""


# Local API properties by name (Broker.publish / subscribe callbacks).
_PROP_NAMES = (
    ("payload_format_indicator", _P_PAYLOAD_FORMAT),
    ("content_type", _P_CONTENT_TYPE),
    ("response_topic", _P_RESPONSE_TOPIC),
    ("correlation_data", _P_CORRELATION),
)


def _prop_val(k, v, text):
    # A string property (1.5.4: UTF-8, no U+0000, MQTT-1.5.4-2) or binary
    # data (1.5.6): str or bytes of at most 65,535 bytes (a longer one would
    # wrap its 2-byte length and corrupt the packet), encoded
    if isinstance(v, str):
        b = v.encode()
    elif isinstance(v, (bytes, bytearray)):
        b = bytes(v)
        if text:
            try:
                str(b, "utf-8")
            except UnicodeError:
                raise ValueError("properties: %s %r is not UTF-8" % (k, v)) from None
    else:
        raise ValueError("properties: %s %r is not str or bytes" % (k, v))
    if len(b) > 0xFFFF or (text and b"\x00" in b):
        raise ValueError("properties: %s over 65535 bytes or holding U+0000" % k)
    return mqstr(b)


def encode_props(d):
    """A local publish's properties dict -> (forwarded property bytes,
    Message Expiry Interval or 0). Unknown names and values a property
    cannot hold raise ValueError."""
    if not isinstance(d, dict):
        raise ValueError("properties: %r is not a dict" % (d,))
    out = bytearray()
    exp = 0
    for k in d:
        v = d[k]
        if k == "message_expiry_interval":
            if type(v) is not int or not 0 <= v <= 0xFFFFFFFF:
                raise ValueError(
                    "properties: message_expiry_interval %r (allowed 0..4294967295)" % (v,)
                )
            exp = v
        elif k == "user_properties":
            if not isinstance(v, (list, tuple)):
                raise ValueError("properties: user_properties %r is not a list of pairs" % (v,))
            for pair in v:
                if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                    raise ValueError("properties: user_properties %r is not a pair" % (pair,))
                out.append(_P_USER)
                out += _prop_val(k, pair[0], True) + _prop_val(k, pair[1], True)
        elif k == "payload_format_indicator":
            out += prop_byte(_P_PAYLOAD_FORMAT, 1 if v else 0)
        elif k == "correlation_data":
            out.append(_P_CORRELATION)
            out += _prop_val(k, v, False)
        elif k in ("content_type", "response_topic"):
            if k == "response_topic" and not (isinstance(v, str) and valid_topic_name(v)):
                raise ValueError("properties: response_topic %r is not a topic name" % (v,))
            out.append(_P_CONTENT_TYPE if k == "content_type" else _P_RESPONSE_TOPIC)
            out += _prop_val(k, v, True)
        else:
            raise ValueError("properties: unknown property %r" % (k,))
    return bytes(out), exp


def decode_props(fwd):
    """Forwarded property bytes -> dict by name (for local callbacks)."""
    d = {}
    if not fwd:
        return d
    props, _, _ = read_props(vbi(len(fwd)) + fwd, 0, len(fwd) + len(vbi(len(fwd))))
    for name, pid in _PROP_NAMES:
        if pid in props:
            d[name] = props[pid]
    if _P_USER in props:
        d["user_properties"] = props[_P_USER]
    return d


def prop_byte(pid, v):
    return bytes((pid, v))


def prop_u16(pid, v):
    return bytes((pid,)) + u16(v)


def prop_u32(pid, v):
    return bytes((pid,)) + u32(v)


def prop_str(pid, s):
    return bytes((pid,)) + mqstr(s)


def packet(ptype, flags, body):
    """A whole packet: fixed header (2.1) + body."""
    return bytes((ptype << 4 | flags,)) + vbi(len(body)) + body


# ---------------------------------------------------------------- 5. topics
def valid_topic_name(t):
    # MQTT-4.7.3-1: at least one character; MQTT-3.3.2-2: no wildcards.
    return len(t) > 0 and "+" not in t and "#" not in t


def valid_filter(f):
    """MQTT-4.7.1-1/2/3: '#' alone and last; '+' occupies a whole level."""
    if not f:
        return False
    levels = f.split("/")
    last = len(levels) - 1
    for i, lv in enumerate(levels):
        if "#" in lv and (lv != "#" or i != last):
            return False
        if "+" in lv and lv != "+":
            return False
    return True


def topic_matches(flevels, topic):
    """Does a filter (split into levels) match a topic name? Leading
    wildcards never match '$' topics (MQTT-4.7.2-1). Loop, no recursion."""
    if topic[:1] == "$" and flevels[0] in ("+", "#"):
        return False
    if flevels[0] == "#":
        return True  # the whole-set delivery: no split per message
    tlevels = topic.split("/")
    n = len(tlevels)
    m = len(flevels)
    i = 0
    # an index, not `for lv in flevels`: MicroPython keeps a for loop's
    # iterator in the frame, which then no longer fits on the C stack; a
    # frame from the heap made this function 8x slower (docs/boards.md)
    while i < m:
        lv = flevels[i]
        if lv == "#":
            return True
        if i >= n:
            return False
        if lv != "+" and lv != tlevels[i]:
            return False
        i += 1
    return i == n


def share_inner(filt):
    # the Topic Filter inside a valid $share/{ShareName}/{filter} (4.8.2)
    return filt[filt.find("/", 7) + 1 :]


class Group:
    """A shared subscription's group ($share/{ShareName}/{filter}, 4.8.2):
    one entry in the topic tree for all its members; each message goes to
    one of them, round robin over the connected ones first."""

    def __init__(self):
        # no copy of its filter: Engine.groups has it as the key, and the
        # tree's levels are the filter inside (share_inner)
        self.members = {}  # session -> (options byte, sub id), Session.subs' tuple
        self.order = []  # sessions, round-robin order
        self.next = 0

    def pick(self):
        order = self.order
        n = len(order)
        if not n:
            return None
        start = self.next
        for k in range(n):
            s = order[(start + k) % n]
            if s.conn is not None:
                self.next = (start + k + 1) % n
                return s
        # nobody connected: a member's session keeps it (its offline queue)
        self.next = (start + 1) % n
        return order[start % n]

    def add(self, sess, ent):
        # ent: the (options byte, sub id) tuple the session keeps too
        if sess not in self.members:
            self.order.append(sess)
        self.members[sess] = ent

    def remove(self, sess):
        if self.members.pop(sess, None) is not None:
            self.order.remove(sess)
            if self.next >= len(self.order):
                self.next = 0


# A topic tree node is one dict: its children by level (a level is always a
# str) and, under the int key _SUBS, its subscribers dict while it has any.
# One dict per level, not a list holding a children dict and a subscribers
# slot: on MicroPython that list and its items cost two heap blocks a level.
# A branch that only one filter takes is a tail instead of a dict a level:
# (filter, offset of the rest, subscribers dict), the rest matched in place
# (TopicTree.match). The filter str is the one the session keeps as its key,
# so a subscription of its own costs a tuple and a subscribers dict, not a
# dict and a level str for each of its levels (docs/boards.md). A filter
# that shares the tail's first levels splits it, one level at a time.
_SUBS = const(0)


class TopicTree:
    """Subscriptions by level, one node dict per level (see _SUBS) or a
    tail for a branch of one filter. A publish walks only the branches its
    levels select ('+', '#' and the literal level), never every subscription
    (mosquitto's subs.c does the same). A subscribers dict maps session (or
    Group) -> (options byte, sub id), the very tuple the session keeps in
    Session.subs (one per subscription, not two)."""

    def __init__(self):
        self.root = {}

    def add(self, filt, sess, ent):
        node = self.root
        pos = 0
        end = len(filt)
        while True:
            k = filt.find("/", pos)
            if k < 0:
                k = end
            lv = filt[pos:k]
            nxt = node.get(lv)
            if type(nxt) is tuple:
                if k < end and filt[k + 1 :] == nxt[0][nxt[1] :]:
                    nxt[2][sess] = ent  # the same filter
                    return
                # split: a tail one level shorter, under a node of its own
                f, p, ts = nxt
                j = f.find("/", p)
                nxt = node[lv] = {f[p:]: {_SUBS: ts}} if j < 0 else {f[p:j]: (f, j + 1, ts)}
            elif nxt is None:
                if k < end and lv != "#":
                    node[lv] = (filt, k + 1, {sess: ent})
                    return
                nxt = node[lv] = {}
            node = nxt
            if k == end:
                break
            pos = k + 1
        subs = node.get(_SUBS)
        if subs is None:
            subs = node[_SUBS] = {}
        subs[sess] = ent

    def remove(self, filt, sess):
        node = self.root
        path = []
        pos = 0
        for lv in filt.split("/"):
            nxt = node.get(lv)
            if nxt is None:
                return False
            path.append((node, lv))
            pos += len(lv) + 1  # where the rest starts (past the end: none)
            if type(nxt) is tuple:
                subs = nxt[2]
                if pos > len(filt) or filt[pos:] != nxt[0][nxt[1] :] or sess not in subs:
                    return False
                del subs[sess]
                if subs:
                    return True
                del node[lv]
                path.pop()
                break
            node = nxt
        else:
            subs = node.get(_SUBS)
            if subs is None or sess not in subs:
                return False
            del subs[sess]
            if not subs:
                del node[_SUBS]
        # prune empty branches (no children, no subscribers), deepest first
        while path:
            parent, lv = path.pop()
            if parent[lv]:
                break
            del parent[lv]
        return True

    def match(self, levels, dollar):
        """Yields the subscribers dicts of every node matching a topic."""
        n = len(levels)
        stack = [(self.root, 0)]
        while stack:
            node, i = stack.pop()
            if type(node) is tuple:
                # a tail (MQTT-4.7.1): its filter's levels from pos against
                # the topic's from i; '+' takes one level, '#' the rest and
                # the parent level (4.7.1.2). A tail never starts at the
                # first level: the '$' rule (MQTT-4.7.2-1) was applied above.
                filt, pos, subs = node
                end = len(filt)
                while True:
                    k = filt.find("/", pos)
                    if k < 0:
                        k = end
                    one = k - pos == 1
                    if one and filt[pos] == "#":
                        yield subs
                        break
                    if i >= n:
                        break
                    if not (one and filt[pos] == "+"):
                        lv = levels[i]
                        if len(lv) != k - pos or not filt.startswith(lv, pos):
                            break
                    i += 1
                    if k == end:
                        if i == n:
                            yield subs
                        break
                    pos = k + 1
                continue
            wild = not (dollar and i == 0)
            if i == n:
                subs = node.get(_SUBS)
                if subs:
                    yield subs
                h = node.get("#")  # 'a/#' matches 'a' (4.7.1.2)
                if h is not None and wild:
                    subs = h.get(_SUBS)
                    if subs:
                        yield subs
                continue
            if wild:
                h = node.get("#")
                if h is not None:
                    subs = h.get(_SUBS)
                    if subs:
                        yield subs
                p = node.get("+")
                if p is not None:
                    stack.append((p, i + 1))
            nx = node.get(levels[i])
            if nx is not None:
                stack.append((nx, i + 1))


# --------------------------------------------------------- 6. retained store
# A message is a tuple, immutable once made, shared by every queue it is in:
#   (topic bytes, payload bytes, qos, forwarded 5.0 property bytes,
#    expiry deadline in broker seconds or 0, own-expiry flag)
# The topic is kept as the bytes that go on the wire, not also as a str:
# routing decodes it while the message is routed (publish()'s caller has
# it), so a queued message holds no str. On a 32-bit MicroPython that is 32
# bytes less a message: the str's header, and six slots fit a tuple in two
# 16-byte heap blocks where seven take three.
_M_TB = const(0)
_M_PAYLOAD = const(1)
_M_QOS = const(2)
_M_PROPS = const(3)
_M_EXP = const(4)
_M_OWNEXP = const(5)


# The records below are lists (mutable, smaller than instances on
# MicroPython: no per-object attribute dict), read through named slots.
# An in-flight entry (Session.inflight), in send order. Four slots, not six:
# on MicroPython four items fit one heap block, six take two.
_F_PID = const(0)  # packet identifier
_F_MSG = const(1)  # the message; None once PUBREC came and PUBREL went out
_F_QR = const(2)  # QoS << 1 | RETAIN as sent: the PUBLISH flag bits (3.3.1)
_F_SIDS = const(3)  # Subscription Identifiers or None
# A queued entry (Session.queue), oldest first: [msg, qos, retain, sids], or
# the message tuple itself when it goes out as it came (its own QoS, RETAIN
# 0, no Subscription Identifier), which needs no list of its own.
_Q_MSG = const(0)
# A pending retained delivery (Session.rq):
_R_IT = const(0)  # iterator over the store's matches
_R_OPTS = const(1)  # subscription options byte
_R_SID = const(2)  # Subscription Identifier or 0
_R_FILT = const(3)  # the filter (UNSUBSCRIBE ends its delivery)
_R_HELD = const(4)  # a message taken from the iterator, waiting for the window or the buffer
# A delayed will (Engine.wills):
_W_AT = const(0)  # broker second it is due
_W_SESS = const(1)
_W_MSG = const(2)
_W_RETAIN = const(3)
# A matched route while one PUBLISH is routed (Engine.publish):
_MR_QOS = const(0)  # highest granted QoS over the session's matching filters
_MR_RAP = const(1)  # Retain As Published on any of them
_MR_SIDS = const(2)  # their Subscription Identifiers or None


def msg_size(m):
    return len(m[_M_TB]) + len(m[_M_PAYLOAD]) + len(m[_M_PROPS])


def q_entry(msg, qos, retain, sids):
    """A queued entry (see _Q_MSG): the bare message when it is sent as it
    came, else [msg, qos, retain, sids]."""
    if qos == msg[_M_QOS] and not retain and sids is None:
        return msg
    return [msg, qos, retain, sids]


def _undone(conn, acks):
    # PUBRECs that never left (their commit failed): the session's in2 marks
    # their packet ids 2, so that the client's resend is stored again, where
    # MQTT-4.3.3-10 would take it for a duplicate. No allocation: the keys
    # exist (store_failed runs when the heap may be out).
    s = conn.sess
    if acks and s is not None and type(s.in2) is dict:
        for a in acks:
            if a[0] == 0x50:
                pid = a[2] << 8 | a[3]
                if pid in s.in2:
                    s.in2[pid] = 2


def _unfinished(items, i, later):
    """The error path of a list worked through after it was swapped for an
    empty one (a MemoryError part way): the first i items are done and
    leave it one by one (no heap), and what was listed meanwhile (later)
    follows the rest, each object once. Returns the list to keep."""
    for _ in range(i):
        items.pop(0)
    for x in later:
        for y in items:
            if y is x:
                break
        else:
            items.append(x)
    return items


def q_msg(ent):
    # the message of a queued entry; an entry list is a list, a message a tuple
    return ent[_Q_MSG] if type(ent) is list else ent


def _ram_store(cfg):
    import edgeram

    return edgeram.RamStore(cfg["max_retained_messages"])


class MonoClock:
    """Broker seconds: monotonic, never wrapping (ticks_ms wraps after
    ~12 days on a board), unaffected by NTP setting the wall clock. One is
    shared by the broker and its store."""

    def __init__(self):
        self._t = _ticks_ms()
        self._ms = 0

    def __call__(self):
        t = _ticks_ms()
        self._ms += _ticks_diff(t, self._t)
        self._t = t
        return self._ms / 1000


def open_store(cfg, data_dir=None, clock=None, wallclock=None, log=None):
    """The retained store cfg["storage_type"] asks for: 'ram' (or no
    data_dir) -> edgeram.RamStore; 'disc' / 'disc_only' -> edgestore.FlashStore
    at <data_dir>/retained.ebrs. Each module is imported only here (and by
    load_modules()), so a board carries the one its profile uses."""
    kind = cfg["storage_type"]
    if kind == "ram" or not data_dir:
        return _ram_store(cfg)
    if kind not in ("disc", "disc_only"):
        raise ValueError("storage_type must be ram, disc or disc_only")
    import edgestore

    return edgestore.FlashStore(
        data_dir + "/retained.ebrs",
        mode=kind,
        capacity=cfg["max_retained_messages"],
        clock=clock,
        wallclock=wallclock,
        compact_ratio=cfg["compact_ratio"],
        compact_min_bytes=cfg["compact_min_bytes"],
        log=log,
    )


# ---------------------------------------------------------- 7. client state
class Session:
    """What outlives a connection (4.1): subscriptions, outbound messages not
    yet acknowledged, the offline queue, inbound QoS 2 packet ids. A local
    subscription (Broker.subscribe) is a Session with a callback `cb` and no
    connection: routing treats it like any other subscriber.

    Heap: the class holds every default, so an instance stores only what
    differs (a MicroPython instance keeps its attributes in a hash table
    sized to their number), and the collections start as the shared empty
    tuple until the first item arrives (Engine.grow)."""

    conn = None
    cb = None  # local subscription: callback(topic, payload, retained, properties)
    subs = ()  # filter -> (options byte, subscription id)
    inflight = ()  # in-flight entries (_F_*), send order
    queue = ()  # queued entries (_Q_*), oldest first
    qbytes = 0  # bytes of the queued messages (max_queued_bytes)
    user = None  # the user name that made it: only that user resumes it
    rq = ()  # pending retained deliveries (_R_*)
    in2 = ()  # inbound QoS 2 pids awaiting PUBREL (MQTT-4.3.3-x)
    pid = 0  # last packet identifier used
    expiry = 0  # Session Expiry Interval, seconds
    gone = 0  # broker seconds when the last connection closed
    hw = False  # connected, its queue at high water: publishers wait (flow control)
    acl = None  # [(access bits, filter levels)] of the profile's acl for it
    hw_since = 0  # broker seconds when it got there (slow_consumer_timeout)

    def __init__(self, cid):
        self.cid = cid


class Conn:
    """One network connection as the engine sees it; `sess` is set once
    CONNECT is accepted. `io` belongs to the server that moves its bytes (a
    socket); the engine never touches it. `out` holds what to send; `closed`
    says the engine ended it (the server then sends what is left of `out`
    and releases `io`). Defaults live in the class (see Session)."""

    ver = 0
    sess = None
    pend = None  # bytearray: an incomplete packet
    need = 0  # bytes it still lacks, once its fixed header is in
    out = None  # bytearray waiting to be sent
    wait = None  # server state: poll flag or the async writer task
    task = None  # async server: the reader task
    ka = 0  # keep alive in seconds (0 = off)
    will = None  # (msg, retain, delay seconds)
    maxpkt = _NO_LIMIT_PACKET
    window = 0  # outbound inflight window
    aliases = None  # inbound Topic Alias -> topic name
    oamax = 0  # outbound topic aliases allowed (client's maximum, capped)
    oalias = None  # outbound: topic bytes -> alias
    problem = True  # Request Problem Information
    se_capped = False  # its non-zero Session Expiry was capped to 0
    defer = None  # acks waiting for a durable store commit
    resend = 0  # in-flight entries not yet resent since CONNECT: the last ones
    held = None  # bytearray: unparsed input held back by flow control
    tls = False  # TLS (the listener's tls_cert): the socket under its SSL socket
    linger = False  # ended by a protocol error: drained before the close
    paused = False  # server state: reading paused while held
    closed = False

    def __init__(self, io, now, peer):
        self.io = io
        self.peer = peer  # "address:port", for logs and $SYS
        self.last = now  # broker seconds of the last packet received (also: opened)
        # its slot made now: Engine.close() then needs no heap to set it (a
        # connection is often closed because the heap ran out)
        self.closed = False

    @property
    def cid(self):
        # the session's client id (logs, refusals): not a slot of its own.
        # MicroPython sizes an instance's attribute table 8, 10, 12, 17, ...
        # entries and fills it before it grows: an idle 3.1.1 connection on
        # the asyncio server (its reader task too) keeps 10 attributes, a
        # table of 10, where 11 took a table of 12 (docs/boards.md).
        s = self.sess
        return "" if s is None else s.cid

    def out_len(self):
        o = self.out
        return 0 if o is None else len(o)

    def fits(self, n, limit):
        # A delivery of about n bytes may go out now: the buffer is empty
        # (a packet larger than max_outbuf still leaves, alone) or keeps
        # within limit (max_outbuf) with it. So deliveries never hold more
        # than max(max_outbuf, one packet): Engine.write()'s bound.
        o = self.out
        return not o or len(o) + n <= limit


# ---------------------------------------------------------------- 8. engine
class Engine:
    """The broker's protocol core, sans I/O: it takes bytes from a
    connection and leaves what to send in `conn.out` (the connection listed
    in `dirty`), what to close in `ended`, and what waits for durability in
    `deferred`. It owns sessions, the topic tree, routing, the retained
    policy and every limit. It never touches a socket, a poller or a clock:
    the server passes the time in (broker seconds from a MonoClock).

    The server's side: open() a connection, receive() its bytes, lost() when
    the network ends it, sent() what left, and turn() once per loop turn
    (paced deliveries, local callbacks, the once-a-second housekeeping and
    the group commit, which releases the acks that waited for it)."""

    def __init__(self, cfg, store=None, log=None):
        self.cfg = cfg
        self.store = store if store is not None else _ram_store(cfg)
        # passwords and topic ACLs (edgeauth): loaded only for a profile
        # that uses them (load_modules() has imported it by then)
        self.auth = None
        if _auth_needed(cfg):
            import edgeauth

            self.auth = edgeauth
        self._loglevel = _LEVELS.get(cfg["log_level"], 20)
        self._logf = log
        self.conns = {}  # Conn -> None: every open connection
        self.pre = 0  # of them, connections that have not sent CONNECT yet
        self.sessions = {}
        self.tree = TopicTree()
        self.groups = {}  # $share/{name}/{filter} -> Group (bounded by the subscriptions)
        # options byte -> (options byte, 0): the one tuple every subscription
        # without a Subscription Identifier shares (sub_ent); at most 64, as
        # SUBSCRIBE refuses the reserved option bits 6-7 (3.8.3.1)
        self.ents = {}
        self.dirty = []  # connections with bytes waiting to be sent
        self.ended = []  # connections the engine closed: the server releases them
        self.busy = []  # sessions with deliveries that can go on now
        self.deferred = []  # connections with acks waiting for commit()
        self.localq = []  # [session, msg, retain]: local callbacks to run at turn()
        self.in_cb = False  # a local callback runs (run_local is not re-entered)
        # Durable sinks: objects with put(msg, retain, origin, topic) -> True if they
        # took it, a `durable` flag and commit() (raises OSError on failure).
        # A bridge's store-and-forward queue is one. commit() commits them
        # with the store, before the acknowledgements that waited leave.
        self.sinks = []
        self.sdirty = False  # the store changed since the last commit()
        # CPython with a durable sink: a _Syncer that fsyncs the sinks beside
        # the loop (set by edgebridge.attach), and the acks its job waits for
        self.syncer = None
        self.gen = None  # [(conn, acks)] released when the syncer's job is done
        self._puts = 0  # new retained topics and QoS 1/2 PUBLISHes, to pace the heap checks
        self._low = False  # free heap below heap_reserve at the last look (on_publish)
        self.wills = []  # [deadline, session, msg, retain] delayed wills
        self.connected = 0
        self.started = 0
        self.n_in = 0
        self.n_out = 0
        self.n_dropped = 0
        self.app_errors = 0
        self._heap = None  # (when, free, allocated): the last $SYS heap figures
        self._keep = None  # a session being taken over: bound_offline spares it
        self.refusals = {}
        self.rlog = {}  # cause -> int second of its last log line (refuse)
        self._next_id = 0
        self._last_tick = 0
        self._last_sys = 0
        self.now_s = 0
        c = cfg
        self.max_packet = c["max_packet_size"]
        self.max_outbuf = c["max_outbuf"]
        self.max_inflight = c["max_inflight"]
        self.max_queued = c["max_queued"]
        # Flow control (docs/design.md): while a connected subscriber's queue
        # is at high water, a PUBLISH whose topic reaches it waits unparsed
        # (holds()) until every such queue is back to low water, so that
        # PUBACKs slow down instead of acknowledged messages being dropped.
        self.hw = max(1, self.max_queued // 2)
        self.lw = self.hw // 2
        # max_queued_total: the messages all session queues hold together
        # (0: no broker-wide bound, max_queued alone). Flow control starts
        # at half of it too, so a connected subscriber that reads is not
        # the one whose messages the bound drops.
        self.qmax = c["max_queued_total"] or 0x3FFFFFFF  # a small int on 32 bits
        self.qtotal = 0  # messages in all session queues
        self.congested = 0  # sessions at high water
        self.held = []  # connections whose input waits (Conn.held)
        self.unheld = []  # the server resumes reading these
        self.nohold = False  # lost(): a closed connection's input is not held
        self.xsweep = -1.0  # when _retain last swept a full store
        self.max_user = c["max_user_properties"]
        # Connections that have not sent CONNECT yet hold a socket and a
        # buffer but no client slot: bounded to half of max_clients (at
        # least 2), the oldest dropped first when a new one arrives.
        self.max_pre = max(2, c["max_clients"] // 2)
        # A CONNECT is small: its client id, will and credentials. Bytes
        # before CONNECT is accepted are bounded far below max_packet_size.
        self.max_pre_bytes = min(
            self.max_packet, 1024 + c["max_topic_length"] + c["max_payload_size"]
        )

    def start(self, now):
        """The engine starts serving at broker second `now`."""
        self.now_s = now
        self.started = now
        self._last_tick = now
        self._last_sys = now - self.cfg["sys_interval"]

    def log(self, level, fmt, *args):
        if _LEVELS[level] < self._loglevel:
            return
        text = fmt % args if args else fmt
        if self._logf is not None:
            self._logf(level, text)
        else:
            print("edgebroker: %s %s" % (level, text), file=sys.stderr)

    def refuse(self, cause, fmt="", *args):
        """Counts a refusal by cause (L5); logs the first of each cause, then
        at most one a minute with the count so far: a client retrying in a
        loop costs a board's serial console one line a minute, not one per
        attempt, and a second episode months later is still seen."""
        n = self.refusals.get(cause, 0)
        if n == 0 and len(self.refusals) >= 64:
            cause = "other"
            n = self.refusals.get(cause, 0)
        self.refusals[cause] = n + 1
        t = int(self.now_s)  # a small int: no float to box on a board
        last = self.rlog.get(cause)
        if last is None or t - last >= 60:
            self.rlog[cause] = t
            text = fmt % args if args else fmt
            if n:
                text = "%s (%d refused so far)" % (text, n + 1)
            self.log("warning", "refused (%s) %s" % (cause, text))

    # ------------------------------------------------------------ writing
    def outbuf(self, conn):
        """The connection's send buffer; a connection with bytes waiting is
        listed once in `dirty`, flushed at the end of the loop turn."""
        o = conn.out
        if o is None:
            o = conn.out = bytearray()
            self.dirty.append(conn)
        elif not o:
            self.dirty.append(conn)
        return o

    def write(self, conn, data):
        if conn.closed:
            return
        o = self.outbuf(conn)
        # what one send buffer may ever hold: a delivery goes out only into
        # an empty buffer or one it leaves within max_outbuf (fits()), so
        # deliveries hold at most max(max_outbuf, one packet); acks and ping
        # responses have max_outbuf more (the memory model counts exactly
        # this: tools' profiles.py). Checked here, not when the socket takes
        # bytes: the socket of a client that sends and never reads never
        # becomes writable. (The bound is computed here, not kept: one more
        # Engine attribute grew its attribute table, 96 B of heap on a
        # 32-bit board, measured.)
        m = self.max_outbuf
        if len(o) + len(data) > (m if m > self.max_packet else self.max_packet) + m:
            self.refuse("slow_reader", "client %s not reading, closed", conn.cid)
            self.close(conn, True)
            return
        o.extend(data)

    def send_ack(self, conn, data):
        # PUBACK/PUBREC leave in the order the PUBLISHes came (4.6); once one
        # waits for a durable commit, the ones after it wait too.
        if conn.defer is not None:
            conn.defer.append(data)
        else:
            self.write(conn, data)

    def disconnect(self, conn, code, text=None):
        """Ends a connection for a protocol reason: 5.0 DISCONNECT with the
        reason code (MQTT-4.13.1-1), 3.1.1 just closes."""
        if conn.closed:
            return
        if conn.sess is not None:
            self.log(
                "info",
                "client %s disconnected by the broker: %s (0x%02x)",
                conn.cid,
                text or "-",
                code or 0,
            )
        if conn.ver == 5 and code is not None:
            p = reason(conn, text, 2)
            if conn.sess is None:
                # a refused CONNECT is answered by CONNACK (MQTT-3.2.2-7)
                body = bytes((0, code)) + vbi(len(p)) + p
                self.write(conn, packet(_CONNACK, 0, body))
            else:
                body = bytes((code,)) + vbi(len(p)) + p
                self.write(conn, packet(_DISCONNECT, 0, body))
        self.close(conn, True)

    # ------------------------------------------------------------ reading
    def feed(self, conn, data, n):
        """Parses every complete packet in data[:n] (a memoryview) and keeps
        the incomplete tail. Oversize is refused from the fixed header, before
        the body is read (MQTT-3.1.2-24 reverse direction: 0x95). A packet
        whose header is known is collected in one buffer that grows by what
        arrives: never copied again per read, so a large packet costs linear
        time however it is split."""
        if conn.held is not None:
            conn.held += data[:n]  # behind what waits (held_room: read while it has room)
            self.held_acks(conn)
            return
        pend = conn.pend
        if pend is not None:
            need = conn.need
            if need:
                # the packet's buffer was allocated whole: fill what is missing
                size = len(pend)
                take = need if need < n else n
                pend[size - need : size - need + take] = data[:take]
                need -= take
                conn.need = need
                if need:
                    return
                conn.pend = None
                j = 1
                while pend[j] & 0x80:
                    j += 1
                if (
                    self.congested
                    and pend[0] >> 4 == 3
                    and not self.nohold
                    and self.holds(conn, pend, j + 1, size)
                ):
                    pend += data[take:n]
                    self.hold(conn, pend)
                    return
                self.handle(conn, pend[0], pend, j + 1, size)
                if conn.closed or take == n:
                    return
                data = data[take:n]
                n -= take
            else:  # at most 4 bytes of a fixed header
                data = memoryview(pend + bytes(data[:n]))
                n = len(data)
                conn.pend = None
        i = 0
        while i < n and not conn.closed:
            # fixed header: type/flags byte + remaining length (1-4 bytes)
            rl = 0
            shift = 0
            j = i + 1
            ok = False
            while j < n:
                d = data[j]
                j += 1
                rl |= (d & 0x7F) << shift
                if not d & 0x80:
                    ok = True
                    break
                shift += 7
                if shift > 21:
                    raise MqttError(_RC_MALFORMED, "remaining length over 4 bytes")
            if not ok:
                conn.pend = bytearray(data[i:n])
                return
            size = j - i + rl
            if size > self.max_packet:
                raise MqttError(_RC_TOO_LARGE, "packet larger than Maximum Packet Size")
            if conn.sess is None and size > self.max_pre_bytes:
                # A CONNECT is small: bounded before the body is read. A 5.0
                # client is told with CONNACK 0x95 (its level byte is at
                # offset 6 of the variable header).
                if n > j + 6 and data[i] == 0x10 and data[j + 6] == 5:
                    conn.ver = 5
                raise MqttError(_RC_TOO_LARGE, "CONNECT larger than the broker accepts")
            if j + rl > n:
                # one buffer for the whole packet, filled as bytes arrive
                pend = conn.pend = bytearray(size)
                pend[0 : n - i] = data[i:n]
                conn.need = size - (n - i)
                return
            if (
                self.congested
                and data[i] >> 4 == 3
                and not self.nohold
                and self.holds(conn, data, j, j + rl)
            ):
                self.hold(conn, bytearray(data[i:n]))
                return
            self.handle(conn, data[i], data, j, j + rl)
            i = j + rl

    def holds(self, conn, b, i, end):
        # A PUBLISH waits (and what its connection sent after it but its
        # acknowledgements: held_acks) when its topic reaches a connected
        # subscriber at high water, unless it comes from one of those
        # subscribers (a client that reads only once its PUBACK came would
        # wait for itself) or before CONNECT. Only while some queue is at
        # high water; a topic given by an alias alone waits whatever it is.
        sess = conn.sess
        if sess is None or sess.hw:
            return False
        if end - i < 2:
            return False  # malformed: handle() says so
        tl = b[i] << 8 | b[i + 1]
        if not tl:
            return True
        if i + 2 + tl > end:
            return False
        try:
            topic = str(bytes(b[i + 2 : i + 2 + tl]), "utf-8")
        except UnicodeError:
            return False
        for subs in self.tree.match(topic.split("/"), topic[:1] == "$"):
            for s in subs:
                if type(s) is Group:
                    for m in s.members:
                        if m.hw:
                            return True
                elif s.hw:
                    return True
        return False

    def hold(self, conn, rest):
        conn.held = rest
        self.held.append(conn)
        self.held_acks(conn)

    def held_acks(self, conn):
        # A held connection's acknowledgements of what it was sent (PUBACK,
        # PUBREC, PUBCOMP) and its PINGREQs are taken at once: they drain
        # its own queue. Held with its PUBLISH, a subscriber that publishes
        # to a topic it reads would wait for itself and the others for it
        # until slow_consumer_timeout ended them (acknowledged messages
        # lost). What else it sent stays in order behind that PUBLISH.
        h = conn.held
        i = 0
        while i + 1 < len(h):
            try:
                rl, j = read_vbi(h, i + 1, len(h))
            except MqttError:
                return  # still coming, or malformed: said when the input is resumed
            end = j + rl
            if end > len(h):
                return
            if h[i] >> 4 in (_PUBACK, _PUBREC, _PUBCOMP, _PINGREQ):
                self.handle(conn, h[i], h, j, end)
                if conn.closed or conn.held is not h:
                    return
                h[i:end] = b""  # (MicroPython's bytearray has no del of a slice)
            else:
                i = end

    def held_room(self, conn):
        # a held connection is read on while its input holds less than the
        # held PUBLISH and io_chunk more (so its acknowledgements come in);
        # then its reading pauses until the flow resumes
        h = conn.held
        rl, j = read_vbi(h, 1, len(h))  # the held PUBLISH's: whole (feed())
        return len(h) < j + rl + self.cfg["io_chunk"]

    def mark(self, sess):
        if not sess.hw:
            sess.hw = True
            sess.hw_since = self.now_s
            self.congested += 1

    def unmark(self, sess):
        if sess.hw:
            sess.hw = False
            self.congested -= 1

    def resume_held(self):
        # oldest first; one that is held again goes to the back
        held = self.held
        while held and not self.congested:
            conn = held.pop(0)
            data = conn.held
            conn.held = None
            if conn.closed or data is None:
                continue
            self.receive(conn, memoryview(data), len(data), self.now_s)
            if conn.held is None:
                self.unheld.append(conn)

    def handle(self, conn, first, b, i, end):
        ptype = first >> 4
        flags = first & 0x0F
        conn.last = self.now_s
        if conn.sess is None:
            if ptype != _CONNECT:
                # MQTT-3.1.0-1: the first packet must be CONNECT
                raise MqttError(_RC_PROTOCOL, "first packet is not CONNECT")
            return self.on_connect(conn, flags, b, i, end)
        if ptype == _PUBLISH:
            return self.on_publish(conn, flags, b, i, end)
        if ptype in (_PUBACK, _PUBREC, _PUBREL, _PUBCOMP):
            need = 2 if ptype == _PUBREL else 0
            if flags != need:  # MQTT-3.6.1-1 and 2.1.3 reserved flags
                raise MqttError(_RC_MALFORMED, "reserved flags")
            return self.on_ack(conn, ptype, b, i, end)
        if ptype == _SUBSCRIBE:
            if flags != 2:  # MQTT-3.8.1-1
                raise MqttError(_RC_MALFORMED, "SUBSCRIBE flags not 0010")
            return self.on_subscribe(conn, b, i, end)
        if ptype == _UNSUBSCRIBE:
            if flags != 2:  # MQTT-3.10.1-1
                raise MqttError(_RC_MALFORMED, "UNSUBSCRIBE flags not 0010")
            return self.on_unsubscribe(conn, b, i, end)
        if ptype == _PINGREQ:
            if flags or end != i:
                raise MqttError(_RC_MALFORMED, "bad PINGREQ")
            self.write(conn, b"\xd0\x00")
            return
        if ptype == _DISCONNECT:
            if flags:
                raise MqttError(_RC_MALFORMED, "reserved flags")
            return self.on_disconnect(conn, b, i, end)
        if ptype == _CONNECT:
            raise MqttError(_RC_PROTOCOL, "second CONNECT")  # MQTT-3.1.0-2
        if ptype == _AUTH and conn.ver == 5:
            # No Authentication Method was accepted in CONNECT, so any AUTH
            # is a Protocol Error (4.12): enhanced auth is not supported.
            raise MqttError(_RC_PROTOCOL, "AUTH not supported")
        if ptype == 0:
            raise MqttError(_RC_MALFORMED, "reserved packet type 0")
        raise MqttError(_RC_PROTOCOL, "packet type %d not sent by clients" % ptype)

    # ------------------------------------------------------------ CONNECT
    def on_connect(self, conn, flags, b, i, end):
        if flags:
            raise MqttError(_RC_MALFORMED, "CONNECT reserved flags")
        name, i = read_bin(b, i, end)
        _need(i, 4, end)
        level = b[i]
        cflags = b[i + 1]
        ka = b[i + 2] << 8 | b[i + 3]
        i += 4
        if name != b"MQTT" or level not in (4, 5):
            # MQTT-3.1.2-2: unacceptable protocol level -> return code 1
            if name in (b"MQTT", b"MQIsdp"):
                self.write(conn, b"\x20\x02\x00\x01")
            self.refuse("protocol_version", "level %d", level)
            self.close(conn, False)
            return
        conn.ver = level
        if cflags & 1:  # MQTT-3.1.2-3 reserved flag
            raise MqttError(_RC_MALFORMED, "CONNECT reserved flag set")
        clean = cflags & 2
        will_flag = cflags & 4
        will_qos = cflags >> 3 & 3
        will_retain = cflags & 0x20
        has_pw = cflags & 0x40
        has_user = cflags & 0x80
        if will_qos == 3 or (not will_flag and (will_qos or will_retain)):
            raise MqttError(_RC_MALFORMED, "bad will flags")  # MQTT-3.1.2-11..15
        if level == 4 and has_pw and not has_user:
            raise MqttError(_RC_MALFORMED, "password without user name")  # 3.1.1 MQTT-3.1.2-22
        props = {}
        if level == 5:
            props, _, i = read_props(b, i, end, self.max_user, _K_CONNECT)
        cid, i = read_str(b, i, end)
        will = None
        if will_flag:
            wprops = {}
            wfwd = b""
            if level == 5:
                wprops, wfwd, i = read_props(b, i, end, self.max_user, _K_WILL)
            wtopic, i = read_str(b, i, end)
            wpayload, i = read_bin(b, i, end)
            # A will is checked here exactly like a PUBLISH (MQTT-3.1.3-11
            # and 3.3.2): a topic name within max_topic_length and
            # max_topic_levels, never $SYS (refused below, once the
            # protocol version is known).
            if (
                not valid_topic_name(wtopic)
                or len(wtopic.encode()) > self.cfg["max_topic_length"]
                or wtopic.count("/") >= self.cfg["max_topic_levels"]
            ):
                raise MqttError(_RC_BAD_TOPIC, "invalid will topic")
            rt = wprops.get(_P_RESPONSE_TOPIC)
            if rt is not None and not valid_topic_name(rt):
                raise MqttError(_RC_PROTOCOL, "wildcard in will Response Topic")
            exp = wprops.get(_P_MESSAGE_EXPIRY, 0)
            will = (
                wtopic,
                wpayload,
                will_qos,
                wfwd,
                exp,
                bool(will_retain),
                wprops.get(_P_WILL_DELAY, 0),
            )
        user = None
        pw = None
        if has_user:
            user, i = read_str(b, i, end)
        if has_pw:
            pw, i = read_bin(b, i, end)
        if i != end:
            raise MqttError(_RC_MALFORMED, "bytes after CONNECT payload")
        v5 = level == 5
        if v5:
            rm = props.get(_P_RECEIVE_MAX, 65535)
            mp = props.get(_P_MAX_PACKET, _NO_LIMIT_PACKET)
            if rm == 0 or mp == 0:
                raise MqttError(_RC_PROTOCOL, "zero Receive Maximum or Maximum Packet Size")
            if mp != _NO_LIMIT_PACKET:
                conn.maxpkt = mp
            conn.window = min(rm, self.max_inflight)
            conn.oamax = min(props.get(_P_ALIAS_MAX, 0), self.cfg["topic_alias_maximum"])
            if props.get(_P_REQ_PROBLEM, 1) > 1 or props.get(_P_REQ_RESPONSE, 0) > 1:
                raise MqttError(_RC_PROTOCOL, "request flag not 0 or 1")  # 3.1.2.11.6-7
            if _P_AUTH_DATA in props and _P_AUTH_METHOD not in props:
                raise MqttError(_RC_PROTOCOL, "Authentication Data without a Method")  # 3.1.2.11.10
            if props.get(_P_REQ_PROBLEM, 1) != 1:
                conn.problem = False
        else:
            conn.window = self.max_inflight
        cfg = self.cfg
        # -- refusals, in the order a client can act on them
        if v5 and _P_AUTH_METHOD in props:
            return self.connack_refuse(
                conn,
                _RC_BAD_AUTH_METHOD,
                _RC3_BAD_AUTH,
                "auth",
                "enhanced authentication not supported",
            )
        assigned = None
        if not cid:
            if not clean and not v5:
                # 3.1.1 MQTT-3.1.3-8: empty id needs CleanSession=1
                return self.connack_refuse(
                    conn,
                    _RC_BAD_CLIENT_ID,
                    _RC3_BAD_ID,
                    "client_id",
                    "empty client id without clean session",
                )
            cid = assigned = self.new_client_id()
        elif len(cid) > 256:
            return self.connack_refuse(
                conn, _RC_BAD_CLIENT_ID, _RC3_BAD_ID, "client_id", "client id too long"
            )
        if not self.authenticate(user, pw):
            return self.connack_refuse(
                conn, _RC_BAD_AUTH, _RC3_BAD_AUTH, "auth", "bad user name or password"
            )
        old = self.sessions.get(cid)
        if old is not None and old.user != user and not clean:
            # A session belongs to the user who made it: another user's
            # resume (Clean Start 0) is refused, the session untouched. With
            # Clean Start 1 nothing is resumed: the connection takes over
            # (MQTT-3.1.4-3; 3.1.1 MQTT-3.1.4-2) and the session is discarded,
            # or whoever took a client id first would lock its owner out.
            return self.connack_refuse(
                conn,
                _RC_BAD_CLIENT_ID,
                _RC3_BAD_ID,
                "client_id_owner",
                "client id belongs to another user",
            )
        takeover = old is not None and old.conn is not None
        mk = cfg["max_keepalive"]
        if mk and not v5 and (ka == 0 or ka > mk):
            # 3.1.1 cannot be told another keep alive (nor server_keep_alive,
            # 3.2.2.3.14 is 5.0's): refused (as mosquitto)
            return self.connack_refuse(
                conn, _RC_QUOTA, _RC3_BAD_ID, "max_keepalive", "keep alive over max_keepalive"
            )
        if self.connected >= cfg["max_clients"] and not takeover:
            return self.connack_refuse(
                conn, _RC_QUOTA, _RC3_UNAVAILABLE, "max_clients", "max_clients reached"
            )
        if (
            _mem_free is not None
            and not (old is not None and (takeover or old.queue or old.inflight))
            and _mem_free() < cfg["heap_reserve"]
        ):
            # A CONNECT that gives heap back is let through below the reserve:
            # a takeover closes the connection it replaces, and a session
            # holding messages frees them by its drain (resume) or its end
            # (Clean Start). Refused, such a session would keep that heap until
            # it expired, and every new client would be refused till then.
            gc.collect()
            if _mem_free() < cfg["heap_reserve"]:
                return self.connack_refuse(
                    conn,
                    _RC_QUOTA,
                    _RC3_UNAVAILABLE,
                    "heap_reserve",
                    "free heap below heap_reserve",
                )
        if will is not None and will[5] and not cfg["retain_available"]:
            # MQTT-3.2.2-13: will retain without retain support -> 0x9A
            return self.connack_refuse(
                conn,
                _RC_RETAIN_UNSUPPORTED,
                _RC3_UNAVAILABLE,
                "retain_unavailable",
                "will retain not supported",
            )
        if will is not None and will[0][:4] == "$SYS":
            return self.connack_refuse(
                conn, _RC_NOT_AUTHORIZED, _RC3_NOT_AUTHORIZED, "sys_publish", "will topic in $SYS"
            )
        acl = self.acl_for(cid, user)
        if will is not None and acl is not None and not self.auth.may(acl, will[0], 2):
            # the will is checked at CONNECT like a PUBLISH would be
            return self.connack_refuse(
                conn, _RC_NOT_AUTHORIZED, _RC3_NOT_AUTHORIZED, "acl", "will topic not allowed"
            )
        if will is not None and will[2] > cfg["maximum_qos"]:
            return self.connack_refuse(
                conn, _RC_QOS_UNSUPPORTED, _RC3_UNAVAILABLE, "qos", "will QoS above Maximum QoS"
            )
        # -- accepted: take over, then find or make the session
        if takeover:
            # MQTT-3.1.4-3: the existing connection is closed, 5.0 with 0x8E;
            # the session it leaves is the one resumed (MQTT-3.1.2-5), so
            # max_sessions must not discard it in between
            self._keep = old
            self.disconnect(old.conn, _RC_TAKEN_OVER, "session taken over")
            self._keep = None
            old = self.sessions.get(cid)
        if v5:
            sexp = props.get(_P_SESSION_EXPIRY, 0)
        else:
            sexp = 0 if clean else 0xFFFFFFFF
        capped = sexp > cfg["max_session_expiry"]
        if capped:
            sexp = cfg["max_session_expiry"]
            if not sexp:
                conn.se_capped = True  # set only here: no slot on other connections
        present = False
        if old is not None and clean:
            self.end_session(old)
            old = None
        if old is not None:
            sess = old
            present = True
            self.cancel_will(sess)
        else:
            sess = self.new_session(cid)
            if user is not None:
                sess.user = user
        sess.expiry = sexp
        sess.acl = acl
        sess.conn = conn
        sess.gone = self.now_s  # its slot made now: close() then sets it without heap
        conn.sess = sess
        self.pre -= 1
        self.connected += 1
        tell = False
        if v5 and cfg["server_keep_alive"]:
            ka = cfg["server_keep_alive"]  # MQTT-3.2.2-21: the client uses ours
            tell = True
        elif v5 and mk and (ka == 0 or ka > mk):
            # max_keepalive: a longer keep alive (or none) becomes ours, and
            # the client is told with Server Keep Alive (3.2.2.3.14)
            ka = mk
            tell = True
        conn.ka = ka
        if will is not None:
            # its Message Expiry Interval counts from its publication
            # (3.1.3.2.4): kept relative here, made absolute by pub_will()
            wt, wp, wq, wf, we, wr, wd = will
            conn.will = ((wt.encode(), wp, wq, wf, we, 1 if we else 0), wr, wd)
        # -- CONNACK (3.2)
        if v5:
            p = bytearray()
            if capped:
                p += prop_u32(_P_SESSION_EXPIRY, sexp)
            # only what differs from the spec's default for an absent
            # property (3.2.2.3): a small CONNACK fits a client's small
            # Maximum Packet Size (MQTT-3.1.2-24). Wildcard, Subscription
            # Identifier and Shared Subscriptions are always available (1).
            if self.max_inflight < 65535:
                p += prop_u16(_P_RECEIVE_MAX, self.max_inflight)
            if cfg["maximum_qos"] < 2:
                p += prop_byte(_P_MAX_QOS, cfg["maximum_qos"])
            if not cfg["retain_available"]:
                p += prop_byte(_P_RETAIN_AVAILABLE, 0)
            p += prop_u32(_P_MAX_PACKET, self.max_packet)
            if assigned is not None:
                p += prop_str(_P_ASSIGNED_ID, assigned)
            if cfg["topic_alias_maximum"]:
                p += prop_u16(_P_ALIAS_MAX, cfg["topic_alias_maximum"])
            if tell:
                p += prop_u16(_P_SERVER_KEEPALIVE, ka)
            self.write(conn, packet(_CONNACK, 0, bytes((1 if present else 0, 0)) + vbi(len(p)) + p))
        else:
            self.write(conn, bytes((0x20, 2, 1 if present else 0, 0)))
        self.log(
            "info",
            "client %s connected from %s (MQTT %s, user %s, clean %d, keep alive %d)%s",
            cid,
            conn.peer,
            "5.0" if v5 else "3.1.1",
            user or "-",
            1 if clean else 0,
            ka,
            ", session present" if present else "",
        )
        # MQTT-4.4.0-1: resend unacknowledged PUBLISH (DUP=1) and PUBREL, in
        # their order, paced by max_outbuf like any delivery and by the new
        # connection's Receive Maximum (resend())
        if sess.inflight:
            conn.resend = len(sess.inflight)
        self.pump(sess)

    def resend(self, sess, conn):
        """Resends the in-flight entries a reconnected client has not had
        again yet (the last conn.resend of sess.inflight) while its buffer
        and its window allow; True once none is left. Nothing new goes out
        before them (4.6). An entry that can no longer be sent (expired while the client
        was away, MQTT-3.3.2-5, or larger than its new Maximum Packet Size,
        MQTT-3.1.2-25) is released: it must not hold the window for good."""
        inflight = sess.inflight
        k = len(inflight) - conn.resend
        while conn.resend:
            if k >= conn.window:
                # the k before it are out again, unacknowledged: this
                # connection's Receive Maximum holds resends too (MQTT-3.3.4-9)
                break
            ent = inflight[k]
            m = ent[_F_MSG]
            if not conn.fits(4 if m is None else msg_size(m), self.max_outbuf):
                break
            # counted as resent once it is written (a MemoryError leaves it
            # to resend, not in flight unsent until the next connection)
            if m is None:  # PUBREL sent before
                self.write(conn, bytes((0x62, 2)) + u16(ent[_F_PID]))
            else:
                qr = ent[_F_QR]
                if not self.encode_publish(
                    conn, m, qr >> 1, qr & 1, ent[_F_PID], ent[_F_SIDS], True
                ):
                    conn.resend -= 1
                    inflight.pop(k)
                    continue
            conn.resend -= 1
            k += 1
        return not conn.resend

    def connack_refuse(self, conn, rc5, rc3, cause, text):
        self.refuse(cause, text)
        if conn.ver == 5:
            body = bytes((0, rc5))
            p = reason(conn, text, 2)
            self.write(conn, packet(_CONNACK, 0, body + vbi(len(p)) + p))
        else:
            self.write(conn, bytes((0x20, 2, 0, rc3)))
        self.close(conn, False)

    def authenticate(self, user, pw):
        users = self.cfg["users"]
        if user is None:
            return bool(self.cfg["allow_anonymous"])
        want = users.get(user)
        if want is None:
            # a user name the profile does not know is only accepted when
            # anonymous access is allowed and no users are configured; else
            # its refusal takes a known user's hashing time, so that the
            # delay of the answer does not tell which names exist
            if users:
                self.auth.check_password(next(iter(users.values())), pw or b"")
                return False
            return bool(self.cfg["allow_anonymous"])
        if pw is None:
            return False
        return self.auth.check_password(want, pw)

    def new_client_id(self):
        # random like mosquitto's auto-<uuid>: an assigned id that can be
        # guessed lets another client take over that session (MQTT-3.1.4-3)
        self._next_id += 1
        return "edgebroker-%d-%016x" % (self._next_id, int.from_bytes(_new_key(), "big"))

    def new_session(self, cid):
        s = Session(cid)
        self.sessions[cid] = s
        return s

    def bound_offline(self):
        """max_sessions bounds the sessions kept without a connection: past
        it, the one disconnected longest is discarded (documented policy)."""
        offline = 0
        oldest = None
        keep = self._keep
        for s in self.sessions.values():
            # a session being taken over is not offline: its new connection
            # is here (counted, it made another session's end, acknowledged
            # messages queued for it included, when max_sessions was not hit)
            if s.conn is None and s is not keep:
                offline += 1
                if oldest is None or s.gone < oldest.gone:
                    oldest = s
        if offline > self.cfg["max_sessions"] and oldest is not None:
            self.refuse("max_sessions", "session %s discarded", oldest.cid)
            self.end_session(oldest)

    def end_session(self, sess):
        """The session ends (4.1): subscriptions and queues go; a will still
        waiting for its delay is published now (3.1.2.5)."""
        # only what the session holds is reset: setting a default it never
        # changed would grow its attribute table (heap is often short here)
        if sess.subs:
            for f in sess.subs:
                self.unsub(sess, f)
            sess.subs = ()
        self.unmark(sess)
        if sess.queue:
            self.qtotal -= len(sess.queue)
            sess.queue = ()
            sess.qbytes = 0
        if sess.inflight:
            sess.inflight = ()
        self.drop_rq(sess)
        if self.sessions.get(sess.cid) is sess:
            del self.sessions[sess.cid]
        for w in self.wills:
            if w[_W_SESS] is sess:
                self.wills.remove(w)
                self.pub_will(w[_W_MSG], w[_W_RETAIN])
                break

    def pub_will(self, msg, retain):
        # a will's Message Expiry starts now (3.1.3.2.4): msg[4] holds the
        # interval until then (on_connect)
        if msg[5]:
            msg = (msg[0], msg[1], msg[2], msg[3], self.now_s + msg[4], 1)
        self.publish(msg, retain, None)

    def cancel_will(self, sess):
        for w in self.wills:
            if w[_W_SESS] is sess:
                self.wills.remove(w)
                return

    # ------------------------------------------------------------ PUBLISH
    def make_msg(self, topic, payload, qos, fwd, exp_interval):
        exp = self.now_s + exp_interval if exp_interval else 0
        return (topic.encode(), payload, qos, fwd, exp, 1 if exp_interval else 0)

    def on_publish(self, conn, flags, b, i, end):
        qos = flags >> 1 & 3
        dup = flags & 8
        retain = flags & 1
        if qos == 3:
            raise MqttError(_RC_MALFORMED, "QoS 3")  # MQTT-3.3.1-4
        if qos == 0 and dup:
            raise MqttError(_RC_MALFORMED, "DUP set on QoS 0")  # MQTT-3.3.1-2
        # the topic and packet id read in line (read_bin, read_u16): this
        # runs for every message
        j = i + 2 + (b[i] << 8 | b[i + 1]) if end - i >= 2 else end + 1
        if qos:
            j += 2
        if j > end:
            raise MqttError(_RC_MALFORMED, "packet shorter than its fields")
        tb = bytes(b[i + 2 : j - 2] if qos else b[i + 2 : j])
        topic = check_utf8(tb)
        pid = 0
        if qos:
            pid = b[j - 2] << 8 | b[j - 1]
            if pid == 0:
                raise MqttError(_RC_PROTOCOL, "packet identifier 0")  # MQTT-2.2.1-3
        i = j
        fwd = b""
        exp = 0
        if conn.ver == 5:
            props, fwd, i = read_props(b, i, end, self.max_user, _K_PUBLISH)
            if props:
                if _P_SUB_ID in props:
                    raise MqttError(_RC_PROTOCOL, "Subscription Identifier from a client")
                alias = props.get(_P_ALIAS)
                if alias is not None:
                    topic = self.resolve_alias(conn, alias, topic)
                    tb = None
                exp = props.get(_P_MESSAGE_EXPIRY, 0)
                rt = props.get(_P_RESPONSE_TOPIC)
                if rt is not None and not valid_topic_name(rt):
                    raise MqttError(_RC_PROTOCOL, "wildcard in Response Topic")
        if not topic:
            # 3.3.2.1: a zero-length topic without a Topic Alias
            raise MqttError(_RC_PROTOCOL, "empty topic name without Topic Alias")
        if "+" in topic or "#" in topic:
            raise MqttError(_RC_BAD_TOPIC, "invalid topic name")  # MQTT-3.3.2-2
        cfg = self.cfg
        if (
            len(tb if tb is not None else topic.encode()) > cfg["max_topic_length"]
            or topic.count("/") >= cfg["max_topic_levels"]
        ):
            raise MqttError(_RC_BAD_TOPIC, "topic over max_topic_length or max_topic_levels")
        if qos > cfg["maximum_qos"]:
            raise MqttError(_RC_QOS_UNSUPPORTED, "QoS above Maximum QoS")  # MQTT-3.2.2-11
        if retain and not cfg["retain_available"]:
            raise MqttError(_RC_RETAIN_UNSUPPORTED, "retain not available")  # MQTT-3.2.2-14
        payload = bytes(b[i:end])
        self.n_in += 1
        sess = conn.sess
        if topic[:4] == "$SYS" or (sess.acl is not None and not self.auth.may(sess.acl, topic, 2)):
            # $SYS belongs to the broker, and the acl may deny a topic: 5.0
            # refuses with 0x87, which ends a QoS 2 exchange at PUBREC
            # (4.3.3); 3.1.1 is acknowledged and dropped (as mosquitto)
            why = "sys_publish" if topic[:4] == "$SYS" else "acl"
            self.refuse(why, "client %s published to %s", conn.cid, topic)
            if qos:
                body = u16(pid) + (b"\x87" if conn.ver == 5 else b"")
                self.send_ack(conn, bytes((0x40 if qos == 1 else 0x50, len(body))) + body)
            return
        again = False
        if qos == 2:
            in2 = sess.in2
            if type(in2) is tuple:
                in2 = sess.in2 = {}
            if pid in in2:
                if in2[pid] == 1:
                    # MQTT-4.3.3-10: a resent PUBLISH (DUP) before PUBREL is
                    # not delivered again; answer with PUBREC once more
                    self.send_ack(conn, bytes((0x50, 2)) + u16(pid))
                    return
                # its PUBREC never left: the commit failed (store_failed), so
                # it is stored and queued again below, not routed again
                again = True
        if qos and _mem_free is not None:
            # Below heap_reserve a QoS 1/2 message is refused, not taken:
            # queued for sessions that are away, it would eat the heap their
            # return needs to drain them. 5.0: 0x97 Quota exceeded (a QoS 2
            # exchange ends at that PUBREC, 4.3.3); 3.1.1 has no refusal, so
            # the connection closes (MQTT-3.3.5-2) and the client sends the
            # message again when it is back. The heap is looked at every
            # 16th time (gc.mem_free scans the heap's allocation table; the
            # count is shared with the retained check), and every time while
            # it is low, so that publishing resumes at once. (In line, and
            # no new names: a qstr pool that grows costs kilobytes.)
            self._puts += 1
            if self._low or self._puts & 15 == 0:
                r = cfg["heap_reserve"]
                low = _mem_free() < r
                if low:
                    gc.collect()
                    low = _mem_free() < r
                self._low = low
            if self._low:
                self.refuse("publish_heap", "free heap below heap_reserve")
                if conn.ver == 5:
                    if again:
                        del in2[pid]  # a PUBREC of 0x80 or more ends the exchange
                    self.send_ack(conn, bytes((0x40 if qos == 1 else 0x50, 3)) + u16(pid) + b"\x97")
                else:
                    self.close(conn, True)
                return
        if qos == 2:
            if not again and len(in2) >= self.max_inflight:
                raise MqttError(_RC_RECV_MAX, "Receive Maximum exceeded")  # MQTT-3.3.4-9
            in2[pid] = 1
        msg = (
            tb if tb is not None else topic.encode(),
            payload,
            qos,
            fwd,
            self.now_s + exp if exp else 0,
            1 if exp else 0,
        )
        wait = self.publish(msg, retain, sess, topic, again)
        if qos:
            ack = bytes((0x40 if qos == 1 else 0x50, 2, pid >> 8, pid & 0xFF))
            if wait and conn.defer is None:
                conn.defer = []
                self.deferred.append(conn)
            self.send_ack(conn, ack)

    def resolve_alias(self, conn, alias, topic):
        # 3.3.2.3.4: alias 0 or above our Topic Alias Maximum is an error
        if alias == 0 or alias > self.cfg["topic_alias_maximum"]:
            raise MqttError(_RC_ALIAS_INVALID, "Topic Alias invalid")
        al = conn.aliases
        if topic:
            if al is None:
                al = conn.aliases = {}
            al[alias] = topic
            return topic
        t = None if al is None else al.get(alias)
        if t is None:
            raise MqttError(_RC_PROTOCOL, "unknown Topic Alias")
        return t

    def publish(self, msg, retain, origin, topic=None, keep_only=False):
        """Stores (if retained) and routes one message. `topic` is the str
        of its topic bytes when the caller has it (a PUBLISH, a local
        publish); a will or a $SYS message has it decoded here. Returns True
        when an acknowledgement must wait for the store's commit
        (durability). keep_only: stored and given to the sinks, not routed
        (a QoS 2 resend after a failed commit: routed the first time)."""
        if topic is None:
            topic = msg[_M_TB].decode()
        wait = False
        if retain:
            wait = self.retain(msg, topic)
        if self.sinks:
            # durable sinks (a bridge's flash queue) take the message before
            # any acknowledgement of it leaves: the ack waits for commit()
            for k in self.sinks:
                if k.put(msg, retain, origin, topic) and k.durable:
                    wait = True
                    self.sdirty = True
        if keep_only or not self.tree.root:
            return wait  # no subscription at all: nothing to route
        levels = topic.split("/")
        matched = None
        shared = None
        for subs in self.tree.match(levels, topic[:1] == "$"):
            for sess in subs:
                if type(sess) is Group:
                    if shared is None:
                        shared = []
                    shared.append(sess)
                    continue
                opts, sid = subs[sess]
                if opts & 4 and sess is origin:  # No Local (MQTT-3.8.3-3)
                    continue
                if matched is None:
                    matched = {}
                cur = matched.get(sess)
                if cur is None:
                    matched[sess] = [opts & 3, opts & 8, [sid] if sid else None]
                else:
                    if opts & 3 > cur[_MR_QOS]:
                        cur[_MR_QOS] = opts & 3
                    cur[_MR_RAP] |= opts & 8
                    if sid:
                        if cur[_MR_SIDS] is None:
                            cur[_MR_SIDS] = [sid]
                        else:
                            cur[_MR_SIDS].append(sid)
        if matched is not None:
            # MQTT-3.3.4-2: one copy per session at the highest granted QoS,
            # carrying every matching Subscription Identifier (MQTT-3.3.4-3)
            for sess in matched:
                if sess.acl is not None and not self.auth.may(sess.acl, topic, 1):
                    continue  # an allowed subscription never carries a denied topic
                q, rap, sids = matched[sess]
                # 3.1.1 MQTT-3.3.1-9 / 5.0 MQTT-3.3.1-12/13: RETAIN is kept
                # on forwarding only with Retain As Publish
                self.deliver(sess, msg, q, 1 if (retain and rap) else 0, sids)
        if shared is not None:
            # 4.8.2: each shared subscription's group gives the message to
            # one member, with that member's options (a separate copy from
            # its non-shared subscriptions, as mosquitto does)
            for g in shared:
                sess = g.pick()
                if sess is not None and (sess.acl is None or self.auth.may(sess.acl, topic, 1)):
                    opts, sid = g.members[sess]
                    rr = 1 if (retain and opts & 8) else 0
                    self.deliver(sess, msg, opts & 3, rr, [sid] if sid else None)
        return wait

    def acl_for(self, cid, user):
        """The profile's acl expanded for one client (edgeauth.acl_for), or
        None when there is no acl."""
        rules = self.cfg["acl"]
        if not rules:
            return None
        return self.auth.acl_for(rules, cid, user)

    def unsub(self, sess, filt):
        # a subscription leaves the tree (a shared one leaves its group)
        if filt[:7] == "$share/":
            g = self.groups.get(filt)
            if g is not None:
                g.remove(sess)
                if not g.members:
                    self.tree.remove(share_inner(filt), g)
                    del self.groups[filt]
        else:
            self.tree.remove(filt, sess)

    def retain(self, msg, topic):
        wait = self._retain(msg, topic)
        if wait:
            self.sdirty = True
        return wait

    def unstore(self, topic):
        """Drops a topic's retained message; True if a durable store changed
        (then the acknowledgement waits for the commit)."""
        return self.store.delete(topic) and self.store.durable

    def full(self, old, size):
        """L2/L4: does storing size bytes for a topic whose stored message
        is old (None: a new topic) go over max_retained_messages or
        store_budget_bytes?"""
        st = self.store
        budget = self.cfg["store_budget_bytes"]
        if old is not None:
            return budget and st.nbytes - msg_size(old) + size > budget
        cap = self.cfg["max_retained_messages"]
        return (cap and st.count >= cap) or (budget and st.nbytes + size > budget)

    def sweep_full(self):
        """The store is full for a change: expired messages keep their
        places until the tick's sweep (64 entries a second) reaches them, so
        they are swept from the whole store first, at most once a second (a
        store full of live messages costs a pass a second, not one per
        PUBLISH). The count removed; -1 when the sweep's write failed."""
        now = self.now_s
        if now - self.xsweep < 1:
            return 0
        self.xsweep = now
        st = self.store
        n = 0
        try:
            # expire() resumes where it stopped and ends at the store's end
            n = st.expire(now, st.count + 1)
            n += st.expire(now, st.count + 1)
        except OSError as err:
            self.store_failed(err)
            return -1
        if n and st.durable:
            self.sdirty = True
        return n

    def _retain(self, msg, topic):
        """Rules S1-S4 and L2-L4 of docs: store, replace or delete."""
        if topic[:4] == "$SYS":
            return False  # made on demand by sys_msgs(), never stored
        store = self.store
        payload = msg[_M_PAYLOAD]
        if not payload:
            # S3 (MQTT-3.3.1-6/7): empty payload deletes, is never stored
            return self.unstore(topic)
        cfg = self.cfg
        if len(payload) > cfg["max_payload_size"]:
            # L3: forwarded but not stored, and the older value goes too
            self.refuse("retained_too_large", "%s (%d bytes)", topic, len(payload))
            return self.unstore(topic)
        old = store.get(topic)
        size = msg_size(msg)
        if self.full(old, size):
            n = self.sweep_full()
            if n < 0 and old is None:
                return False
            if n > 0:
                old = store.get(topic)  # it may have been one of the expired
            if n < 0 or self.full(old, size):
                # L2/L4: a new topic is forwarded but not stored; a replacement
                # over the budget is not either, and the older value goes
                self.refuse("retained_full", "%s not stored", topic)
                return False if old is None else self.unstore(topic)
        if msg[_M_EXP] == 0 and cfg["expiry_interval"]:
            # E3: the board's default lifetime for messages without their own
            m = msg
            msg = (
                m[_M_TB],
                m[_M_PAYLOAD],
                m[_M_QOS],
                m[_M_PROPS],
                self.now_s + cfg["expiry_interval"],
                0,
            )
        if old is None and _mem_free is not None:
            # The heap reserve is for connections. gc.mem_free() walks the
            # whole allocation table (about 1 ms on a 16 MB heap), so it is
            # asked every 16th new topic; the MemoryError catch below is the
            # backstop in between.
            self._puts += 1
            if self._puts & 15 == 0 and _mem_free() < cfg["heap_reserve"]:
                gc.collect()
                if _mem_free() < cfg["heap_reserve"]:
                    self.refuse(
                        "retained_heap", "%s not stored: free heap below heap_reserve", topic
                    )
                    self._puts -= 1  # ask again at the next new topic
                    return False
        try:
            store.put(topic, msg)
        except MemoryError:
            gc.collect()
            self.refuse("retained_heap", "%s not stored: MemoryError", topic)
            return self.unstore(topic)
        return store.durable

    # ------------------------------------------------------------ delivery
    def deliver(self, sess, msg, qos, retain, sids):
        if msg[_M_QOS] < qos:
            qos = msg[_M_QOS]
        conn = sess.conn
        if sess.cb is not None:
            # a local subscription: called at the end of this turn, from the
            # loop. From max_queued waiting on, it is at high water like a
            # session queue: PUBLISHes that reach it wait unread until the
            # turn's run_local() (flow control: acknowledged messages are not
            # dropped for a subscriber that keeps reading, and a callback
            # always does). Past 4 x max_queued (a callback's own burst:
            # nothing holds it) the oldest is dropped, counted
            lq = self.localq
            if len(lq) >= self.max_queued * 4:
                lq.pop(0)
                self.n_dropped += 1
                self.refuse("local_queue_full", "local subscriber %s", sess.cid)
            lq.append((sess, msg, retain))
            if len(lq) >= self.max_queued:
                self.mark(sess)
            return
        if conn is None:
            if qos:
                self.enqueue(sess, q_entry(msg, qos, retain, sids))
            return
        # Conn.fits(), in line: the buffer is empty or keeps within
        # max_outbuf with this message
        o = conn.out
        wait = (
            o
            and len(o) + len(msg[_M_TB]) + len(msg[_M_PAYLOAD]) + len(msg[_M_PROPS])
            > self.max_outbuf
        )
        if qos == 0:
            if wait:
                # a slow reader loses QoS 0 messages, counted; others unaffected
                self.n_dropped += 1
                self.refuse("slow_reader", "client %s", conn.cid)
                return
            self.encode_publish(conn, msg, 0, retain, 0, sids, False)
            return
        if sess.queue or len(sess.inflight) >= conn.window or wait or conn.resend:
            self.enqueue(sess, q_entry(msg, qos, retain, sids))
            if len(sess.queue) >= self.hw or self.qtotal >= self.qmax >> 1:
                self.mark(sess)
            return
        self.send_inflight(sess, conn, msg, qos, retain, sids)

    def enqueue(self, sess, ent):
        q = sess.queue
        size = msg_size(q_msg(ent))
        cap = self.cfg["max_queued_bytes"]
        while True:
            # documented policy: the oldest queued message is dropped
            v = None
            if q and (len(q) >= self.max_queued or sess.qbytes + size > cap):
                v = sess
            elif self.qtotal >= self.qmax:
                # max_queued_total: from the longest offline queue, else the
                # longest queue (flow control keeps a reading subscriber's
                # queue from getting here). An offline queue ranks 2**20
                # higher: above any max_queued, a small int on 32 bits.
                best = 0
                for s in self.sessions.values():
                    n = len(s.queue)
                    if n and s.conn is None:
                        n += 0x100000
                    if n > best:
                        best = n
                        v = s
            if v is None:
                break
            v.qbytes -= msg_size(q_msg(v.queue.pop(0)))
            self.qtotal -= 1
            self.n_dropped += 1
            self.refuse("queue_full", "session %s", v.cid)
        if type(q) is tuple:
            q = sess.queue = []
        q.append(ent)
        sess.qbytes += size
        self.qtotal += 1

    def send_inflight(self, sess, conn, msg, qos, retain, sids):
        """Sends a message and records it in flight, or (MemoryError) does
        neither: a packet the client could acknowledge with no entry for it
        would make a QoS 2 message arrive twice."""
        pid = self.next_pid(sess)
        o = conn.out
        start = len(o) if o else 0
        if not self.encode_publish(conn, msg, qos, retain, pid, sids, False):
            return  # too large for the client or expired: treated as done
        try:
            if type(sess.inflight) is tuple:
                sess.inflight = []
            sess.inflight.append([pid, msg, qos << 1 | retain, sids])
        except MemoryError:
            conn.out[start:] = b""
            raise

    def next_pid(self, sess):
        pid = sess.pid
        inflight = sess.inflight
        while True:
            pid = pid + 1 if pid < 65535 else 1
            for e in inflight:
                if e[_F_PID] == pid:
                    break
            else:
                sess.pid = pid
                return pid

    def encode_publish(self, conn, msg, qos, retain, pid, sids, dup):
        """Writes one PUBLISH straight into the connection's buffer. Returns
        False if it was not sent: expired (E1, MQTT-3.3.2-5) or larger than
        the client's Maximum Packet Size (MQTT-3.1.2-25, D8)."""
        if conn.closed:
            return False
        exp = msg[_M_EXP]
        tb = msg[_M_TB]
        payload = msg[_M_PAYLOAD]
        props = None
        newalias = 0
        if exp:
            left = exp - self.now_s
            if left <= 0:
                self.n_dropped += 1
                return False
        if conn.ver == 5:
            props = msg[_M_PROPS]
            if sids:
                for s in sids:
                    props = props + bytes((_P_SUB_ID,)) + vbi(s)
            if exp and msg[_M_OWNEXP]:
                # MQTT-3.3.2-6: the interval left after waiting here
                props = props + prop_u32(_P_MESSAGE_EXPIRY, int(left + 0.999))
            if conn.oamax and len(tb) > 3:
                # Topic aliases out (3.3.2.3.4): the first PUBLISH of a topic
                # maps it, later ones send an empty topic and the alias. At
                # most min(client's Topic Alias Maximum, topic_alias_maximum)
                # per connection (MQTT-3.3.2-9, -10), first come; no
                # eviction, so a mapping never changes under the client.
                oa = conn.oalias
                a = oa.get(tb) if oa is not None else None
                if a is not None:
                    tb = b""
                    props = props + prop_u16(_P_ALIAS, a)
                elif oa is None or len(oa) < conn.oamax:
                    # mapped below, once the packet is sure to be sent
                    newalias = (len(oa) + 1) if oa is not None else 1
                    props = props + prop_u16(_P_ALIAS, newalias)
            plen = len(props)
            rl = 2 + len(tb) + (2 if qos else 0) + len(vbi(plen)) + plen + len(payload)
        else:
            rl = 2 + len(tb) + (2 if qos else 0) + len(payload)
        if rl + 5 > conn.maxpkt and rl + len(vbi(rl)) + 1 > conn.maxpkt:
            self.refuse("client_max_packet", "client %s", conn.cid)
            return False
        o = self.outbuf(conn)
        start = len(o)
        try:
            # straight into the connection's buffer: no packet built on the side
            o.append(0x30 | (8 if dup else 0) | qos << 1 | retain)
            o.extend(vbi(rl))
            n = len(tb)
            o.append(n >> 8)
            o.append(n & 0xFF)
            o.extend(tb)
            if qos:
                o.append(pid >> 8)
                o.append(pid & 0xFF)
            if props is not None:
                o.extend(vbi(len(props)))
                o.extend(props)
            o.extend(payload)
            if newalias:
                if conn.oalias is None:
                    conn.oalias = {}
                conn.oalias[tb] = newalias
        except MemoryError:
            # all of the packet or none: half of one would corrupt the
            # stream, and the caller keeps the message (queued, in flight)
            o[start:] = b""
            raise
        self.n_out += 1
        return True

    def pump(self, sess):
        """Lets waiting messages out while the window and the buffer allow:
        the queue first (live traffic), then pending retained deliveries,
        which are read from the store's iterator one message at a time (D9)."""
        if sess.cb is not None:
            return self.pump_local(sess)
        conn = sess.conn
        if conn is None or conn.closed:
            return
        if conn.resend and not self.resend(sess, conn):
            return
        q = sess.queue
        if type(sess.inflight) is tuple and (q or sess.rq):
            sess.inflight = []  # grown here, so the name below stays the list
        inflight = sess.inflight
        limit = self.max_outbuf
        while q and len(inflight) < conn.window:
            ent = q[0]
            if type(ent) is list:
                msg, qos, retain, sids = ent
            else:
                msg, qos, retain, sids = ent, ent[_M_QOS], 0, None
            size = msg_size(msg)
            if not conn.fits(size, limit):
                break
            # sent first, then taken off the queue: a MemoryError in between
            # leaves it queued (an acknowledged message is never lost)
            self.send_inflight(sess, conn, msg, qos, retain, sids)
            q.pop(0)
            sess.qbytes -= size
            self.qtotal -= 1
        if sess.hw and len(q) <= self.lw and (self.qtotal < self.qmax >> 1 or not q):
            # at half of max_queued_total, only an empty queue releases
            # its publishers: the total then falls
            self.unmark(sess)
        rq = sess.rq
        while rq and not q:
            ent = rq[0]
            m = ent[_R_HELD]
            if m is None:
                try:
                    m = next(ent[_R_IT])
                except StopIteration:
                    rq.pop(0)[_R_IT].close()
                    continue
                if m[_M_EXP] and m[_M_EXP] <= self.now_s:
                    continue  # its lifetime has passed (E1)
                if sess.acl is not None and not self.auth.may(sess.acl, m[_M_TB].decode(), 1):
                    continue  # retained messages obey the read rules
                # held until it is written: a MemoryError below, or the
                # buffer or the window being full, keeps it for the next try
                ent[_R_HELD] = m
            if not conn.fits(msg_size(m), limit):
                # waits for the buffer to drain (sent() resumes it), held
                # like a message waiting for the window
                return
            qos = m[_M_QOS] if m[_M_QOS] < ent[_R_OPTS] & 3 else ent[_R_OPTS] & 3
            sids = [ent[_R_SID]] if ent[_R_SID] else None
            if qos:
                if len(inflight) >= conn.window:
                    # waits here for the window, outside the bounded queue,
                    # so live traffic can never push it out (D9)
                    return
                self.send_inflight(sess, conn, m, qos, 1, sids)
            else:
                self.encode_publish(conn, m, 0, 1, 0, sids, False)
            ent[_R_HELD] = None
        # with rq left, delivery resumes when flush() has drained the buffer

    def on_ack(self, conn, ptype, b, i, end):
        pid, i = read_u16(b, i, end)
        if pid == 0:
            raise MqttError(_RC_PROTOCOL, "packet identifier 0")  # MQTT-2.2.1-3
        rc = b[i] if i < end else 0
        sess = conn.sess
        if ptype == _PUBREL:
            # MQTT-4.3.3-11: release the packet id, answer PUBCOMP
            in2 = sess.in2
            if pid in in2:
                del in2[pid]
                self.write(conn, bytes((0x70, 2)) + u16(pid))
            elif conn.ver == 5:
                self.write(conn, bytes((0x70, 3)) + u16(pid) + bytes((_RC_PID_NOT_FOUND,)))
            else:
                self.write(conn, bytes((0x70, 2)) + u16(pid))
            return
        inflight = sess.inflight
        for k in range(len(inflight)):
            e = inflight[k]
            if e[_F_PID] == pid:
                break
        else:
            if ptype == _PUBREC:
                self.write(
                    conn,
                    bytes((0x62, 3 if conn.ver == 5 else 2))
                    + u16(pid)
                    + (bytes((_RC_PID_NOT_FOUND,)) if conn.ver == 5 else b""),
                )
            return
        if conn.resend and k >= len(inflight) - conn.resend:
            # acknowledged before its resend (it arrived before the client
            # reconnected): out of the entries still to resend, in their place
            first = len(inflight) - conn.resend
            conn.resend -= 1
            if k != first:
                inflight.insert(first, inflight.pop(k))
                k = first
        if ptype == _PUBACK:
            if e[_F_QR] >> 1 != 1:
                raise MqttError(_RC_PROTOCOL, "PUBACK for a QoS 2 message")
            inflight.pop(k)
        elif ptype == _PUBREC:
            if e[_F_QR] >> 1 != 2:
                raise MqttError(_RC_PROTOCOL, "PUBREC for a QoS 1 message")
            if rc >= 0x80:
                inflight.pop(k)  # 4.3.3: an error PUBREC ends the exchange
            else:
                # PUBREL follows: the message itself is no longer needed, and
                # no message is what marks the entry as released (_F_MSG)
                e[_F_MSG] = None
                self.write(conn, bytes((0x62, 2)) + u16(pid))
                return
        else:  # PUBCOMP
            if e[_F_MSG] is not None:
                raise MqttError(_RC_PROTOCOL, "PUBCOMP before PUBREL")
            inflight.pop(k)
        self.pump(sess)

    # ---------------------------------------------------------- SUBSCRIBE
    def on_subscribe(self, conn, b, i, end):
        pid, i = read_u16(b, i, end)
        if pid == 0:
            raise MqttError(_RC_PROTOCOL, "packet identifier 0")
        v5 = conn.ver == 5
        sid = 0
        if v5:
            props, _, i = read_props(b, i, end, self.max_user, _K_SUBSCRIBE)
            sid = props.get(_P_SUB_ID, 0)
            if _P_SUB_ID in props and sid == 0:
                raise MqttError(_RC_PROTOCOL, "Subscription Identifier 0")
        if i >= end:
            raise MqttError(_RC_PROTOCOL, "SUBSCRIBE with no filters")  # MQTT-3.8.3-3
        sess = conn.sess
        cfg = self.cfg
        codes = bytearray()
        todo = []
        why = None
        while i < end:
            filt, i = read_str(b, i, end)
            _need(i, 1, end)
            opts = b[i]
            i += 1
            if v5:
                if opts & 0xC0:
                    raise MqttError(_RC_MALFORMED, "reserved subscription option bits")
                if opts >> 4 & 3 == 3:
                    raise MqttError(_RC_PROTOCOL, "Retain Handling 3")
            elif opts & 0xFC:
                # 3.1.1 MQTT-3.8.3-4
                raise MqttError(_RC_MALFORMED, "reserved subscription option bits")
            if opts & 3 == 3:
                # 5.0 3.8.3.1: Maximum QoS 3 is a Protocol Error
                raise MqttError(_RC_PROTOCOL if v5 else _RC_MALFORMED, "QoS 3 in SUBSCRIBE")
            inner = filt
            if filt[:7] == "$share/":
                # MQTT-4.8.2-1/-2: a ShareName of at least one character
                # without "/", "+" or "#", then "/" and a Topic Filter
                j = filt.find("/", 7)
                name = filt[7:j] if j > 7 else ""
                inner = filt[j + 1 :] if j > 7 else ""
                if not name or "+" in name or "#" in name or not inner:
                    codes.append(_RC_BAD_FILTER if v5 else 0x80)
                    why = "invalid shared subscription"
                    continue
                if v5 and opts & 4:
                    # MQTT-3.8.3-4
                    raise MqttError(_RC_PROTOCOL, "No Local on a shared subscription")
            if (
                not valid_filter(inner)
                or len(filt.encode()) > cfg["max_topic_length"]
                or inner.count("/") >= cfg["max_topic_levels"]
            ):
                codes.append(_RC_BAD_FILTER if v5 else 0x80)
                why = "invalid topic filter"
                continue
            if sess.acl is not None and not self.auth.may(sess.acl, inner, 1):
                # the filter itself must be readable (its levels, wildcards
                # included, matched by a read rule; a deny rule wins)
                self.refuse("acl", "client %s subscribe %s", conn.cid, filt)
                codes.append(_RC_NOT_AUTHORIZED if v5 else 0x80)
                why = "not authorized"
                continue
            if type(sess.subs) is tuple:
                sess.subs = {}
            existed = filt in sess.subs
            if not existed and len(sess.subs) >= cfg["max_subscriptions"]:
                self.refuse("max_subscriptions", "client %s", conn.cid)
                codes.append(_RC_QUOTA if v5 else 0x80)
                why = "max_subscriptions reached"
                continue
            granted = opts & 3
            if granted > cfg["maximum_qos"]:
                granted = cfg["maximum_qos"]
            opts = opts & 0xFC | granted
            # MQTT-3.8.4-3: a repeated filter replaces the subscription.
            # One tuple, kept by the session and by the tree (or the group).
            ent = self.sub_ent(opts, sid)
            sess.subs[filt] = ent
            codes.append(granted)
            if inner is not filt:
                g = self.groups.get(filt)
                if g is None:
                    g = self.groups[filt] = Group()
                    self.tree.add(inner, g, (0, 0))  # not read: publish() asks the group
                g.add(sess, ent)
                continue  # no retained messages for a shared subscription (4.8.2)
            self.tree.add(filt, sess, ent)
            rh = opts >> 4 & 3
            if cfg["retain_available"] and (rh == 0 or (rh == 1 and not existed)):
                todo.append((filt, opts, sid))
        p = b""
        if v5:
            p = reason(conn, why, 2 + len(codes))
            p = vbi(len(p)) + p
        self.write(conn, packet(_SUBACK, 0, u16(pid) + p + codes))
        for filt, opts, sid in todo:
            # D1, D4, D5: matching retained messages follow the SUBACK, paced
            flevels = filt.split("/")
            if flevels[0] == "$SYS":
                it = self.sys_iter(flevels)
            else:
                it = self.store.match(flevels)
            # a repeated filter restarts its delivery (D5): no duplicates
            self.drop_rq(sess, filt)
            if type(sess.rq) is tuple:
                sess.rq = []
            sess.rq.append([it, opts, sid, filt, None])
        if todo:
            self.pump(sess)

    def sub_ent(self, opts, sid):
        """A subscription's (options byte, sub id) tuple, as Session.subs,
        the tree and a Group keep it: with no Subscription Identifier, the
        shared one for its options byte (no tuple per subscription)."""
        if sid:
            return (opts, sid)
        ent = self.ents.get(opts)
        if ent is None:
            ent = self.ents[opts] = (opts, 0)
        return ent

    def drop_rq(self, sess, filt=None):
        """Ends pending retained deliveries: all of them, or one filter's."""
        if not sess.rq:
            return
        keep = []
        for ent in sess.rq:
            if filt is None or ent[_R_FILT] == filt:
                ent[_R_IT].close()
            else:
                keep.append(ent)
        sess.rq = keep

    def sys_iter(self, flevels):
        for m in self.sys_msgs():
            if topic_matches(flevels, m[_M_TB].decode()):
                yield m

    def on_unsubscribe(self, conn, b, i, end):
        pid, i = read_u16(b, i, end)
        if pid == 0:
            raise MqttError(_RC_PROTOCOL, "packet identifier 0")
        v5 = conn.ver == 5
        if v5:
            _, _, i = read_props(b, i, end, self.max_user, _K_UNSUBSCRIBE)
        if i >= end:
            raise MqttError(_RC_PROTOCOL, "UNSUBSCRIBE with no filters")  # MQTT-3.10.3-2
        sess = conn.sess
        codes = bytearray()
        while i < end:
            filt, i = read_str(b, i, end)
            if filt in sess.subs:
                del sess.subs[filt]
                self.unsub(sess, filt)
                # MQTT-3.10.4-2: no new messages for it, retained included
                self.drop_rq(sess, filt)
                codes.append(_RC_SUCCESS)
            else:
                codes.append(_RC_NO_SUBSCRIPTION)
        if v5:
            self.write(conn, packet(_UNSUBACK, 0, u16(pid) + b"\x00" + codes))
        else:
            self.write(conn, bytes((0xB0, 2)) + u16(pid))

    # --------------------------------------------------------- DISCONNECT
    def on_disconnect(self, conn, b, i, end):
        rc = 0
        if conn.ver == 5 and i < end:
            rc = b[i]
            i += 1
            if i < end:
                props, _, i = read_props(b, i, end, self.max_user, _K_DISCONNECT)
                se = props.get(_P_SESSION_EXPIRY)
                if se is not None:
                    if conn.sess.expiry == 0 and se and not conn.se_capped:
                        # MQTT-3.14.2-2 (the CONNECT's own value was 0, not
                        # a non-zero one that max_session_expiry 0 capped)
                        raise MqttError(_RC_PROTOCOL, "Session Expiry set after 0")
                    conn.sess.expiry = min(se, self.cfg["max_session_expiry"])
        # MQTT-3.14.4-3: only 0x00 (normal) discards the will; 0x04 and the
        # error codes publish it (MQTT-3.1.2-8)
        self.log("info", "client %s disconnected (reason 0x%02x)", conn.cid, rc)
        self.close(conn, rc != 0)

    # -------------------------------------------------------------- close
    def close(self, conn, will):
        """Ends a connection: the session part here, the socket by the
        server (the connection goes to `ended`; what is left in conn.out is
        sent first, best effort: a final CONNACK or DISCONNECT)."""
        if conn.closed:
            return
        # Heap may be short here (a MemoryError is a common reason to close).
        # So first the steps that need none (they set only attributes that
        # exist: closed since Conn(), gone since CONNECT): the connection is
        # closed and its session offline. Then the server is told (`ended`;
        # if even that fails, the reader task (async) or the socket's next
        # event (poll) releases it). Then what may allocate: ending the
        # session or bounding the offline ones (else the expiry sweep and
        # the next close do it), and the will.
        conn.closed = True
        if self.conns.pop(conn, 0) is None and conn.sess is None:
            self.pre -= 1
        if conn.pend is not None:
            conn.pend = None
        if conn.held is not None:
            # its waiting input goes with it (lost() took it first if the
            # network closed it), not kept until the congestion ends (no
            # allocation: a Conn compares by identity)
            conn.held = None
            if conn in self.held:
                self.held.remove(conn)
        sess = conn.sess
        w = None
        if sess is not None and sess.conn is conn:
            self.connected -= 1
            sess.conn = None
            self.unmark(sess)  # offline: the queue's drop-oldest bound applies
            # a persistent session keeps its pending retained deliveries: they
            # go on when it reconnects (D1, D9); end_session() drops them
            sess.gone = self.now_s
            w = conn.will
            if w is not None:
                conn.will = None
        else:
            sess = None
        self.ended.append(conn)
        if sess is None:
            return
        if sess.expiry == 0:
            self.end_session(sess)
        else:
            self.bound_offline()
        if will and w is not None:
            msg, retain, delay = w
            if delay and sess.expiry and self.sessions.get(sess.cid) is sess:
                # 5.0 3.1.3.2.2: published after the Will Delay Interval or
                # when the session ends, whichever comes first
                self.wills.append([self.now_s + min(delay, sess.expiry), sess, msg, retain])
            else:
                self.pub_will(msg, retain)

    # ------------------------------------------------- the server's side
    def open(self, io, now, peer=""):
        """A new network connection. Connections without CONNECT are bounded
        (max_pre): at the bound the oldest of them is dropped for this one."""
        self.now_s = now
        if self.pre >= self.max_pre:
            oldest = None
            for c in self.conns:
                if c.sess is None and (oldest is None or c.last < oldest.last):
                    oldest = c
            if oldest is not None:
                self.refuse(
                    "pre_connect", "no CONNECT from %s, dropped for a new connection", oldest.peer
                )
                self.close(oldest, False)
        conn = Conn(io, now, peer)
        self.conns[conn] = None
        self.pre += 1
        return conn

    def receive(self, conn, data, n, now):
        """Bytes data[:n] (a memoryview) arrived on a connection. A protocol
        error ends that connection with its reason code; nothing a client
        sends can stop the engine or harm another client."""
        self.now_s = now
        try:
            self.feed(conn, data, n)
        except MqttError as err:
            self.protocol_error(conn, err)
        except MemoryError:
            gc.collect()
            try:
                # 5.0: with a reason, 0x97 Quota exceeded (the heap), rather
                # than a bare close the client cannot tell from a network fault
                self.disconnect(conn, _RC_QUOTA, "out of heap")
            except MemoryError:
                self.close(conn, True)
            self.refuse("memory", "MemoryError serving %s", conn.cid)
        except Exception as err:  # a bug must not stop the broker
            self.log("error", "internal error with %s: %r", conn.cid, err)
            _print_exc(err)
            self.close(conn, True)

    def lost(self, conn, now):
        """The network closed the connection (EOF, reset): an abnormal
        close, so the will is published (MQTT-3.1.2-8)."""
        self.now_s = now
        if conn.closed:
            return
        h = conn.held
        if h is not None:
            # Its input waited behind a subscriber at high water (flow
            # control paces the publishers). Gone, it has nothing left to
            # pace: what it sent is taken now, its PUBLISH routed and a
            # DISCONNECT after it honoured (no will: MQTT-3.1.2-10), rather
            # than all of it dropped with the will as if it had vanished
            conn.held = None
            if conn in self.held:
                self.held.remove(conn)
            self.nohold = True
            try:
                self.receive(conn, memoryview(h), len(h), now)
            finally:
                self.nohold = False
            if conn.closed:
                return
        if conn.pend is not None:
            self.log(
                "info",
                "client %s closed mid-packet (%d bytes)",
                conn.cid or conn.peer,
                len(conn.pend),
            )
        elif conn.sess is not None:
            self.log("info", "client %s disconnected: connection lost", conn.cid)
        self.close(conn, True)

    def sent(self, conn, n):
        """The server sent the first n bytes of conn.out. True when all of
        it has left (paced deliveries go on at the next turn)."""
        o = conn.out
        if o is None:
            return True
        if n >= len(o):
            conn.out = None
            sess = conn.sess
            # drained: paced delivery goes on, and so do messages queued while
            # the buffer was over max_outbuf (with nothing in flight, no
            # acknowledgement would come to move them)
            if sess is not None and (sess.rq or sess.queue or conn.resend):
                if sess not in self.busy:
                    self.busy.append(sess)
            return True
        if n:
            o[0:n] = b""
        return False

    def turn(self, now):
        """The end of a loop turn: housekeeping once a second, paced
        deliveries, local callbacks, then the group commit and the acks that
        waited for it. What to send is then in `dirty`, what to close in
        `ended`."""
        self.now_s = now
        if now - self._last_tick >= 1:
            self.tick()
        if self.busy:
            busy = self.busy
            self.busy = []
            i = 0
            try:
                for sess in busy:
                    self.pump(sess)
                    i += 1
            except MemoryError:
                # the one that ran out of heap and the rest wait for the
                # next turn, first
                self.busy = _unfinished(busy, i, self.busy)
                raise
        if self.localq:
            self.run_local()
        if self.held and not self.congested:
            self.resume_held()
        sy = self.syncer
        if sy is not None and sy.done:
            self.synced()
        if self.sdirty or self.deferred or (sy is not None and sy.fds and not sy.busy):
            self.commit()

    def idle(self):
        """True when nothing waits for the next turn but I/O or the tick."""
        return not (self.busy or self.localq)

    def commit(self, now=False):
        """The one durability path: the store commits what changed (one
        commit per loop turn at most, whatever the number of publishes), then
        the acknowledgements that waited for it leave, in order (4.6). A
        failed commit acknowledges nothing. False if it failed."""
        ok = True
        sy = self.syncer
        if now and sy is not None and sy.busy:
            # now (a local publish returns once durable): the job in flight
            # first, then this turn's writes are fsynced here, in the loop
            sy.wait()
            self.synced()
        if self.sdirty:
            self.sdirty = False
            try:
                self.store.commit()
                for k in self.sinks:
                    k.commit(None if now else sy)
            except (OSError, MemoryError) as err:
                self.store_failed(err)
                ok = False
        if now and sy is not None and sy.fds:
            err = sy.sync_pending()
            if err is not None:
                self.store_failed(err)
                ok = False
        if sy is not None and not now and (sy.busy or sy.fds):
            # Pipelined (CPython): the sinks are written; their fsync runs in
            # the syncer's thread while the loop goes on, and this turn's
            # acks leave when it is done (synced). With a job in flight they
            # wait for the next one, which covers what was written meanwhile.
            if not sy.busy:
                gen = []
                for conn in self.deferred:
                    if conn.defer:
                        gen.append((conn, conn.defer))
                        conn.defer = []  # later acks queue behind these (4.6)
                self.gen = gen
                sy.start()
            return ok
        if self.deferred:
            dl = self.deferred
            k = i = 0
            try:
                for conn in dl:
                    i = 0
                    for a in conn.defer:
                        self.write(conn, a)
                        i += 1
                    conn.defer = None
                    k += 1
            except MemoryError:
                # in order (4.6): the ack that ran out of heap and the ones
                # after it leave at the next turn
                _unfinished(dl[k].defer, i, ())
                _unfinished(dl, k, ())
                raise
            self.deferred = []
        return ok

    def synced(self):
        """The syncer's job is over: its acks leave, in order, or, if the
        fsync failed, are never sent (as store_failed: the clients that wait
        are disconnected and resend). Connections with nothing more waiting
        send their acks at once again."""
        err = self.syncer.collect()
        gen = self.gen or ()
        self.gen = None
        if err is not None:
            self.log("error", "bridge queue fsync failed: %r", err)
            self.refuse("store_io", "fsync failed")
        for conn, acks in gen:
            if err is None:
                for a in acks:
                    self.write(conn, a)
            elif not conn.closed:
                _undone(conn, acks)
                conn.defer = None
                self.disconnect(conn, _RC_UNSPECIFIED, "store write failed")
        keep = []
        for conn in self.deferred:
            if conn.defer and not conn.closed:
                keep.append(conn)
            else:
                conn.defer = None
        self.deferred = keep

    def shutdown(self):
        """Closes every connection and publishes the wills, ends retained
        deliveries, commits and closes the store. The server closes the
        connections without a DISCONNECT from the clients, so their wills
        go (MQTT-3.1.2-8), and every session ends with the broker, so a
        will still waiting for its delay goes too (3.1.3.2.2), as mosquitto
        does: a retained will and a bridge's queue then say offline."""
        for conn in list(self.conns):
            self.close(conn, True)
        try:
            for w in self.wills:
                self.pub_will(w[_W_MSG], w[_W_RETAIN])
            self.wills = []
            self.commit(True)
        except (OSError, MemoryError) as err:
            self.log("error", "wills at stop not kept: %r", err)
        if self.syncer is not None:
            self.syncer.stop()
        for sess in self.sessions.values():
            self.drop_rq(sess)  # leave no generator half-run at exit
        self.store.close()

    # ------------------------------------------------ the local client
    def local_publish(self, topic, payload, qos, retain, properties):
        """A publish from code beside the broker: the same checks, routing,
        retained rules and durability as a network PUBLISH. Bad arguments
        raise ValueError naming what is wrong."""
        if isinstance(payload, str):
            payload = payload.encode()
        elif isinstance(payload, (bytearray, memoryview)):
            payload = bytes(payload)
        elif not isinstance(payload, bytes):
            # bytes(5) would be five zero bytes, not a payload
            raise ValueError("payload: %r is not bytes or str" % (payload,))
        if not isinstance(topic, str) or not valid_topic_name(topic) or "\x00" in topic:
            # MQTT-4.7.3-1, MQTT-3.3.2-2, MQTT-1.5.4-2 (no U+0000)
            raise ValueError("topic: %r is not a valid topic name" % (topic,))
        cfg = self.cfg
        tb = topic.encode()
        if len(tb) > cfg["max_topic_length"] or topic.count("/") >= cfg["max_topic_levels"]:
            raise ValueError("topic: over max_topic_length or max_topic_levels")
        if topic[:4] == "$SYS":
            raise ValueError("topic: $SYS belongs to the broker")
        if qos not in (0, 1, 2):
            raise ValueError("qos: %r (allowed 0, 1, 2)" % (qos,))
        if retain and not cfg["retain_available"]:
            raise ValueError("retain: retain_available is false")
        fwd, exp = b"", 0
        if properties:
            fwd, exp = encode_props(properties)
        if len(payload) + len(tb) + len(fwd) > self.max_packet:
            raise ValueError("payload: with its topic and properties larger than max_packet_size")
        if qos > cfg["maximum_qos"]:
            qos = cfg["maximum_qos"]
        self.n_in += 1
        msg = (tb, payload, qos, fwd, self.now_s + exp if exp else 0, 1 if exp else 0)
        self.publish(msg, 1 if retain else 0, None, topic)
        if len(self.localq) >= self.max_queued and not self.in_cb:
            # your own code publishes faster than the loop turns: the local
            # callbacks run now, in publish(), rather than lose the oldest
            self.run_local()

    def local_subscribe(self, filt, callback, qos):
        if not isinstance(filt, str) or not valid_filter(filt) or filt[:7] == "$share/":
            raise ValueError("topic_filter: %r is not a valid topic filter" % (filt,))
        if qos not in (0, 1, 2):
            raise ValueError("qos: %r (allowed 0, 1, 2)" % (qos,))
        if not callable(callback):
            raise ValueError("callback: %r is not callable" % (callback,))
        self._next_id += 1
        sess = Session("$local-%d" % self._next_id)
        sess.cb = callback
        ent = self.sub_ent(qos, 0)
        sess.subs = {filt: ent}
        self.tree.add(filt, sess, ent)
        if self.cfg["retain_available"]:
            # like a new MQTT subscription with Retain Handling 0 (D1)
            flevels = filt.split("/")
            it = self.sys_iter(flevels) if flevels[0] == "$SYS" else self.store.match(flevels)
            sess.rq = [[it, qos, 0, filt, None]]
            self.busy.append(sess)
        return sess

    def local_unsubscribe(self, sess):
        if not isinstance(sess, Session) or sess.cid[:7] != "$local-":
            raise ValueError("handle: %r is not one subscribe() returned" % (sess,))
        for f in sess.subs:
            self.tree.remove(f, sess)
        sess.subs = ()
        self.drop_rq(sess)
        sess.cb = None

    def run_local(self):
        """Runs local callbacks queued by routing, from the event loop. A
        callback that raises is logged and counted ($SYS app errors); the
        others still get their messages."""
        q = self.localq
        self.localq = []
        i = 0
        try:
            for sess, msg, retain in q:
                self.call_local(sess, msg, retain)
                i += 1
        except MemoryError:
            # (before its callback: a callback's own errors are caught
            # there) it and the rest run at the next turn, first
            self.localq = _unfinished(q, i, self.localq)
            raise
        if self.congested:
            for ent in q:
                if ent[0].hw:
                    self.unmark(ent[0])  # taken: the publishers it held go on

    def call_local(self, sess, msg, retain):
        cb = sess.cb
        if cb is None:
            return
        if msg[_M_EXP] and msg[_M_EXP] <= self.now_s:
            return  # E1: its lifetime has passed
        props = decode_props(msg[_M_PROPS])
        if msg[_M_OWNEXP] and msg[_M_EXP]:
            props["message_expiry_interval"] = int(msg[_M_EXP] - self.now_s + 0.999)
        self.in_cb = True
        try:
            r = cb(msg[_M_TB].decode(), msg[_M_PAYLOAD], bool(retain), props)
            if r is not None and hasattr(r, "send"):
                # an async def: its coroutine would never run (nothing awaits
                # it). Said and counted, not silent
                r.close()
                raise TypeError("callback is async def: give a plain function")
        except Exception as err:
            self.app_errors += 1
            self.log("error", "local subscriber %s raised %r", sess.cid, err)
            _print_exc(err)
        finally:
            self.in_cb = False

    def pump_local(self, sess):
        # retained messages for a local subscription: 32 a turn, so a large
        # store never holds the loop (D9); busy until its iterators end
        rq = sess.rq
        n = 0
        while rq and n < 32:
            ent = rq[0]
            try:
                m = next(ent[_R_IT])
            except StopIteration:
                rq.pop(0)[_R_IT].close()
                continue
            self.call_local(sess, m, 1)
            n += 1
        if rq and sess not in self.busy:
            self.busy.append(sess)

    def store_failed(self, err):
        """A commit failed (flash full, I/O error): what it held is not
        durable, so its acknowledgements are never sent. The clients that
        wait for them are disconnected (5.0: 0x80) and resend on reconnect
        (MQTT-4.4.0-1); the broker goes on."""
        # the acks dropped first (nothing here may allocate before: a later
        # turn must not send them if what follows runs out of heap)
        dl = self.deferred
        for conn in dl:
            _undone(conn, conn.defer)
            conn.defer = None
        while dl:
            conn = dl.pop()
            try:
                self.disconnect(conn, _RC_UNSPECIFIED, "retained store write failed")
            except MemoryError:
                self.close(conn, True)  # (no heap for a DISCONNECT: closed all the same)
        self.log("error", "retained store commit failed: %r", err)
        self.refuse("store_io", "commit failed")

    def protocol_error(self, conn, err):
        conn.linger = True  # it is likely still writing: graceful close (Broker._linger)
        if conn.sess is None:  # else disconnect() says it, one line
            self.log("info", "client %s: %s (0x%02x)", conn.cid or conn.peer, err.text, err.code)
        self.refuse("protocol", "%s", err.text)
        self.disconnect(conn, err.code, err.text)

    def tick(self):
        """Once a second: keep alive, connect timeout, delayed wills, session
        and retained expiry, $SYS."""
        now = self.now_s
        self._last_tick = now
        ct = self.cfg["connect_timeout"]
        for conn in list(self.conns):
            if conn.sess is None:
                if now - conn.last > ct:
                    self.refuse("connect_timeout", "no CONNECT from %s in %d s", conn.peer, ct)
                    self.close(conn, False)
            elif conn.ka and conn.held is None and now - conn.last > conn.ka * 1.5:
                # (a held connection's packets wait unread: not its silence)
                # MQTT-3.1.2-22: 1.5 times the Keep Alive without a packet
                # (disconnect() logs it)
                self.disconnect(conn, _RC_KEEPALIVE, "keep alive timeout")
        if self.congested:
            self.slow_consumers(now)
        if self.wills:
            for w in list(self.wills):
                if w[_W_AT] <= now:
                    self.wills.remove(w)
                    self.pub_will(w[_W_MSG], w[_W_RETAIN])
        for sess in list(self.sessions.values()):
            if sess.conn is None and sess.expiry != 0xFFFFFFFF and now - sess.gone >= sess.expiry:
                self.end_session(sess)
            elif sess.conn is not None:
                if (sess.queue or sess.rq or sess.conn.resend) and sess not in self.busy:
                    # a connected client's waiting messages go on at least
                    # once a second, whatever kept it out of `busy` (an
                    # append that ran out of heap): no MemoryError stalls it
                    self.busy.append(sess)
            elif sess.queue:
                # MQTT-3.3.2-5: an offline session's expired messages are
                # deleted: from the head, and from anywhere in a full queue,
                # where they would hold places a live message would lose
                # (drop oldest); a queue with room is not walked every second
                q = sess.queue
                j = 0
                while j < len(q):
                    m = q_msg(q[j])
                    if m[_M_EXP] and m[_M_EXP] <= now:
                        q.pop(j)
                        sess.qbytes -= msg_size(m)
                        self.qtotal -= 1
                    elif len(q) < self.max_queued:
                        break
                    else:
                        j += 1
        try:
            if self.store.expire(now, 64) and self.store.durable:
                self.sdirty = True
        except OSError as err:
            # its commit of this turn's writes failed and undid them: their
            # acknowledgements must not leave with the turn's commit
            self.store_failed(err)
        si = self.cfg["sys_interval"]
        if si and now - self._last_sys >= si:
            self._last_sys = now
            self.publish_sys()

    def slow_consumers(self, now):
        # Flow control must not let one subscriber that stopped reading stall
        # every publisher: at high water for slow_consumer_timeout seconds,
        # it is disconnected (5.0: 0x97 Quota exceeded) and its session's
        # offline queue rules apply from then on.
        t = self.cfg["slow_consumer_timeout"]
        for sess in list(self.sessions.values()):
            if sess.hw and sess.conn is not None and now - sess.hw_since >= t:
                self.refuse("slow_consumer", "client %s", sess.cid)
                self.disconnect(sess.conn, _RC_QUOTA, "slow consumer")

    # ---------------------------------------------------------------- stats
    def publish_sys(self):
        # Live $SYS subscribers get fresh values every sys_interval; a new
        # one gets them at SUBSCRIBE, RETAIN=1 (sys_iter). They are made on
        # demand, so an idle broker holds no $SYS messages in its heap.
        if self.tree.root.get("$SYS") is None:
            if _mem_free is not None:
                gc.collect()  # a calm point all the same
            return
        for m in self.sys_msgs():
            self.publish(m, 1, None)

    def clients_list(self):
        """One line per connected client: "client id address user", at most
        2 KB (then "..." ends the list)."""
        out = []
        n = 0
        for c in self.conns:
            if c.sess is None:
                continue
            line = "%s %s %s" % (c.cid, c.peer, c.sess.user or "-")
            n += len(line) + 1
            if n > 2048:
                out.append("...")
                break
            out.append(line)
        return "\n".join(out)

    def sys_msgs(self):
        st = self.store
        vals = [
            ("version", VERSION),
            ("uptime", int(self.now_s - self.started)),
            ("clients/connected", self.connected),
            ("messages/received", self.n_in),
            ("messages/sent", self.n_out),
            ("messages/dropped", self.n_dropped),
            ("retained/count", st.count),
            ("retained/bytes", st.nbytes),
            ("app/errors", self.app_errors),
            ("clients/list", self.clients_list()),
        ]
        if st.degraded:
            # the flash store could not be written: served from RAM
            vals.append(("retained/degraded", st.degraded))
        for cause in self.refusals:
            vals.append(("refusals/" + cause, self.refusals[cause]))
        if _mem_free is not None:
            # A collection walks the whole heap: at most one per
            # sys_interval (and per 5 s), however many $SYS SUBSCRIBEs come
            h = self._heap
            if h is None or self.now_s - h[0] >= max(5, self.cfg["sys_interval"]):
                gc.collect()  # a calm point
                h = self._heap = (self.now_s, _mem_free(), _mem_alloc())
            vals.append(("heap/free", h[1]))
            vals.append(("heap/alloc", h[2]))
        for name, v in vals:
            yield self.make_msg("$SYS/broker/" + name, str(v).encode(), 0, b"", 0)


# ------------------------------------------------------------- 9. servers
class Broker:
    """A listening broker: an Engine plus the server that moves its bytes.
    Made by start(). Two servers drive the same engine:

      serve()              a blocking select.poll loop (the host build's
                           default: the fastest on CPython)
      await serve_async()  one asyncio task beside the user's own tasks (the
                           way it runs on a board); idle, it sleeps until a
                           socket is ready or the once-a-second tick is due

    Both run until stop(). publish(), subscribe() and unsubscribe() are the
    local client: code beside the broker, with no socket and no client slot.
    """

    def __init__(self, cfg, store=None, clock=None, log=None):
        self.cfg = cfg
        self.clock = clock if clock is not None else MonoClock()
        self._tturn = _ticks_ms()  # when the last turn began (_turn)
        self.engine = Engine(cfg, store, log)
        self.store = self.engine.store
        self.lsock = None
        self.poller = None
        self.socks = {}  # poll server: socket key -> Conn
        self.rmv = None  # the shared receive buffer, through a memoryview
        self.running = False
        self.failed = False  # the server stopped on a MemoryError it could not absorb
        self.host = None
        self.port = 0
        self._async = False
        self._wake = None  # async server: set when the engine has work
        self._flow = None  # async server: set when held connections resume
        # Coroutine functions serve_async() runs as tasks beside the server
        # and cancels when it stops (a bridge's upstream link is one).
        self.extras = []
        # Whether the board's network is up, for links that reach out (a
        # bridge): a function set by firmware; None = always (the host).
        self.net_up = None
        self.tls = None  # the listener's TLS context (tls_cert), made by listen()
        self._pause = 0  # accept paused until this broker second
        # Graceful close: sockets that sent their last packet and wait for
        # the peer to close ([deadline, socket], oldest first; see _linger)
        self.draining = []
        self.drains = {}  # poll server: socket key -> its draining entry
        self.max_drain = max(2, self.cfg["max_clients"] // 2)
        # A byte stream whose end of file stops the server (main's
        # --stop-on-eof): how a parent process asks a MicroPython unix-port
        # broker to stop, since that port's own SIGINT is not safe (main).
        self.stop_stream = None

    def log(self, level, fmt, *args):
        self.engine.log(level, fmt, *args)

    # ------------------------------------------------------------ listen
    def listen(self, host, port):
        if self.cfg["tls_cert"] and self.tls is None:
            try:
                self.tls = _tls_server(self.cfg)
            except (OSError, ValueError) as e:
                raise ValueError(
                    "tls_cert: cannot load %r: %r" % (self.cfg["tls_cert"], e)
                ) from None
        ai = socket.getaddrinfo(host, port)[0]
        s = socket.socket(ai[0], socket.SOCK_STREAM)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(ai[-1])
            s.listen(self.cfg["backlog"])
        except OSError:
            s.close()
            raise
        s.setblocking(False)
        self.lsock = s
        self.host = host
        self.port = port
        if _gc_threshold is not None:
            # MicroPython collects only when an allocation fails, so between
            # collections the allocator walks the whole heap and leaves the
            # long-lived small objects (one per retained message) sprinkled
            # over all of it: then a 3 KB block cannot be had with most of
            # the heap free (measured: 12.8 MB free, largest hole 1 KB).
            # Collecting after 1/16 of the heap keeps allocation low and the
            # rest of the heap in one piece.
            _gc_threshold(max(32768, _mem_free() // 16))
        self.rmv = memoryview(bytearray(self.cfg["io_chunk"]))
        self.engine.start(self.clock())
        self.running = True

    def stop(self):
        """Ends serve() or serve_async() at its next turn (callable from a
        signal handler, a local callback or another task); a broker that
        never served is shut down at once (port and store released)."""
        self.running = False
        if self._wake is not None:
            self._wake.set()
        elif self.poller is None:
            # start() and then the caller's own code failed: no server will
            # run the shutdown it runs at its end
            self.shutdown()

    # ---------------------------------------------------- the local client
    def publish(self, topic, payload, qos=0, retain=False, properties=None):
        """Publishes from code beside the broker, with the routing, retained
        rules and durability of a network PUBLISH. A retained publish on a
        flash store returns once it is durable, or raises OSError."""
        eng = self.engine
        eng.now_s = self.clock()
        eng.local_publish(topic, payload, qos, retain, properties)
        if eng.sdirty and not eng.commit(True):
            raise OSError("retained store write failed")
        self._kick()

    def subscribe(self, topic_filter, callback, qos=0):
        """callback(topic, payload, retained, properties) is called from the
        event loop for every matching message, retained ones first as for a
        new MQTT subscription (Retain Handling 0). Returns a handle for
        unsubscribe()."""
        eng = self.engine
        eng.now_s = self.clock()
        h = eng.local_subscribe(topic_filter, callback, qos)
        self._kick()
        return h

    def unsubscribe(self, handle):
        self.engine.local_unsubscribe(handle)

    def _kick(self):
        if self._wake is not None:
            self._wake.set()

    # ------------------------------------------------- shared socket work
    def _accept(self):
        """Accepts waiting connections (up to 16 a call). Own accept loop:
        MicroPython's start_server task dies for good on one MemoryError;
        here a failure closes that one socket, collects, and accepting goes
        on. With the free heap below half of heap_reserve it accepts one
        connection each half second (the kernel's backlog holds the others)
        rather than accept many and fail: one, because the heap may be held
        by the queues of sessions whose clients are waiting to come back,
        and only their CONNECT (let through by the Engine) drains them."""
        eng = self.engine
        for i in range(16):
            if _mem_free is not None and _mem_free() < self.cfg["heap_reserve"] // 2:
                gc.collect()
                if _mem_free() < self.cfg["heap_reserve"] // 2:
                    eng.refuse("memory", "free heap below heap_reserve/2, accept slowed")
                    self._pause = self.clock() + 0.5
                    if i:
                        return
            try:
                s, a = self.lsock.accept()
            except OSError as e:
                if e.args[0] in _EMFILE:
                    eng.refuse("sockets", "no free socket, accept paused")
                    self._pause = self.clock() + 0.5
                return
            except MemoryError:
                self._short("MemoryError in accept")
                return
            conn = None
            raw = s
            try:
                s.setblocking(False)
                try:
                    # Nagle + the client's delayed ACK would hold a lone
                    # small packet (a SUBACK's first retained message) ~40 ms
                    s.setsockopt(_IPPROTO_TCP, _TCP_NODELAY, 1)
                except OSError:
                    pass
                if self.tls is not None:
                    # the handshake runs as bytes arrive: reads return "no
                    # data" until it is done, and a failed one (a plain
                    # client, a bad certificate) reads as a closed socket
                    s = self.tls.wrap_socket(s, server_side=True, do_handshake_on_connect=False)
                conn = eng.open(s, self.clock(), _peer(a))
                if self.tls is not None:
                    # (only then: an attribute set costs a slot) kept to be
                    # closed too: MicroPython's SSL socket, closed after a
                    # failed handshake, leaves the socket under it open
                    conn.tls = raw
                self._watch(conn)
            except (OSError, ValueError) as e:
                # a TLS wrap that failed: this client only (raw: the socket
                # under a wrapper; without TLS the same one, closed twice)
                try:
                    s.close()
                    raw.close()
                except OSError:
                    pass
                eng.refuse("tls", "TLS for %s: %r", _peer(a), e)
            except MemoryError:
                # the socket was never watched (or is forgotten): close it
                if conn is not None:
                    eng.close(conn, False)
                    self._forget(conn)
                else:
                    try:
                        s.close()
                        raw.close()
                    except OSError:
                        pass
                self._short("MemoryError for a new connection")
            self._release_ended()

    def _read(self, conn):
        try:
            n = _recv_into(conn.io, self.rmv)
        except OSError:
            n = 0
        if n < 0:
            return
        if n == 0:
            self.engine.lost(conn, self.clock())
        else:
            self.engine.receive(conn, self.rmv, n, self.clock())
            if (
                conn.tls
                and not conn.closed
                and (conn.held is None or self.engine.held_room(conn))
                and _pending(conn.io)
            ):
                self._read(conn)  # TLS: bytes already decrypted, which poll cannot see

    def _flush(self, conn):
        """Sends what the engine left in conn.out; True when all of it left."""
        o = conn.out
        if not o:
            return True
        try:
            n = _send(conn.io, o)
        except OSError as e:
            if e.args[0] in _EAGAIN:
                n = 0
            else:
                self.engine.lost(conn, self.clock())
                return True
        done = self.engine.sent(conn, n)
        if not conn.closed:
            self._want_write(conn, not done)
        return done

    def _io_out(self):
        """After the engine worked: flush the connections with bytes to
        send, release the ones it ended. True if the heap ran out."""
        eng = self.engine
        short = False
        if eng.unheld:
            self._resume()
        if eng.dirty:
            dirty = eng.dirty
            eng.dirty = []
            for conn in dirty:
                if not conn.closed and conn.out and not conn.wait:
                    try:
                        self._flush(conn)
                    except MemoryError:  # e.g. no heap for its writer task
                        short = True
                        self._reflush(conn)
        self._release_ended()
        return short

    def _reflush(self, conn):
        # A flush that ran out of heap is made again at the next turn; if
        # even that cannot be noted, the connection closes (its session
        # keeps what is unacknowledged).
        try:
            self.engine.dirty.append(conn)
        except MemoryError:
            self.engine.close(conn, True)

    def _release_ended(self):
        # The list is kept (its room too: appending to it in Engine.close()
        # seldom needs heap), and a connection leaves it only once released:
        # one whose release ran out of heap is released at a later turn.
        ended = self.engine.ended
        while ended:
            self._forget(ended[-1])
            ended.pop()

    def _close_io(self, conn):
        # best effort for a final CONNACK or DISCONNECT, then the socket
        # (io is cleared only once the socket is closed or lingers: a
        # MemoryError half way leaves it to be released again)
        s = conn.io
        if s is None:
            return
        out = conn.out
        if out is not None:
            conn.out = None
        if out:
            try:
                n = _send(s, out)
            except OSError:
                n = -1
            if n == len(out) and self._linger(s, conn.linger, conn.tls):
                conn.io = None
                return
        try:
            s.close()
        except OSError:
            pass
        if conn.tls:
            try:
                conn.tls.close()  # the socket under it (Conn.tls)
            except OSError:
                pass
        conn.io = None

    def _linger(self, s, always, raw):
        # Graceful close: the final CONNACK or DISCONNECT has left. Closing a
        # socket with unread bytes sends RST, and a client that is still
        # writing would then see a reset instead of the reason code. So when
        # bytes are waiting, the socket stays open: what arrives is read and
        # dropped until the peer closes, nothing arrives for _QUIET_S, or
        # _DRAIN_S pass: always after a protocol error (the client is likely
        # still writing), otherwise only if bytes are waiting (a silent
        # client, e.g. past its keep alive, sees the close at once).
        # Bounded: max_drain sockets at a time, none while shutting down.
        # raw: Conn.tls, closed with it.
        if len(self.draining) >= self.max_drain:
            return False
        try:
            n = _recv_into(s, self.rmv)
        except OSError:
            return False
        if n == 0 or (n < 0 and not always):
            return False  # EOF, or nothing waiting from a quiet client: close now
        ent = None
        try:
            try:
                s.shutdown(_SHUT_WR)  # CPython: FIN now (MicroPython has no shutdown)
            except (AttributeError, OSError):
                pass
            now = self.clock()
            ent = [now + _DRAIN_S, s, now + _QUIET_S, raw]
            self.draining.append(ent)
            if self._async:
                _asyncio().create_task(self._drainer(ent))
            else:
                self.poller.register(s, select.POLLIN)
                self.drains[_key(s)] = ent
        except MemoryError:
            # A graceful close needs a little heap (its entry, a task); a
            # connection is often closed because the heap ran out. Then the
            # caller closes the socket at once: a client still writing may
            # see a reset, but no socket is left open (a board has ten).
            if ent is not None:
                self._undrain(ent)  # out of the list and the poller, closed
            return False
        return True

    def _drain_read(self, ent):
        # poll server: read and drop; end on EOF or an error
        try:
            n = _recv_into(ent[1], self.rmv)
        except OSError:
            n = 0
        if n == 0:
            self._undrain(ent)
        elif n > 0:
            ent[2] = self.clock() + _QUIET_S

    def _undrain(self, ent):
        if ent not in self.draining:
            return
        self.draining.remove(ent)
        s = ent[1]
        if not self._async:
            self.drains.pop(_key(s), None)
            try:
                self.poller.unregister(s)
            except (OSError, ValueError, KeyError):
                pass
        try:
            s.close()
        except OSError:
            pass
        if ent[3]:
            try:
                ent[3].close()  # TLS: the socket under it (Conn.tls)
            except OSError:
                pass

    async def _drainer(self, ent):
        # Reads and drops what the peer still sends, looking every 50 ms
        # (a literal: a new global name would be a new qstr). No wait_for:
        # on MicroPython it loads a submodule at its first use (2.7 KB on
        # the ESP32 port's 1.16) and makes a task a call, and a close is
        # often the answer to a heap that ran out. A MemoryError here just
        # ends the linger: the socket closes.
        aio = _asyncio()
        s = ent[1]
        try:
            while ent in self.draining:
                now = self.clock()
                if now >= ent[0] or now >= ent[2]:
                    break
                n = _recv_into(s, self.rmv)
                if n == 0:
                    break
                if n > 0:
                    ent[2] = self.clock() + _QUIET_S
                # every round yields: a peer that keeps sending must not
                # hold the loop (what it sends waits in the kernel, and the
                # socket closes at _DRAIN_S whatever)
                await aio.sleep(0.05)
        except (OSError, MemoryError):
            pass
        finally:
            self._undrain(ent)  # (never in the loop's poller: nothing to forget)

    def _turn(self):
        # True if the heap ran out: the async server then waits for I/O or
        # the tick instead of turning again at once (a loop that fails the
        # same way each turn would spin).
        short = False
        now = self.clock()
        eng = self.engine
        t = _ticks_ms()
        if _ticks_diff(t, self._tturn) > 2000:
            # the loop was held (a blocking call beside the broker): what
            # clients sent meanwhile is still unread, so keep alive is looked
            # at a second later, once the readers have run (MQTT-3.1.2-22
            # counts from a packet received, not from one read). Measured in
            # ticks, not in broker seconds: those are a float, single
            # precision on the boards, whose steps reach 2 s after 194 days
            # of uptime and 4 s after 388 days (then every turn looked held,
            # and no tick ran: no keep alive, expiry or $SYS)
            eng._last_tick = now
        self._tturn = t
        try:
            eng.turn(now)
        except MemoryError:
            short = self._short("MemoryError between packets")
        except Exception as err:  # a bug must not stop the broker
            self.engine.log("error", "internal error: %r", err)
            _print_exc(err)
        try:
            if self._io_out():
                short = self._short("MemoryError sending")
        except MemoryError:
            short = self._short("MemoryError releasing a connection")
        return short

    def _short(self, what, who=None):
        gc.collect()
        try:
            if who is None:
                self.engine.refuse("memory", what)
            else:
                self.engine.refuse("memory", what, who)
        except MemoryError:
            pass  # counted or not, the loop goes on
        return True

    def _watch(self, conn):
        if self._async:
            conn.task = _asyncio().create_task(self._reader(conn))
            return
        try:
            self.poller.register(conn.io, select.POLLIN)
        except MemoryError:
            # the old poller holds a half-made entry (see _repoll): replaced
            self._new_poller()
            raise
        self.socks[_key(conn.io)] = conn

    def _want_write(self, conn, want):
        if self._async:
            if want and conn.wait is None:
                conn.wait = _asyncio().create_task(self._writer(conn))
        elif want != bool(conn.wait):
            conn.wait = want
            self.poller.modify(conn.io, self._mask(conn))

    # >>> host only: the poll server's (a board build leaves these lines out:
    # a board runs serve_async(); the poll-server branches above never run there)
    def _new_poller(self):
        ent = []
        if not self._pause:
            ent.append((1, None, self.lsock))
        for c in self.socks.values():
            ent.append((1, 1 if c.wait else None, c.io))
        old = self.poller
        self.poller = _repoll(ent)
        _unpoll(old)

    def _mask(self, conn):
        # poll server: POLLIN unless flow control holds its input
        return (0 if conn.paused else select.POLLIN) | (select.POLLOUT if conn.wait else 0)

    # <<< host only

    def _resume(self):
        # connections whose held input the engine took back: read again
        eng = self.engine
        unheld = eng.unheld
        eng.unheld = []
        if self._async:
            f = self._flow
            if f is not None:
                f.set()  # held readers wake and look again
                f.clear()
            return
        for conn in unheld:
            if conn.paused and not conn.closed and conn.io is not None:
                conn.paused = False
                self.poller.modify(conn.io, self._mask(conn))

    def _forget(self, conn):
        """Releases an ended connection's socket. Poll: unregistered before
        it is closed (a closed socket left in a MicroPython poller is what
        crashed poll_poll_internal). Async: its tasks are cancelled first,
        which on MicroPython takes them out of the scheduler's poller at
        once; on CPython the loop's reader is removed before the close."""
        s = conn.io
        if s is None:
            return
        if self._async:
            cur = _current()
            _io_stop([t for t in (conn.wait, conn.task) if t is not cur], s)
            if conn.wait is not None:
                conn.wait = None
            _io_forget(s)
            if conn.paused and self._flow is not None:
                self._flow.set()  # its reader waits for flow control: let it end
                self._flow.clear()
        elif self.socks.pop(_key(s), None) is not None:
            try:
                self.poller.unregister(s)
            except (OSError, ValueError, KeyError):
                pass
        self._close_io(conn)

    # ------------------------------------------------------- poll server
    # >>> host only: the poll server (a board build leaves it out: a board
    # runs serve_async(), one task beside the firmware's and the user's)
    def serve(self, on_tick=None):
        """The poll server: runs until stop() or KeyboardInterrupt. on_tick,
        if given, is called about once a second."""
        if self.extras:
            # a bridge's link is an asyncio task: only serve_async() runs it
            raise ValueError("bridges: need the asyncio server (serve_async; --server async)")
        self.poller = _poller()
        lsock = self.lsock
        self.poller.register(lsock, select.POLLIN)
        lkey = _key(lsock)
        skey = None
        if self.stop_stream is not None:
            try:
                self.poller.register(self.stop_stream, select.POLLIN)
                skey = _key(self.stop_stream)
            except OSError:
                self._stop_file()
        socks = self.socks
        eng = self.engine
        last = self.clock()
        paused = False
        try:
            short = False
            while self.running:
                for ev in _poll(self.poller, 200 if short or eng.idle() else 0):
                    k = ev[0]
                    if k == lkey:
                        self._accept()
                        if self._pause and not paused:
                            paused = True
                            try:
                                self.poller.unregister(lsock)
                            except (OSError, ValueError, KeyError):
                                pass  # a new poller (_new_poller) left it out
                        continue
                    conn = socks.get(k)
                    if conn is not None and conn.closed:
                        # ended while the heap was short, its release not
                        # done then (Engine.close, _release_ended): now
                        self._forget(conn)
                        continue
                    if conn is None:
                        d = self.drains.get(k)
                        if d is not None:
                            self._drain_read(d)
                        elif skey is not None and k == skey and self._stop_read():
                            self.poller.unregister(self.stop_stream)
                            skey = None
                        continue
                    e = ev[1]
                    if e & select.POLLOUT:
                        try:
                            self._flush(conn)
                        except MemoryError:
                            # as the async writer: flushed again next turn
                            self._short("MemoryError sending to %s", conn.cid)
                            conn.wait = False
                            self.poller.modify(conn.io, self._mask(conn))
                            self._reflush(conn)
                    if e & (select.POLLIN | select.POLLHUP | select.POLLERR) and not conn.closed:
                        self._read(conn)
                        if (
                            conn.held is not None
                            and not conn.paused
                            and not conn.closed
                            and not eng.held_room(conn)
                        ):
                            conn.paused = True  # flow control: no POLLIN until resumed
                            self.poller.modify(conn.io, self._mask(conn))
                short = self._turn()
                now = self.clock()
                if self.draining:
                    for ent in list(self.draining):
                        if now >= ent[0] or now >= ent[2]:
                            self._undrain(ent)
                if paused and now >= self._pause:
                    self._pause = 0
                    paused = False
                    self.poller.register(lsock, select.POLLIN)
                if on_tick is not None and now - last >= 1:
                    last = now
                    on_tick(self)
        except MemoryError:
            self.failed = True
            raise
        finally:
            self.shutdown()

    # <<< host only

    # ------------------------------------------------------ async server
    async def serve_async(self):
        """The asyncio server: one task that runs the engine's turns, one
        that accepts, one reader per connection (a writer only while a
        socket is full), and a once-a-second tick. Nothing polls: idle, it
        wakes once a second. Runs until stop()."""
        aio = _asyncio()
        self._async = True
        self._wake = wake = aio.Event()
        self._flow = aio.Event()
        eng = self.engine
        if eng.syncer is not None:
            eng.syncer.bind(wake)  # a finished fsync wakes the loop
        acc = aio.create_task(self._acceptor())
        tick = aio.create_task(self._ticker())
        extra = [aio.create_task(f()) for f in self.extras]
        if self.stop_stream is not None:
            extra.append(aio.create_task(self._stop_watch()))
        try:
            while self.running:
                await wake.wait()
                wake.clear()
                short = self._turn()
                while self.running and not eng.idle() and not short:
                    # paced deliveries go on, but every other task runs first
                    await aio.sleep(0)
                    short = self._turn()
        except MemoryError:
            self.failed = True  # main() says so and exits non-zero
            raise
        finally:
            _io_stop((acc,), self.lsock)
            tick.cancel()
            for t in extra:
                t.cancel()
            self.shutdown()

    async def _acceptor(self):
        aio = _asyncio()
        s = self.lsock
        while self.running:
            try:
                if self._pause:
                    await aio.sleep(0.5)
                    self._pause = 0
                await _io_wait(s, False)
                if not self.running:
                    break
                self._accept()
            except MemoryError:
                self._short("MemoryError in accept")
            self._wake.set()

    # >>> host only: main's --stop-on-eof (a board build leaves it out)
    def _stop_read(self):
        # Anything but end of file is ignored; True once it is reached.
        try:
            data = self.stop_stream.read(1)
        except OSError:
            data = None
        if data:
            return False
        self.log("info", "standard input closed: stopping")
        self.stop()
        return True

    def _stop_file(self):
        # epoll (CPython's poll server and asyncio loop on Linux) refuses a
        # regular file or /dev/null as standard input (EPERM). Reading one
        # never waits, so it is read to its end now, which stops the broker
        # as under poll, where such a stream is always readable.
        while not self._stop_read():
            pass

    async def _stop_watch(self):
        s = self.stop_stream
        try:
            while self.running:
                try:
                    await _io_wait(s, False)
                except OSError:
                    self._stop_file()
                    break
                if self._stop_read():
                    break
        finally:
            _io_forget(s)

    # <<< host only

    async def _ticker(self):
        aio = _asyncio()
        while self.running:
            await aio.sleep(1)
            self._wake.set()

    async def _reader(self, conn):
        s = conn.io
        try:
            while not conn.closed:
                if conn.held is not None and not self.engine.held_room(conn):
                    # flow control: this connection's input waits unread
                    conn.paused = True
                    await self._flow.wait()
                    conn.paused = False
                    continue
                await _io_wait(s, False)
                if conn.closed:
                    break
                self._read(conn)
                self._wake.set()
        except MemoryError:
            self._short("MemoryError serving %s", conn.cid)
            self.engine.close(conn, True)
        finally:
            self._reader_end(conn, s)

    def _reader_end(self, conn, s):
        # A function of its own, not the reader's finally: a coroutine keeps
        # its frame, exception handlers included, in the heap for as long as
        # the connection lives (64 B a connection on the unix port); a
        # call's frame lives only during the call, and needs no heap when
        # the heap is short (py/objfun.c: a small one, or one the heap has
        # no room for, is made on the C stack).
        try:
            if not conn.closed:
                self.engine.lost(conn, self.clock())
        finally:
            # the socket is released whatever the engine's part raised
            # (a MemoryError while the heap is short): a board has ten
            if conn.io is not None:
                w = conn.wait
                try:
                    if w is not None:
                        conn.wait = None
                        _io_stop((w,), s)
                finally:
                    _io_forget(s)
                    self._close_io(conn)
            self._wake.set()

    async def _writer(self, conn):
        # only while the socket is full: the reader keeps reading meanwhile
        try:
            while conn.out and not conn.closed:
                await _io_wait(conn.io, True)
                if conn.closed or self._flush(conn):
                    break
        except MemoryError:
            # what was sent is accounted (Engine.sent); the rest goes at the
            # next turn
            self._short("MemoryError sending to %s", conn.cid)
            self._reflush(conn)
        finally:
            conn.wait = None
            self._wake.set()

    # ------------------------------------------------------------ shutdown
    def shutdown(self):
        """Closes every connection and the listener, then the store."""
        if self.lsock is None:
            return
        eng = self.engine
        self.max_drain = 0  # no graceful close now: every socket closes
        for ent in list(self.draining):
            self._undrain(ent)
        for conn in list(eng.conns):
            try:
                eng.close(conn, True)  # their wills go: Engine.shutdown
            except MemoryError:
                eng.close(conn, False)  # (stopping for want of heap)
        self._release_ended()
        if self.poller is not None:
            try:
                self.poller.unregister(self.lsock)
            except (OSError, ValueError, KeyError):
                pass
            _unpoll(self.poller)
            self.poller = None
        if self._async:
            _io_forget(self.lsock)
        self.lsock.close()
        self.lsock = None
        self.running = False
        eng.shutdown()


# ------------------------------------------------------------ 10. the API
def _auth_needed(cfg):
    # users (the profile's, or a secrets file's merged in), an acl, or no
    # anonymous access: the profile authenticates (tools: profiles.needs_auth)
    return bool(cfg["users"]) or bool(cfg["acl"]) or not cfg["allow_anonymous"]


def load_modules(cfg):
    """Drops edgeconf (boot-only: the profile is checked) and imports what
    the profile needs beside this module (edgestore for a flash store,
    edgeram for a RAM one, edgeauth when it authenticates: _auth_needed,
    edgebridge for bridges), then collects: before anything
    long-lived is allocated. Loading a .mpy makes temporary buffers; made
    after the broker's objects, they leave holes between them, and the
    heap has no block for a 3 KB index chunk with 20 KB free (measured on
    a 32-bit port: the esp32 profile then needed a 118 KB heap to start;
    with its modules imported first, 108 KB)."""
    # the profile is checked: the checker's bytecode leaves the heap (it
    # comes back, from flash, if limits() is called again)
    sys.modules.pop("edgeconf", None)
    gc.collect()  # each module loads into one region, not around garbage
    if cfg["storage_type"] != "ram":
        import edgestore  # noqa: F401 (loaded now, used by open_store)
    else:
        import edgeram  # noqa: F401 (loaded now, used by open_store)
    if _auth_needed(cfg):
        import edgeauth  # noqa: F401 (loaded now, used by the Engine)
    if cfg["bridges"]:
        import edgebridge  # noqa: F401 (loaded now, used by start)
    gc.collect()


def start(profile=None, host="127.0.0.1", port=1883, data_dir=None, log=None):
    """Builds a broker from a board profile (a dict; missing keys take their
    defaults), opens its retained store as storage_type says (a flash store
    under data_dir), and listens. Returns the Broker: then serve() or
    `await broker.serve_async()`. A bad profile value raises ValueError
    naming the key; a port in use raises OSError."""
    cfg = limits(profile)
    if cfg["storage_type"] != "ram" and not data_dir:
        # a flash store's files need a place: a RAM store instead would
        # lose at the next start what a retained publish() said was kept
        raise ValueError("data_dir: needed for storage_type %s" % cfg["storage_type"])
    load_modules(cfg)
    clock = MonoClock()
    if data_dir:
        try:
            os.mkdir(data_dir)
        except OSError:
            pass  # exists
    if log is None:
        lvl = _LEVELS[cfg["log_level"]]

        def log(level, text):
            if _LEVELS[level] >= lvl:
                print("edgebroker: %s %s" % (level, text), file=sys.stderr)

    # the store reports recovery (torn tail, corrupt records, moved aside)
    store = open_store(cfg, data_dir, clock, _wallclock, log)
    b = Broker(cfg, store, clock, log)
    try:
        b.listen(host, port)
    except OSError:
        store.close()
        raise
    if cfg["bridges"]:
        # a separate module, loaded only by profiles that bridge
        import edgebridge

        edgebridge.attach(b, cfg["bridges"], data_dir)
    return b


# --------------------------------------------------------------- 11. main
# >>> host only: the host's command line (a board build leaves it out: a board
# starts the broker with start(), firmware/gateway.py)
def _parse_value(v):
    import json

    try:
        return json.loads(v)
    except ValueError:
        return v


def _stamp():
    t = time.localtime()
    return "%04d-%02d-%02d %02d:%02d:%02d" % t[:6]


def _die(text, status=2):
    try:
        print("edgebroker: error: %s" % text, file=sys.stderr)
    finally:
        sys.exit(status)  # (also when the heap is too short to print)


def main(argv):
    """Host build and emulator: `edgebroker.py --board F --port N
    [--bind A] [--data-dir D] [--server poll|async] [--set key=value]...
    [--secrets F] [--stop-on-eof]`. Errors are one line on stderr and exit
    status 2. --secrets: a JSON file like the board's /secrets.json (users,
    bridge credentials; with_secrets()).

    SIGINT stops the broker cleanly (exit 0); on CPython SIGTERM too. The
    MicroPython unix port raises KeyboardInterrupt straight from its signal
    handler (MICROPY_ASYNC_KBD_INTR), at any instruction: one that lands
    inside the allocator leaves the heap's lock taken, and the next
    allocation waits for ever. A parent process therefore starts a
    MicroPython broker with SIGINT blocked and --stop-on-eof, and closes its
    standard input to stop it (the `edgebroker run` and `emulate` tools,
    and the tests, do). Nothing acknowledged is lost either way: an
    acknowledgement waits for the store's commit."""
    import json

    board = None
    port = 1883
    bind = "127.0.0.1"
    data_dir = None
    server = "poll"
    sets = []
    secrets = None
    stop_on_eof = False
    i = 1
    while i < len(argv):
        a = argv[i]
        if a == "--stop-on-eof":
            stop_on_eof = True
            i += 1
            continue
        v = argv[i + 1] if i + 1 < len(argv) else None
        if v is None:
            _die("%s needs a value" % a)
        if a == "--board":
            board = v
        elif a == "--port":
            try:
                port = int(v)
            except ValueError:
                port = -1
            if not 0 < port < 65536:
                _die("--port %s: allowed 1..65535" % v)
        elif a == "--bind":
            bind = v
        elif a == "--data-dir":
            data_dir = v
        elif a == "--secrets":
            secrets = v
        elif a == "--server":
            if v not in ("poll", "async"):
                _die("--server %s: allowed poll, async" % v)
            server = v
        elif a == "--set":
            if "=" not in v:
                _die("--set needs key=value")
            sets.append(v)
        else:
            _die("unknown option %s" % a)
        i += 2

    def read(path, what):
        try:
            with open(path) as f:
                return json.load(f)
        except (OSError, ValueError) as e:
            _die("cannot read %s %s: %s" % (what, path, e))

    profile = read(board, "board profile") if board is not None else {}
    if not isinstance(profile, dict):
        _die("board profile %s: not a JSON object" % (board,))
    for kv in sets:
        k, v = kv.split("=", 1)
        profile[k] = _parse_value(v)
    if secrets is not None:
        try:
            profile = with_secrets(profile, read(secrets, "secrets file"))
        except ValueError as e:
            _die("%s" % (e,))
    try:
        lvl = _LEVELS[profile.get("log_level", "info")]
    except (KeyError, TypeError):
        lvl = 20

    def log(level, text):
        if _LEVELS[level] >= lvl:
            print("%s edgebroker: %s %s" % (_stamp(), level, text), file=sys.stderr)

    if server == "poll" and profile.get("bridges"):
        # refused before anything listens (a bridge's link is an asyncio task)
        _die("bridges: need the asyncio server (--server async)")
    try:
        broker = start(profile, bind, port, data_dir, log)
    except ValueError as e:
        _die("board profile: %s" % (e,))
    except OSError as e:
        why = "address in use" if e.args and e.args[0] in _EADDRINUSE else repr(e)
        _die("cannot listen on %s:%d: %s" % (bind, port, why))
    except MemoryError as e:
        # The heap holds less than the profile needs to start (the store's
        # index, the receive buffer, the modules): one line that says so,
        # not a traceback. What start() made is garbage now.
        gc.collect()
        _die(
            "out of heap while starting (%s): the heap is smaller than the profile "
            "needs; `edgebroker config check` counts it" % (e,),
            3,
        )
    profile = None  # the board facts in it are the tools' business
    _install_signals()
    if stop_on_eof:
        broker.stop_stream = getattr(sys.stdin, "buffer", sys.stdin)
    if _mem_alloc is not None:
        gc.collect()
        log("info", "heap after start: %d allocated, %d free" % (_mem_alloc(), _mem_free()))
    print("edgebroker listening on %s:%d (%s, %s server)" % (bind, port, _IMPL, server))
    try:
        sys.stdout.flush()
    except AttributeError:
        pass
    try:
        if server == "async":
            _asyncio().run(broker.serve_async())
        else:
            broker.serve()
    except KeyboardInterrupt:
        pass
    except MemoryError:
        if broker.failed:
            # out of the server's own loop: every MemoryError a connection
            # or a turn can raise is handled below it, so this one is a
            # broker that cannot go on. It says so and fails (a supervisor
            # restarts it; what was acknowledged is on flash).
            broker = None
            gc.collect()
            _die("out of heap, the server stopped (heap_reserve)", 3)
        # The unix port raises KeyboardInterrupt from its signal handler; one
        # that lands inside a garbage collection leaves the heap locked, and
        # shutdown cannot allocate. What was acknowledged is on flash already
        # (acks wait for commit), so stop here without more work.
        return
    try:
        broker.shutdown()  # no-op when the server already shut down
    except KeyboardInterrupt:
        pass
    gc.collect()
    log("info", "stopped")


if __name__ == "__main__":
    # edgeram, edgeauth and edgebridge import this module by name: run as a script
    # (CPython), it is that module too, not a second copy of it
    _me = sys.modules.get(__name__)
    if _me is not None:
        sys.modules.setdefault("edgebroker", _me)
    main(sys.argv)
# <<< host only
