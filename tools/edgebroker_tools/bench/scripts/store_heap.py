"""Heap per retained message in each storage type under MicroPython: heap
allocated (after gc.collect()) before the store is made and after
`count` messages are in it, divided by `count`. Every message is made the
way the broker makes one from a PUBLISH (its own topic str and bytes, its
own 64-byte payload); capacity = count, as max_retained_messages would be.

Run as `<interpreter> store_heap.py <params.json>`; prints one line
"RESULT <json>". Run by the MicroPython unix port."""

import gc
import json
import os
import sys

with open(sys.argv[1]) as f:
    P = json.load(f)
sys.path.insert(0, P["lib"])
import edgebroker
import edgestore

res = {}
for mode in ("ram", "disc", "disc_only"):
    path = P["tmp"] + "/heap-" + mode + ".ebrs"
    try:
        os.remove(path)
    except OSError:
        pass
    gc.collect()
    a0 = gc.mem_alloc()
    if mode == "ram":
        st = edgebroker.RamStore(P["count"])
    else:
        st = edgestore.FlashStore(path, mode=mode, capacity=P["count"])
    for i in range(P["count"]):
        t = "bench/heap/%02d/%05d" % (i % 64, i)
        st.put(t, (t, t.encode(), b"m" * 56 + b"%08d" % i, 1, b"", 0, 0))
        if i % 16 == 15:
            st.commit()
    st.commit()
    gc.collect()
    a1 = gc.mem_alloc()
    res[mode] = {"count": st.count, "per_message": (a1 - a0) / P["count"], "bytes": a1 - a0}
    st.close()
    st = None
    gc.collect()
print("RESULT " + json.dumps(res))
