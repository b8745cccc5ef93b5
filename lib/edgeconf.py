# edgeconf: the board profile's keys as edgebroker reads them: each key's
# default and allowed values, the check of a profile, and the merge of a
# secrets file. Boot-only: limits() and with_secrets() import it when a
# broker is built, and load_modules() drops it again, so its bytecode
# (3.4 KB on a 32-bit board) is not heap while the broker runs. It imports
# nothing of the broker (edgeauth only, to check an acl) and runs unchanged
# on MicroPython and CPython. Nothing happens at import.

# Every limit a board profile may set: key -> default. README.md and
# boards/schema.json document unit and consequence; the tools validate.
DEFAULTS = {
    "board": "host",
    "max_clients": 16,
    "max_packet_size": 16384,
    "max_subscriptions": 32,
    "max_topic_length": 256,
    "max_topic_levels": 16,
    "max_inflight": 16,
    "max_queued": 64,
    "max_queued_bytes": 1048576,
    "max_queued_total": 0,
    "slow_consumer_timeout": 30,
    "max_user_properties": 64,
    "max_outbuf": 16384,
    "max_sessions": 32,
    "topic_alias_maximum": 10,
    "server_keep_alive": 0,
    "max_keepalive": 0,
    "max_session_expiry": 86400,
    "maximum_qos": 2,
    "heap_reserve": 16384,
    "allow_anonymous": True,
    "users": {},
    "acl": [],
    "tls_cert": "",
    "tls_key": "",
    "tls_client_ca": "",
    "retain_available": True,
    "max_retained_messages": 1000,
    "max_payload_size": 4096,
    "expiry_interval": 0,
    "store_budget_bytes": 262144,
    "storage_type": "ram",
    "compact_ratio": 0.5,
    "compact_min_bytes": 4096,
    "sys_interval": 10,
    "backlog": 16,
    "io_chunk": 4096,
    "connect_timeout": 10,
    "log_level": "info",
    "bridges": [],
}


# Allowed values of each limit (boards/schema.json says the same, with units
# and consequences; the tools check profiles against it before a board sees
# them). Numbers: (min, max); strings: the allowed words.
_RANGES = {
    "max_clients": (1, 65535),
    "max_packet_size": (128, 268435460),
    "max_subscriptions": (1, 65535),
    "max_topic_length": (1, 65535),
    "max_topic_levels": (1, 65535),
    "max_inflight": (1, 65535),
    "max_queued": (1, 1000000),
    "max_outbuf": (256, 268435456),
    "max_queued_bytes": (1024, 1073741824),
    "max_queued_total": (0, 100000000),
    "slow_consumer_timeout": (1, 86400),
    "max_user_properties": (0, 65535),
    "max_sessions": (0, 1000000),
    "topic_alias_maximum": (0, 65535),
    "server_keep_alive": (0, 65535),
    "max_keepalive": (0, 65535),
    "max_session_expiry": (0, 4294967295),
    "maximum_qos": (0, 2),
    "heap_reserve": (0, 1073741824),
    "max_retained_messages": (0, 1000000),
    "max_payload_size": (0, 268435455),
    "expiry_interval": (0, 4294967295),
    "store_budget_bytes": (0, 1099511627776),
    "compact_ratio": (0.05, 0.95),
    "compact_min_bytes": (0, 1073741824),
    "sys_interval": (0, 86400),
    "backlog": (1, 4096),
    "io_chunk": (256, 1048576),
    "connect_timeout": (1, 3600),
    "storage_type": ("ram", "disc", "disc_only"),
    "log_level": ("debug", "info", "warning", "error"),
}


def limits(profile=None):
    """The effective limits: DEFAULTS overridden by a profile dict. Only
    the keys the broker reads are kept (a profile also carries board facts
    for the host tools, which reject unknown keys). A bad value raises
    ValueError naming the key, the value and what is allowed."""
    cfg = dict(DEFAULTS)
    if profile is not None and not isinstance(profile, dict):
        raise ValueError("profile: %r is not an object" % (profile,))
    if profile:
        for k in DEFAULTS:
            if k in profile:
                cfg[k] = _checked(k, profile[k])
    users = cfg["users"]
    for u in users:
        if not isinstance(users[u], str):
            raise ValueError("users.%s: %r is not a string (a password entry)" % (u, users[u]))
    for k in ("tls_client_ca", "tls_key"):
        if cfg[k] and not cfg["tls_cert"]:
            # both are used only by a TLS listener, which tls_cert makes
            raise ValueError("%s: %r needs tls_cert (a TLS listener)" % (k, cfg[k]))
    if cfg["acl"]:
        import edgeauth

        edgeauth.check_acl(cfg["acl"])
    return cfg


def with_secrets(profile, secrets):
    """The profile with a secrets file's credentials merged in (the board's
    /secrets.json, the host's --secrets FILE), so that passwords stay out of
    profiles that are shared or committed: "users" adds to (and overrides)
    the profile's users; "bridges": {"<name>": {"username", "password"}}
    fills in the bridge of that name. A name the profile has no bridge for,
    or a value that is not a string, raises ValueError naming the key."""
    if not secrets:
        return profile
    if not isinstance(secrets, dict):
        raise ValueError("secrets: %r is not an object" % (secrets,))
    out = dict(profile or {})
    users = secrets.get("users")
    if users:
        if not isinstance(users, dict):
            raise ValueError("secrets users: %r is not an object" % (users,))
        merged = dict(out.get("users") or {})
        merged.update(users)
        out["users"] = merged
    creds = secrets.get("bridges")
    if creds:
        if not isinstance(creds, dict):
            raise ValueError("secrets bridges: %r is not an object" % (creds,))
        items = out.get("bridges")
        items = [dict(b) if isinstance(b, dict) else b for b in items or ()]
        for name in creds:
            w = "secrets bridges.%s" % name
            c = creds[name]
            if not isinstance(c, dict):
                raise ValueError("%s: %r is not an object" % (w, c))
            found = None
            for b in items:
                if isinstance(b, dict) and b.get("name") == name:
                    found = b
            if found is None:
                have = [b.get("name") for b in items if isinstance(b, dict)]
                raise ValueError(
                    "%s: the profile has no bridge named %r (it has %s)"
                    % (w, name, ", ".join(repr(n) for n in have) or "none")
                )
            for k in c:
                if k not in ("username", "password"):
                    raise ValueError("%s.%s: unknown key (allowed username, password)" % (w, k))
                if not isinstance(c[k], str):
                    raise ValueError("%s.%s: %r is not a string" % (w, k, c[k]))
                found[k] = c[k]
        out["bridges"] = items
    return out


def _checked(k, v):
    d = DEFAULTS[k]
    r = _RANGES.get(k)
    if isinstance(d, bool):
        if not isinstance(v, bool):
            raise ValueError("%s: %r is not true or false" % (k, v))
    elif isinstance(d, (int, float)):
        ok = isinstance(v, (int, float)) if isinstance(d, float) else isinstance(v, int)
        if not ok or isinstance(v, bool) or not r[0] <= v <= r[1]:
            raise ValueError("%s: %r (allowed %s..%s)" % (k, v, r[0], r[1]))
    elif isinstance(d, dict):
        if not isinstance(v, dict):
            raise ValueError("%s: %r is not an object" % (k, v))
    elif isinstance(d, list):
        if not isinstance(v, list):
            raise ValueError("%s: %r is not a list" % (k, v))
    elif r is not None and v not in r:
        raise ValueError("%s: %r (allowed %s)" % (k, v, ", ".join(r)))
    elif not isinstance(v, str):
        raise ValueError("%s: %r is not a string" % (k, v))
    return v
