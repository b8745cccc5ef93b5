# A tiny test runner for the MicroPython unix port (no pytest there):
#   micropython mp_runner.py LIBDIR module [module ...]
# runs every test_* function of each module and prints "N passed, N failed".
import sys

lib = sys.argv[1]
sys.path.insert(0, lib)
here = sys.argv[0].rsplit("/", 1)[0] if "/" in sys.argv[0] else "."
sys.path.insert(0, here)
passed = 0
failed = 0
for name in sys.argv[2:]:
    mod = __import__(name)
    for attr in sorted(dir(mod)):
        if not attr.startswith("test_"):
            continue
        try:
            getattr(mod, attr)()
            passed += 1
        except Exception as e:  # report and go on
            failed += 1
            print("FAIL %s.%s: %r" % (name, attr, e))
            sys.print_exception(e)
print("%d passed, %d failed" % (passed, failed))
sys.exit(1 if failed else 0)
