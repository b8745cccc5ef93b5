# edgeauth: passwords and topic ACLs of edgebroker. A module of its own so
# that a board whose profile does not authenticate (anonymous clients, no
# users, no acl: a closed network) does not hold this code in its heap. The
# same file runs on MicroPython and CPython; it does not look at which: the
# broker's compat block does, and what this module needs of it comes from
# there. Nothing happens at import; the broker imports it for a profile with
# users, an acl or allow_anonymous false (load_modules() and the Engine:
# edgebroker._auth_needed; limits() to check an acl).
from edgebroker import const, topic_matches, valid_filter

# Topic ACLs: rule access as bits; a deny rule wins over any allow.
_ACL_ACCESS = {"read": 1, "write": 2, "readwrite": 3, "deny": 4}
_ACL_MAX = const(1000)


def check_acl(rules):
    # the profile's acl: ValueError naming the rule, its key and what is allowed
    if len(rules) > _ACL_MAX:
        raise ValueError("acl: %d rules (allowed at most %d)" % (len(rules), _ACL_MAX))
    for n, r in enumerate(rules):
        w = "acl[%d]" % n
        if not isinstance(r, dict):
            raise ValueError("%s: %r is not an object" % (w, r))
        for k in r:
            if k not in ("who", "access", "topic"):
                raise ValueError("%s.%s: unknown key (allowed who, access, topic)" % (w, k))
        who = r.get("who")
        if not isinstance(who, str) or not (
            who in ("all", "anonymous") or who[:5] == "user:" or who[:7] == "client:"
        ):
            raise ValueError(
                '%s.who: %r (allowed "all", "anonymous", "user:NAME", "client:ID")' % (w, who)
            )
        if r.get("access") not in _ACL_ACCESS:
            raise ValueError(
                "%s.access: %r (allowed read, write, readwrite, deny)" % (w, r.get("access"))
            )
        t = r.get("topic")
        if not isinstance(t, str) or not valid_filter(t.replace("%c", "c").replace("%u", "u")):
            raise ValueError("%s.topic: %r is not a topic filter (%%c, %%u allowed)" % (w, t))


def check_password(want, pw):
    """A users entry against the password bytes a CONNECT carried.
    Entries (made by `edgebroker passwd`):
      pbkdf2_sha256:<iterations>:<salt hex>:<key hex>   salted, iterated
      sha256:<hex>     bare digest: still read, refused by config check
      anything else    plain text: read, warned about by config check"""
    import binascii
    import hashlib

    if want.startswith("pbkdf2_sha256:"):
        parts = want.split(":")
        if len(parts) != 4:
            return False
        try:
            n = int(parts[1])
            salt = binascii.unhexlify(parts[2])
            key = binascii.unhexlify(parts[3])
        except ValueError:
            return False
        if not 1 <= n <= 1000000 or len(key) != 32:
            return False
        return _pbkdf2_sha256(pw, salt, n) == key
    if want.startswith("sha256:"):
        return binascii.hexlify(hashlib.sha256(pw).digest()).decode() == want[7:].lower()
    return pw == want.encode()


def _pbkdf2_sha256(pw, salt, n):
    # PBKDF2-HMAC-SHA256 (RFC 8018), one 32-byte block: MicroPython has
    # sha256 but no hmac or pbkdf2_hmac. The XOR of the n blocks runs on
    # one big integer instead of 32 bytes at a time.
    import hashlib

    if len(pw) > 64:
        pw = hashlib.sha256(pw).digest()
    k = pw + bytes(64 - len(pw))
    ipad = bytes(x ^ 0x36 for x in k)
    opad = bytes(x ^ 0x5C for x in k)
    sha = hashlib.sha256
    u = sha(opad + sha(ipad + salt + b"\x00\x00\x00\x01").digest()).digest()
    acc = int.from_bytes(u, "big")
    for _ in range(n - 1):
        u = sha(opad + sha(ipad + u).digest()).digest()
        acc ^= int.from_bytes(u, "big")
    return acc.to_bytes(32, "big")


def acl_for(rules, cid, user):
    """The profile's acl rules for one client, expanded once at CONNECT
    (%c: client id, %u: user name): [(access bits, filter levels)] of the
    rules that name it. A rule whose %c or %u would bring a wildcard or a
    level separator in is left out (it allows nothing)."""
    out = []
    for r in rules:
        who = r["who"]
        if not (
            who == "all"
            or (who == "anonymous" and user is None)
            or (user is not None and who[:5] == "user:" and who[5:] == user)
            or (who[:7] == "client:" and who[7:] == cid)
        ):
            continue
        t = r["topic"]
        if "%u" in t and (user is None or "/" in user or "+" in user or "#" in user):
            continue
        if "%c" in t and ("/" in cid or "+" in cid or "#" in cid):
            continue
        # one pass: a "%c" inside the user name stays as it is (expanded
        # again, the client id it chose would pick another user's topics)
        t = (user or "").join([p.replace("%c", cid) for p in t.split("%u")])
        out.append((_ACL_ACCESS[r["access"]], t.split("/")))
    return out


def may(acl, topic, want):
    # want: 1 read, 2 write; any matching deny rule wins. By index: a
    # for loop's iterator would put this frame on MicroPython's heap
    # (12-14 us a call with three rules, 7 us so; docs/boards.md)
    ok = False
    j = 0
    n = len(acl)
    while j < n:
        r = acl[j]
        j += 1
        if topic_matches(r[1], topic):
            if r[0] & 4:
                return False
            if r[0] & want:
                ok = True
    return ok
