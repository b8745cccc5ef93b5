# Run by host_tests/standin_board.py as `micropython -i prelude.py` at every
# (re)start of the stand-in board: it turns the unix port into a board.
#
#   1. `machine`, `network`, `ntptime` become the stand-ins in this folder
#      (loaded while the host filesystem is still visible, then registered in
#      sys.modules, so they stay importable after step 2).
#   2. `/` becomes the board's filesystem: the VfsPosix mounted at / is
#      replaced by one rooted at $STANDIN_ROOT (a temporary directory), so
#      open("/board.json"), os.listdir("/") and mpremote see only the sandbox.
#   3. sys.path becomes a board's: ["", ".frozen", "/lib"].
#   4. /boot.py runs, then /main.py unless $STANDIN_MODE is "raw" (a board
#      does not run main.py after a soft reset made from the raw REPL).
#      Exceptions are printed as a board prints them; then `-i` gives the REPL.
import os
import sys

import vfs


def _standin_boot():
    import socket

    ctl = int(os.getenv("STANDIN_CTL") or "0")
    if ctl:  # MicroPython runs: from now on a Ctrl-C can become KeyboardInterrupt
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.sendto(b"up", socket.getaddrinfo("127.0.0.1", ctl)[0][-1])
        s.close()
    fakes = os.getenv("STANDIN_FAKES")
    root = os.getenv("STANDIN_ROOT")
    mode = os.getenv("STANDIN_MODE") or "normal"
    sys.path.insert(0, fakes)
    import fake_machine
    import fake_network
    import fake_ntptime

    sys.modules["machine"] = fake_machine
    sys.modules["network"] = fake_network
    sys.modules["ntptime"] = fake_ntptime
    for name in ("fake_machine", "fake_network", "fake_ntptime"):
        del sys.modules[name]
    vfs.umount("/")
    vfs.mount(vfs.VfsPosix(root), "/")
    os.chdir("/")
    sys.path[:] = ["", ".frozen", "/lib"]
    scripts = ("boot.py",) if mode == "raw" else ("boot.py", "main.py")
    for name in scripts:
        try:
            f = open(name)
        except OSError:
            continue
        with f:
            source = f.read()
        try:
            exec(compile(source, name, "exec"), globals())
        except SystemExit:
            raise  # a board soft-resets: the bridge restarts us
        except BaseException as e:  # KeyboardInterrupt included: then the REPL
            sys.print_exception(e)


_standin_boot()
del _standin_boot
