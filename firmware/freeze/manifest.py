# Freeze the broker into a MicroPython firmware image: its bytecode then runs
# from flash and costs no heap for code (README, "Boards and profiles": the
# three ways to load the broker and what each costs). From a MicroPython
# source tree, for example:
#
#   make -C ports/esp32 BOARD=ESP32_GENERIC FROZEN_MANIFEST=$EDGEBROKER/firmware/freeze/manifest.py
#   make -C ports/rp2 BOARD=RPI_PICO_W FROZEN_MANIFEST=$EDGEBROKER/firmware/freeze/manifest.py
#
# The port's own manifest comes first (asyncio, network helpers, ...). boot.py
# and main.py stay on the filesystem (`edgebroker flash` copies them, with the
# profile, the secrets and your app), and the frozen modules are found before
# any .mpy of the same name there. Set "frozen": true in the board profile:
# `config check` then counts what frozen modules keep (their module objects;
# bytecode, strings and names stay in flash), and `edgebroker build` and
# `flash` ship none of the modules this file freezes.
include("$(PORT_DIR)/boards/manifest.py")

# the broker and its profile check (always), its flash or RAM store,
# passwords and ACLs, and its bridge (imported only when the profile uses
# them: frozen, they cost flash, not heap)
module("edgebroker.py", base_path="../../lib")
module("edgeconf.py", base_path="../../lib")
module("edgestore.py", base_path="../../lib")
module("edgeopen.py", base_path="../../lib")
module("edgeram.py", base_path="../../lib")
module("edgeauth.py", base_path="../../lib")
module("edgebridge.py", base_path="../../lib")

# the gateway: Wi-Fi, clock, watchdog, safe mode, and the user app runner
# (gwboot: its boot steps, dropped once the broker serves)
module("gateway.py", base_path="..")
module("gwboot.py", base_path="..")
module("userapp.py", base_path="..")
