"""`make bench-pipeline`: the fleet pipeline at scale, end to end, on synthetic data.

    python -m edgebroker_tools.fleet.bench [--gateways 10000] [--topics 200]
        [--snapshots 3] [--sizes 0.5,1,2] [--master local[2]] [--keep]

For each size factor f: `edgebroker fleet synth` with f x gateways, then
`edgebroker fleet build --master local[2]` into an empty warehouse, each a
fresh process (a cold JVM, as a user would run it). Reported per size:
rows (retained + $SYS), synth seconds, build seconds (including Spark's
start), end to end, and rows/s. Targets (this 2-core machine): the full
size end to end <= 120 s; double the input <= 2.2 x the full size's time.
Results: bench-results/fleet-pipeline.json.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from edgebroker_tools import runner

TARGET_SECONDS: Final = 120.0
TARGET_SCALING: Final = 2.2
_SYNTH_RE: Final = re.compile(r"synth: (\d+) retained rows \+ (\d+) \$SYS rows")


def _run(argv: list[str]) -> tuple[float, str]:
    start = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    seconds = time.monotonic() - start
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise SystemExit(f"bench-pipeline: {' '.join(argv[:3])} failed ({proc.returncode})")
    return seconds, proc.stdout


def run_size(work: Path, gateways: int, topics: int, snapshots: int, master: str) -> dict[str, Any]:
    exe = str(Path(sys.executable).parent / "edgebroker")
    snaps, wh = work / "snapshots", work / "warehouse"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    synth_s, out = _run(
        [exe, "fleet", "synth", "--gateways", str(gateways), "--topics", str(topics),
         "--snapshots", str(snapshots), "--out", str(snaps)]
    )  # fmt: skip
    m = _SYNTH_RE.search(out)
    retained, sys_rows = (int(m.group(1)), int(m.group(2))) if m else (0, 0)
    build_s, out = _run(
        [exe, "fleet", "build", "--snapshots", str(snaps), "--out", str(wh), "--master", master]
    )
    log = json.loads((wh / "_build.json").read_text())
    rows = retained + sys_rows
    total = synth_s + build_s
    return {
        "gateways": gateways,
        "topics": topics,
        "snapshots": snapshots,
        "retained_rows": retained,
        "sys_rows": sys_rows,
        "synth_s": round(synth_s, 1),
        "build_s": round(build_s, 1),
        "build_job_s": log.get("seconds"),
        "steps": log.get("steps"),
        "end_to_end_s": round(total, 1),
        "build_rows_per_s": round(rows / build_s),
        "end_to_end_rows_per_s": round(rows / total),
        "tables": log.get("rows"),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench-pipeline", description=__doc__.split("\n")[0])
    parser.add_argument("--gateways", type=int, default=10_000)
    parser.add_argument("--topics", type=int, default=200)
    parser.add_argument("--snapshots", type=int, default=3)
    parser.add_argument("--sizes", default="0.5,1,2", help="factors of --gateways")
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--keep", action="store_true", help="keep the data of the last size")
    args = parser.parse_args(argv)
    factors = [float(f) for f in str(args.sizes).split(",") if f.strip()]
    root = runner.repo_root()
    work = root / "build" / "bench-pipeline"
    results: list[dict[str, Any]] = []
    print(
        f"{'size':>5} {'gateways':>9} {'rows':>11} {'synth s':>8} {'build s':>8} "
        f"{'total s':>8} {'build rows/s':>13} {'e2e rows/s':>11}",
        flush=True,
    )
    for f in factors:
        r = run_size(work, int(args.gateways * f), args.topics, args.snapshots, args.master)
        r["factor"] = f
        results.append(r)
        rows = r["retained_rows"] + r["sys_rows"]
        print(
            f"{f:>5g} {r['gateways']:>9} {rows:>11,} {r['synth_s']:>8} {r['build_s']:>8} "
            f"{r['end_to_end_s']:>8} {r['build_rows_per_s']:>13,} "
            f"{r['end_to_end_rows_per_s']:>11,}",
            flush=True,
        )
        print(f"      steps: {r['steps']}", flush=True)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    by = {r["factor"]: r for r in results}
    verdict: dict[str, Any] = {}
    if 1.0 in by:
        full = by[1.0]["end_to_end_s"]
        verdict["full_end_to_end_s"] = full
        verdict["full_within_target"] = full <= TARGET_SECONDS
        print(f"full size end to end {full} s (target <= {TARGET_SECONDS:g} s): "
              + ("ok" if full <= TARGET_SECONDS else "MISSED"))  # fmt: skip
        if 2.0 in by:
            ratio = by[2.0]["end_to_end_s"] / full
            build_ratio = by[2.0]["build_s"] / by[1.0]["build_s"]
            verdict["double_over_full"] = round(ratio, 2)
            verdict["double_over_full_build_only"] = round(build_ratio, 2)
            verdict["scaling_within_target"] = ratio <= TARGET_SCALING
            print(f"double / full: {ratio:.2f}x end to end, {build_ratio:.2f}x build "
                  f"(target <= {TARGET_SCALING}x): "
                  + ("ok" if ratio <= TARGET_SCALING else "MISSED"))  # fmt: skip
    out = root / "bench-results" / "fleet-pipeline.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"results": results, "verdict": verdict}, indent=2) + "\n")
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
