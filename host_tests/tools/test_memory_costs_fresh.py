"""boards/memory_costs.json is refreshed whenever lib/ changes (issue 9):
`edgebroker config check` budgets every board from these figures, so
figures measured for another lib/ would make it wrong without a word."""

import hashlib
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_memory_costs_were_measured_for_this_lib():
    costs = json.loads((REPO / "boards" / "memory_costs.json").read_text())
    measured = costs["lib_sha256"]
    assert {"edgebroker.py", "edgestore.py"} <= set(measured)
    stale = [name for name, digest in sorted(measured.items())
             if hashlib.sha256((REPO / "lib" / name).read_bytes()).hexdigest() != digest]
    assert not stale, ("boards/memory_costs.json was measured for another lib/%s: "
                       "run `make measure-memory` and commit the file" % ", lib/".join(stale))
