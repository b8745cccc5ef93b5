# main.py: runs after boot.py on a reset or a Ctrl-D at the REPL. It starts
# the gateway (/lib/gateway.mpy): Wi-Fi, clock, watchdog, retained store and
# the broker, with a safe mode that breaks boot loops (see firmware/gateway.py).
# Ctrl-C stops the broker and leaves the board at the REPL.
try:
    import gateway
except Exception as e:  # a missing or damaged /lib/gateway.mpy: stay at the REPL
    import sys

    sys.print_exception(e)
    print("edgebroker: cannot import gateway (%r): run `edgebroker flash` again" % (e,))
else:
    gateway.main()
