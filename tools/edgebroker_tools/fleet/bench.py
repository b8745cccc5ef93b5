"""`make bench-pipeline`: the fleet pipeline at scale, end to end, on synthetic data.

    python -m edgebroker_tools.fleet.bench [--sizes 20x10x2,1000x200x3,10000x200x3,20000x200x3]
        [--master local[2]] [--keep]

For each size (gateways x topics x collections), each step a fresh process
(a cold JVM, as a user would run it): `edgebroker fleet synth`, then
`edgebroker fleet build --master local[2]` into an empty warehouse, then
the floor job: a fresh Spark process that reads the same snapshots and
writes them unchanged as one Parquet table (the least any Spark job over
this input costs on this machine today). This machine's speed varies 2-4x
from day to day, so the targets are ratios to the floor (absolute times are
printed too): the 20-gateway build at most 2x the floor; the 10,000-gateway
build at most 2.5x; twice the input (20,000) at most 2.1x the time.
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

TARGET_SMALL: Final = 2.0  # 20 gateways: build / floor
TARGET_LARGE: Final = 2.5  # 10,000 gateways: build / floor
TARGET_SCALING: Final = 2.1  # 20,000 / 10,000 gateways: build time
DEFAULT_SIZES: Final = "20x10x2,1000x200x3,10000x200x3,20000x200x3"
_SYNTH_RE: Final = re.compile(r"synth: (\d+) retained rows \+ (\d+) \$SYS rows")


def _run(argv: list[str]) -> tuple[float, str]:
    start = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    seconds = time.monotonic() - start
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise SystemExit(f"bench-pipeline: {' '.join(argv[:3])} failed ({proc.returncode})")
    return seconds, proc.stdout


def floor_job(snapshots: str, out: str, master: str) -> int:
    """The floor: read the snapshots and write them unchanged as one Parquet table."""
    from edgebroker_tools.fleet import spark as fleet_spark

    session, _ = fleet_spark.session(master)
    try:
        session.read.option("recursiveFileLookup", "true").parquet(
            f"{snapshots}/retained"
        ).write.parquet(out)
    finally:
        session.stop()
    return 0


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
        [exe, "fleet", "build", "--snapshots", str(snaps), "--out", str(wh), "--master", master,
         "--no-progress"]
    )  # fmt: skip
    floor_s, _ = _run(
        [sys.executable, "-m", "edgebroker_tools.fleet.bench", "--floor", str(snaps),
         str(work / "floor"), "--master", master]
    )  # fmt: skip
    commits = sorted((wh / "_commits").glob("[0-9]*.json"))
    log = json.loads(commits[-1].read_text())["build"] if commits else {}
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
        "floor_s": round(floor_s, 1),
        "build_over_floor": round(build_s / floor_s, 2),
        "build_job_s": log.get("seconds"),
        "steps": log.get("steps"),
        "end_to_end_s": round(total, 1),
        "build_rows_per_s": round(rows / build_s),
        "end_to_end_rows_per_s": round(rows / total),
        "tables": log.get("rows"),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench-pipeline", description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="GATEWAYSxTOPICSxCOLLECTIONS,...")
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--keep", action="store_true", help="keep the data of the last size")
    parser.add_argument("--floor", nargs=2, metavar=("SNAPSHOTS", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.floor:
        return floor_job(str(args.floor[0]), str(args.floor[1]), str(args.master))
    sizes = [tuple(int(x) for x in s.lower().split("x")) for s in str(args.sizes).split(",") if s]
    root = runner.repo_root()
    work = root / "build" / "bench-pipeline"
    results: list[dict[str, Any]] = []
    print(
        f"{'gateways x topics x coll':>24} {'rows':>11} {'synth s':>8} {'build s':>8} "
        f"{'floor s':>8} {'build/floor':>11} {'e2e s':>7} {'build rows/s':>13}",
        flush=True,
    )
    for g, t, k in sizes:
        r = run_size(work, g, t, k, args.master)
        results.append(r)
        rows = r["retained_rows"] + r["sys_rows"]
        print(
            f"{f'{g:,} x {t} x {k}':>24} {rows:>11,} {r['synth_s']:>8} {r['build_s']:>8} "
            f"{r['floor_s']:>8} {r['build_over_floor']:>10}x {r['end_to_end_s']:>7} "
            f"{r['build_rows_per_s']:>13,}",
            flush=True,
        )
        print(f"      steps: {r['steps']}", flush=True)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    by = {r["gateways"]: r for r in results}
    verdict: dict[str, Any] = {}

    def check(name: str, value: float, target: float) -> None:
        verdict[name] = {"value": value, "target": target, "ok": value <= target}
        print(
            f"{name}: {value:.2f}x (target <= {target}x): "
            + ("ok" if value <= target else "MISSED")
        )

    if 20 in by:
        check("20 gateways build / floor", by[20]["build_over_floor"], TARGET_SMALL)
    if 10_000 in by:
        check("10,000 gateways build / floor", by[10_000]["build_over_floor"], TARGET_LARGE)
        if 20_000 in by:
            check(
                "20,000 / 10,000 gateways build time",
                round(by[20_000]["build_s"] / by[10_000]["build_s"], 2),
                TARGET_SCALING,
            )
    out = root / "bench-results" / "fleet-pipeline.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"results": results, "verdict": verdict}, indent=2) + "\n")
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
