# edgeram: the RAM-backed retained store of edgebroker (storage_type "ram").
# A module of its own so that a board whose profile keeps its retained
# messages on flash (disc, disc_only: edgestore) does not hold this code in
# its heap (1.9 KB on a 32-bit port). The same file runs on MicroPython and
# CPython; it does not look at which: the broker's compat block does, and
# what this module needs of it comes from there. Nothing happens at import;
# the broker makes a RamStore through its open_store() (or an Engine built
# without a store).
from edgebroker import _new_key, _topic_key, const, msg_size, topic_matches

# the message tuple's slots (edgebroker, section 6)
_M_TB = const(0)
_M_EXP = const(4)
_PARTS = const(32)  # slot partitions, chosen by a hash of the first level
_CH = const(32)  # slots per chunk, chunks per page


class RamStore:
    """The retained-store interface, RAM backend (storage_type 'ram').

    Interface (the flash store implements the same):
      get(topic) -> msg or None     put(topic, msg)     delete(topic)
      match(filter levels) -> iterator of msgs, safe while the store changes
      count, nbytes                 durable (acks wait for commit() if True)
      commit()                      expire(now, budget) -> removed
      close()

    Memory: on MicroPython a large contiguous block is what fails first (a
    growing dict or list needs one twice its size: docs/design.md), so nothing
    here grows as one piece. The index is a power of two of small dicts, about 16 topics each at the
    expected capacity (max_retained_messages) (topic -> location);
    messages sit in 32 partitions of pages of 32 chunks of 32 slots. So no
    allocation grows past 32 pointers or a small dict, however many messages.
    A deleted slot holds the
    number of the next free slot (a free list threaded through the holes, no
    list of its own), and an iterator walks slots by number, so puts and
    deletes during a long delivery never invalidate it and nothing is copied.
    A filter with a literal first level walks one partition, not the set."""

    durable = False
    read_only = False  # a FlashStore on a data dir it cannot write
    degraded = None  # why the store is not what storage_type asked for

    def __init__(self, capacity=1000):
        nb = 16
        while nb < 1024 and nb * 16 < (capacity or 16384):
            nb *= 2
        self.nb = nb
        self.index = None  # made at the first put: an idle broker pays nothing
        self.key = None  # the keyed hash's key, drawn at the first put
        self.parts = None  # [chunks, first free slot or -1] per partition
        self.count = 0
        self.nbytes = 0
        self._sweep = None

    def _msg(self, loc):
        i = loc // _PARTS
        return self.parts[loc % _PARTS][0][i >> 10][i >> 5 & 31][i & 31]

    def _lookup(self, topic):
        # (bucket dict or None, keyed hash, location or None). A bucket maps
        # the keyed hash to a location, or to a list of them in the rare
        # (random, not choosable) case of two topics on one value.
        k = _topic_key(self.key, topic)
        d = self.index[k % self.nb]
        v = None if d is None else d.get(k)
        if v is not None:
            tb = topic.encode()
            for loc in v if type(v) is list else (v,):
                if self._msg(loc)[_M_TB] == tb:
                    return d, k, loc
        return d, k, None

    def get(self, topic):
        if self.index is None:
            return None
        loc = self._lookup(topic)[2]
        return None if loc is None else self._msg(loc)

    def put(self, topic, msg):
        if self.index is None:
            self.index = [None] * self.nb
            self.parts = [None] * _PARTS
            self.key = _new_key()
        d, k, loc = self._lookup(topic)
        if d is None:
            d = self.index[k % self.nb] = {}
        if loc is not None:
            i = loc // _PARTS
            ch = self.parts[loc % _PARTS][0][i >> 10][i >> 5 & 31]
            self.nbytes += msg_size(msg) - msg_size(ch[i & 31])
            ch[i & 31] = msg
            return
        pn = hash(_first(topic)) % _PARTS
        p = self.parts[pn]
        if p is None:
            p = self.parts[pn] = [[], -1]
        pages = p[0]
        i = p[1]
        if i >= 0:
            ch = pages[i >> 10][i >> 5 & 31]
            p[1] = ch[i & 31]
            ch[i & 31] = msg
        else:
            page = pages[-1] if pages else None
            if page is None or (len(page) == _CH and len(page[-1]) == _CH):
                page = []
                pages.append(page)
            if not page or len(page[-1]) == _CH:
                page.append([])
            ch = page[-1]
            i = (len(pages) - 1) * 1024 + (len(page) - 1) * 32 + len(ch)
            ch.append(msg)
        loc = i * _PARTS + pn
        v = d.get(k)
        if v is None:
            d[k] = loc
        elif type(v) is list:
            v.append(loc)
        else:
            d[k] = [v, loc]
        self.count += 1
        self.nbytes += msg_size(msg)

    def delete(self, topic):
        if self.index is None:
            return False
        d, k, loc = self._lookup(topic)
        if loc is None:
            return False
        v = d[k]
        if type(v) is list:
            v.remove(loc)
            if len(v) == 1:
                d[k] = v[0]
        else:
            del d[k]
        p = self.parts[loc % _PARTS]
        i = loc // _PARTS
        ch = p[0][i >> 10][i >> 5 & 31]
        self.nbytes -= msg_size(ch[i & 31])
        self.count -= 1
        ch[i & 31] = p[1]
        p[1] = i
        return True

    def match(self, flevels):
        first = flevels[0]
        every = first == "+" or first == "#"
        if not every and "+" not in flevels and "#" not in flevels:
            m = self.get("/".join(flevels))
            if m is not None:
                yield m
            return
        # One generator walking slots by number (the paced hot path of D9:
        # a delivery resumes one frame per message, not three).
        pn = 0 if every else hash(first) % _PARTS
        i = 0
        while self.parts is not None:
            p = self.parts[pn]
            ch = None
            if p is not None:
                pages = p[0]
                if i >> 10 < len(pages):
                    page = pages[i >> 10]
                    if i >> 5 & 31 < len(page):
                        ch = page[i >> 5 & 31]
                        if i & 31 >= len(ch):
                            ch = None
            if ch is None:  # this partition is done
                if not every or pn + 1 >= _PARTS:
                    return
                pn += 1
                i = 0
                continue
            m = ch[i & 31]
            i += 1
            if type(m) is tuple and topic_matches(flevels, m[_M_TB].decode()):
                yield m

    def _slots(self, pn):
        # every message of a partition, by slot number; holes are ints
        i = 0
        while self.parts is not None:
            p = self.parts[pn]
            if p is None:
                return
            pages = p[0]
            if i >> 10 >= len(pages):
                return
            page = pages[i >> 10]
            if i >> 5 & 31 >= len(page):
                return
            ch = page[i >> 5 & 31]
            k = i & 31
            if k >= len(ch):
                return
            i += 1
            m = ch[k]
            if type(m) is tuple:
                yield m

    def expire(self, now, budget):
        """Deletes expired messages, looking at `budget` slots a call and
        resuming where the last call stopped: bounded work per second."""
        removed = 0
        sw = self._sweep
        if sw is None:
            sw = self._sweep = self._sweeper()
        for _ in range(budget):
            try:
                m = next(sw)
            except StopIteration:
                self._sweep = None
                break
            if m[_M_EXP] and m[_M_EXP] <= now:
                topic = m[_M_TB].decode()
                if self.get(topic) is m:
                    self.delete(topic)
                    removed += 1
        return removed

    def _sweeper(self):
        for pn in range(_PARTS):
            yield from self._slots(pn)

    def commit(self):
        pass

    def close(self):
        pass


def _first(topic):
    i = topic.find("/")
    return topic if i < 0 else topic[:i]
