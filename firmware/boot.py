# boot.py: the first thing a board runs after every reset and soft reset,
# including the soft resets mpremote makes before its commands. Keep it tiny:
# a mistake here runs on every boot and can lock mpremote out. Everything
# else happens in main.py (which mpremote's raw-REPL resets do not run).
import gc

import micropython

try:  # room for a traceback raised inside an interrupt (the watchdog's timer)
    micropython.alloc_emergency_exception_buf(128)
except AttributeError:  # ports without it (the unix port)
    pass
gc.collect()
