# userapp: your code beside the broker. An optional /app.py defines
#
#     async def main(broker): ...
#
# and runs as one asyncio task beside `await broker.serve_async()`, with the
# broker's local client (broker.publish / subscribe / unsubscribe, README
# "Your code on the gateway"). firmware/gateway.py runs it on a board;
# `edgebroker emulate --app FILE` runs the same module on a host.
#
# A crash of main() (an exception out of it, or out of importing app.py)
# never takes the broker down:
#   - its traceback goes to the console and broker.engine.app_errors grows
#     by one (the count local callbacks that raise also go to);
#   - main() is not started again until the next reset: a bug that raised
#     once raises again, and a restart loop would only fill the console.
#     Subscriptions main() made stay in place unless it unsubscribed in a
#     `finally` (the example app does);
#   - what it means for safe mode is the gateway's business (gateway.py:
#     a crash at boot counts, a later one does not).
# Tasks main() starts with asyncio.create_task() are its own: their
# exceptions reach nobody unless main() awaits them (asyncio.gather).
#
# Compiled to /lib/userapp.mpy by `edgebroker build`; imports neither
# `machine` nor `network`, so the emulator can run it.

import sys

try:  # only the type checker has typing; annotations are never evaluated
    from typing import Any, Callable
except ImportError:
    pass

MODULE = "app"  # /app.py: the board's filesystem root is on sys.path ("")


def print_exc(e: BaseException) -> None:
    """The traceback on the console (MicroPython), or stderr (CPython)."""
    pe = getattr(sys, "print_exception", None)
    if pe is not None:
        pe(e)
    else:
        __import__("traceback").print_exception(e)


async def run(
    broker: "Any", say: "Callable[[str], None]", module: str = MODULE
) -> "BaseException | None":
    """Import `module` and await its main(broker). Returns None when main()
    returned, or what it raised (already printed and counted). Cancellation
    and KeyboardInterrupt (Ctrl-C) pass through: they stop the gateway."""
    say("app: starting %s.py main()" % module)
    try:
        # imported here, in the task: the broker is listening already, and a
        # syntax error in app.py is a crash like any other
        mod = __import__(module)
        main = getattr(mod, "main", None)
        if main is None:
            raise AttributeError("%s.py has no main(broker)" % module)
        await main(broker)
    except (Exception, SystemExit) as e:  # SystemExit: a soft reset on a board
        broker.engine.app_errors += 1
        print_exc(e)
        say(
            "app: %s.py crashed (%r); the broker goes on, app errors %d"
            % (module, e, broker.engine.app_errors)
        )
        return e
    say("app: %s.py main() returned" % module)
    return None
