"""Opening a store file under MicroPython, as the broker does at boot
(capacity = max_retained_messages, a wall clock set): best of `repeat`.

Run as `<interpreter> store_open.py <params.json>`; prints one line
"RESULT <json>". Run by the MicroPython unix port."""

import gc
import json
import sys
import time

with open(sys.argv[1]) as f:
    P = json.load(f)
sys.path.insert(0, P["lib"])
import edgestore

times = []
n = 0
stats = None
for _r in range(P["repeat"]):
    gc.collect()
    t0 = time.ticks_us()
    st = edgestore.FlashStore(
        P["path"], mode=P["mode"], capacity=P["capacity"], wallclock=lambda: int(time.time())
    )
    t1 = time.ticks_us()
    n = st.count
    stats = st.open_stats
    st.close()
    st = None
    times.append(time.ticks_diff(t1, t0) / 1000000)
gc.collect()
print("RESULT " + json.dumps({"times": times, "count": n, "open_stats": stats}))
