"""A store file to open: `live` messages (one in ten with a Message Expiry of
an hour, one in four with a Content Type), then `dead` updates of the
first topics (superseded records the open must read past). Written by
FlashStore itself under CPython: the file a board would have.

Run as `<interpreter> store_build.py <params.json>`; prints one line
"RESULT <json>". Run by CPython."""

import json
import sys
import time

with open(sys.argv[1]) as f:
    P = json.load(f)
sys.path.insert(0, P["lib"])
import edgestore

clock = time.monotonic
st = edgestore.FlashStore(
    P["path"], mode="disc_only", capacity=P["live"], clock=clock, wallclock=lambda: int(time.time())
)
ct = b"\x03\x00\x0atext/plain"
for i in range(P["live"] + P["dead"]):
    k = i % P["live"]
    t = "bench/open/%02d/%05d" % (k % 64, k)
    dl = clock() + 3600 if k % 10 == 0 else 0
    st.put(
        t,
        (t.encode(), b"p" * 24 + b"%08d" % i, 1, ct if k % 4 == 0 else b"", dl, 1 if dl else 0),
    )
    if i % 256 == 255:
        st.commit()
st.commit()
s = st.stats()
st.close()
print("RESULT " + json.dumps(s))
