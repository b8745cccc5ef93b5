"""Write amplification: FlashStore under CPython with a file layer that
counts every byte written (compaction's .new file included). Syncs only
flush: fsync changes the time, not the bytes. Commits every `group`
updates, like the broker's group commit with 16 PUBLISHes in flight.

Run as `<interpreter> store_wear.py <params.json>`; prints one line
"RESULT <json>". Run by CPython."""

import json
import sys

with open(sys.argv[1]) as f:
    P = json.load(f)
sys.path.insert(0, P["lib"])
import edgestore


class CountFile:
    def __init__(self, f, fs):
        self.f = f
        self.fs = fs

    def write(self, b):
        self.fs.written += len(b)
        return self.f.write(b)

    def __getattr__(self, name):
        return getattr(self.f, name)


class CountFs(edgestore.Fs):
    written = 0

    def open(self, path, mode):
        f = open(path, mode)
        return CountFile(f, self) if ("w" in mode or "+" in mode or "a" in mode) else f

    def sync(self, f):
        f.flush()

    def sync_dir(self, path):
        pass


fs = CountFs()
st = edgestore.FlashStore(P["path"], mode="disc_only", capacity=P["topics"], fs=fs)
topics = ["bench/wear/%04d" % i for i in range(P["topics"])]
tbs = [t.encode() for t in topics]
pad = b"w" * (P["payload"] - 8)
record = 0
payload_bytes = 0
for i in range(P["updates"]):
    k = i % P["topics"]
    payload = pad + b"%08d" % i
    st.put(topics[k], (tbs[k], payload, 1, b"", 0, 0))
    record += edgestore.PUT_OVERHEAD + len(tbs[k]) + len(payload)
    payload_bytes += len(payload)
    if i % P["group"] == P["group"] - 1:
        st.commit()
st.commit()
s = st.stats()
st.close()
print(
    "RESULT "
    + json.dumps(
        {
            "updates": P["updates"],
            "record_bytes": record,
            "payload_bytes": payload_bytes,
            "fs_written": fs.written,
            "store_written": s["bytes_written"],
            "compactions": s["compactions"],
            "file_bytes": s["file_bytes"],
            "live_bytes": s["live_bytes"],
            "count": s["count"],
        }
    )
)
