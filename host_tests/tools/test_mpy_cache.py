"""runner.compile_mpy caches .mpy files by the source's content: a file of
the same name with other content (EDGEBROKER_LIB, an older checkout) is
compiled again even when the cached .mpy is newer than it. (The cache once
went by mtime, and a benchmark of an older lib left its bytecode to the next
run of the current one.)"""

import os
import subprocess
import sys
from pathlib import Path

from edgebroker_tools import runner


def _run(mpy):
    mp = Path(sys.executable).parent / "micropython"
    code = "import sys\nsys.path.insert(0, %r)\nimport mod\nprint(mod.X)\n" % str(mpy.parent)
    return subprocess.run([str(mp), "-c", code], capture_output=True, text=True,
                          timeout=60).stdout.strip()


def test_same_name_other_content_is_compiled_again(tmp_path):
    out = tmp_path / "out"
    a = tmp_path / "a" / "mod.py"
    b = tmp_path / "b" / "mod.py"
    a.parent.mkdir()
    b.parent.mkdir()
    a.write_text("X = 'first'\n")
    b.write_text("X = 'second'\n")
    os.utime(b, (1_000_000_000, 1_000_000_000))  # older than any cached file
    assert _run(runner.compile_mpy(a, out)) == "first"
    assert _run(runner.compile_mpy(b, out)) == "second"
    assert _run(runner.compile_mpy(a, out)) == "first"
