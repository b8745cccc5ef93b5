"""Writes the golden retained-store files of host_tests/data/ (run once; the
files are checked in). Deterministic: the same bytes every run.

    python3 host_tests/data/make_golden.py [OUTDIR]

The encoder here is written from the format description at the top of
lib/edgestore.py, independently of edgestore itself, so the golden files
pin the format: if edgestore ever stops reading these files the way
host_tests/portable/unit_store.py expects, a format change broke old
stores. (unit_store also checks that FlashStore writes good.ebrs byte for
byte from the same scripted sequence.)
"""

import binascii
import struct
import sys
from pathlib import Path

HEADER = b"EBRS\x01\x00\x00\x00"
F_OWN = 1
F_EXP = 2


def record(rtype: int, body: bytes) -> bytes:
    head = struct.pack(">BI", rtype, len(body))
    return head + body + struct.pack(">I", binascii.crc32(head + body))


def put(topic: str, payload: bytes, qos: int = 1, flags: int = 0, remaining: int = 0,
        stime: int = 0, wall: int = 0, props: bytes = b"") -> bytes:
    tb = topic.encode()
    body = (struct.pack(">H", len(tb)) + tb
            + struct.pack(">BBIIII", qos, flags, remaining, stime, wall, len(props))
            + props + payload)
    return record(0x50, body)


def delete(topic: str) -> bytes:
    return record(0x44, topic.encode())


def clock(stime: int, wall: int) -> bytes:
    return record(0x43, struct.pack(">II", stime, wall))


# The scripted history of good.ebrs (unit_store.GOOD_SCRIPT replays it
# through FlashStore). Content Type "text/plain" as 5.0 property bytes.
CONTENT_TYPE = b"\x03\x00\x0atext/plain"
GOOD = [
    put("sensors/t1", b"21.5", qos=1, stime=10),
    put("sensors/t2", b"19.0", qos=0, stime=12),
    put("sensors/t1", b"22.0", qos=2, stime=20),  # replaces the first
    put("config/mode", b"auto", qos=1, stime=25, props=CONTENT_TYPE),
    put("alerts/door", b"open", qos=1, flags=F_EXP | F_OWN, remaining=3600, stime=30,
        wall=1700000000),
    put("status/boot", b"ok", qos=0, flags=F_EXP, remaining=100, stime=40),  # expired by 300
    delete("sensors/t2"),
    put("$app/version", b"1.2", qos=1, stime=50),
    put("caf\u00e9/\u6c34", b"\x00\x01\xff", qos=1, stime=60),
    clock(300, 1700000270),
]


def files() -> dict[str, bytes]:
    good = HEADER + b"".join(GOOD)
    body = b"".join(GOOD[:-1])
    torn = good + put("sensors/t3", b"18.0", stime=301)[:20]
    # one byte of config/mode's payload flipped: its CRC no longer matches
    i = good.index(b"auto")
    corrupt = good[:i] + b"aut0" + good[i + 4:]
    unknown = HEADER + body + record(0x5A, b"a future record type") + GOOD[-1]
    return {
        "good.ebrs": good,
        "empty.ebrs": HEADER,
        "torn_tail.ebrs": torn,
        "corrupt_record.ebrs": corrupt,
        "bad_magic.ebrs": b"EBRX" + good[4:],
        "future_version.ebrs": b"EBRS\x02\x00\x00\x00" + good[8:],
        "unknown_record.ebrs": unknown,
    }


def main(argv: list[str]) -> int:
    out = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent
    for name, data in files().items():
        (out / name).write_bytes(data)
        print(f"{name}: {len(data)} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
