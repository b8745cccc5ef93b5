"""Password entries of a profile's or secrets file's `users` map.

    entry = make_entry("s3cret")      # "pbkdf2_sha256:1000:<salt hex>:<key hex>"
    verify(entry, "s3cret")           # True

The one stored form the broker accepts besides plain text (lib/edgebroker.py
verifies it with the same hashlib.pbkdf2_hmac call, under MicroPython too):

    pbkdf2_sha256:<iterations>:<salt hex>:<derived key hex>
    derived key = hashlib.pbkdf2_hmac("sha256", password UTF-8, salt, iterations, dklen=32)

with a 16-byte random salt. A board computes it at every CONNECT that
carries a password, so the default iteration count is small (1000: a few
tens of milliseconds on an ESP32); `edgebroker passwd --iterations N`
allows MIN_ITERATIONS..MAX_ITERATIONS. A bare "sha256:<hex>" (unsalted, one
round) is refused by `config check`; plain text is accepted with a warning.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from typing import Final, Literal

SCHEME: Final = "pbkdf2_sha256"
DEFAULT_ITERATIONS: Final = 1000
MIN_ITERATIONS: Final = 100
MAX_ITERATIONS: Final = 100000
SALT_BYTES: Final = 16
KEY_BYTES: Final = 32
#: The unsalted form older profiles used; refused now.
BARE_SHA256: Final = "sha256:"

_ENTRY_RE: Final = re.compile(r"^pbkdf2_sha256:([0-9]+):([0-9a-fA-F]*):([0-9a-fA-F]*)$")

Kind = Literal["pbkdf2", "sha256", "plain"]


def derive(password: str, salt: bytes, iterations: int) -> bytes:
    """The derived key of the entry format."""
    return hashlib.pbkdf2_hmac("sha256", password.encode("utf-8"), salt, iterations, KEY_BYTES)


def make_entry(
    password: str, iterations: int = DEFAULT_ITERATIONS, salt: bytes | None = None
) -> str:
    """A salted, iterated entry for password (a fresh random salt unless given)."""
    if not MIN_ITERATIONS <= iterations <= MAX_ITERATIONS:
        raise ValueError(f"iterations {iterations}: must be {MIN_ITERATIONS}..{MAX_ITERATIONS}")
    salt = os.urandom(SALT_BYTES) if salt is None else salt
    key = derive(password, salt, iterations)
    return f"{SCHEME}:{iterations}:{salt.hex()}:{key.hex()}"


def kind(entry: str) -> Kind:
    """What a users value is: a pbkdf2 entry, a bare sha256 hash, or plain text."""
    if entry.startswith(SCHEME + ":"):
        return "pbkdf2"
    if entry.startswith(BARE_SHA256):
        return "sha256"
    return "plain"


def parse_entry(entry: str) -> tuple[int, bytes, bytes]:
    """(iterations, salt, derived key) of a pbkdf2 entry; ValueError says what is wrong."""
    m = _ENTRY_RE.match(entry)
    if m is None:
        raise ValueError(f"must be {SCHEME}:<iterations>:<salt hex>:<derived key hex>")
    iterations = int(m.group(1))
    if not MIN_ITERATIONS <= iterations <= MAX_ITERATIONS:
        raise ValueError(f"iterations {iterations}: must be {MIN_ITERATIONS}..{MAX_ITERATIONS}")
    salt, key = m.group(2), m.group(3)
    if len(salt) != 2 * SALT_BYTES:
        raise ValueError(f"salt of {len(salt)} hex digits: must be {2 * SALT_BYTES}")
    if len(key) != 2 * KEY_BYTES:
        raise ValueError(f"derived key of {len(key)} hex digits: must be {2 * KEY_BYTES}")
    return iterations, bytes.fromhex(salt), bytes.fromhex(key)


def verify(entry: str, password: str) -> bool:
    """True if password matches a pbkdf2 entry (False for any other entry)."""
    try:
        iterations, salt, key = parse_entry(entry)
    except ValueError:
        return False
    return hmac.compare_digest(derive(password, salt, iterations), key)
