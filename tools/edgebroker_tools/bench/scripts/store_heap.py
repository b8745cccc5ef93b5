"""Heap per retained message in each storage type under MicroPython: heap
allocated (after gc.collect()) before the store is made and after it is
full, for a store of count / 2 and one of `count` messages: the slope
between the two is the cost of a message, what is left at `count` the
store's fixed part. Every message is made the way the broker makes one
from a PUBLISH (its topic's bytes, its own 64-byte payload; no str);
capacity = the message count, as max_retained_messages would be.

Run as `<interpreter> store_heap.py <params.json>`; prints one line
"RESULT <json>". Run by the MicroPython unix port."""

import gc
import json
import os
import sys

with open(sys.argv[1]) as f:
    P = json.load(f)
sys.path.insert(0, P["lib"])
import edgeram
import edgestore


def full(mode, n):
    # heap of a store of capacity n holding n messages, and how many it holds
    path = P["tmp"] + "/heap-%s-%d.ebrs" % (mode, n)
    try:
        os.remove(path)
    except OSError:
        pass
    gc.collect()
    a0 = gc.mem_alloc()
    if mode == "ram":
        st = edgeram.RamStore(n)
    else:
        st = edgestore.FlashStore(path, mode=mode, capacity=n)
    for i in range(n):
        tb = b"bench/heap/%02d/%05d" % (i % 64, i)
        st.put(tb.decode(), (tb, b"m" * 56 + b"%08d" % i, 1, b"", 0, 0))
        if i % 16 == 15:
            st.commit()
    st.commit()
    gc.collect()
    used = gc.mem_alloc() - a0
    count = st.count
    st.close()
    st = None
    gc.collect()
    return used, count


res = {}
n = P["count"]
for mode in ("ram", "disc", "disc_only"):
    half, _ = full(mode, n // 2)
    used, count = full(mode, n)
    per = (used - half) / (n - n // 2)
    res[mode] = {"count": count, "per_message": per, "fixed": used - per * n, "bytes": used}
print("RESULT " + json.dumps(res))
