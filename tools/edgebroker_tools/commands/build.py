"""`edgebroker build BOARD`: what a board's filesystem gets, in dist/<board>/.

    dist/<board>/boot.py, main.py      firmware/ entry points, kept as source
    dist/<board>/board.json            the profile (with --set overrides)
    dist/<board>/lib/*.mpy             lib/*.py and the other firmware/*.py, mpy-cross'ed
    dist/<board>/romfs.img             profile "romfs": true: lib/ as a ROMFS image
                                       (profile "frozen": true: no module that
                                       firmware/freeze/manifest.py freezes)
    dist/<board>/manifest.json         what was built from what (flash reads it)

Bytecode loaded from a filesystem stays in RAM, so its size is checked
against the profile's code_budget_bytes: over budget, the build says so and
exits 1 (flash refuses such a build). With ROMFS (MicroPython 1.25+) the
bytecode runs from flash instead; the budget still applies (it bounds the
image, which must fit the board's ROMFS partition).

BOARD is a profile name (boards/<name>.json) or a path to a JSON file. The
profile with its --set overrides goes through the checker of `config check`
first: any error is one line (key, value, allowed range) and exit 2, and
nothing is built; its warnings are printed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, cast

from edgebroker_tools import __version__, profiles, runner
from edgebroker_tools.commands import CommandError, add_set_option

if TYPE_CHECKING:
    from edgebroker_tools.commands import Subparsers

MANIFEST: Final = "manifest.json"
ROMFS_IMAGE: Final = "romfs.img"
PROFILE_FILE: Final = "board.json"
#: firmware/ files that stay source: the board runs them by name at boot.
ENTRY_POINTS: Final = ("boot.py", "main.py")
#: What the .mpy header says this mpy-cross emits (byte 1); boards must match.
EXIT_OVER_BUDGET: Final = 1


@dataclass(frozen=True)
class Target:
    """A board profile to build for: its file, name and (overridden) content."""

    path: Path
    name: str
    profile: dict[str, Any]
    warnings: tuple[str, ...] = ()  # `config check` warnings of the profile
    lines: bool = False  # --lines: keep line numbers in the bytecode (more heap)


@dataclass(frozen=True)
class Source:
    """One file of the board image: where it comes from and where it goes."""

    source: Path
    remote: str  # path on the board, relative to / ("lib/edgebroker.mpy")

    @property
    def compiled(self) -> bool:
        return self.remote.endswith(".mpy")


@dataclass
class Built:
    """One built file in dist/<board>/."""

    remote: str
    size: int
    sha256: str
    source_size: int | None = None


@dataclass
class BuildResult:
    target: Target
    out_dir: Path
    files: list[Built] = field(default_factory=list)
    bytecode_bytes: int = 0
    budget: int | None = None
    romfs_bytes: int | None = None
    mpy_version: int = 0
    rebuilt: bool = True

    @property
    def over_budget(self) -> bool:
        """Bytecode over code_budget_bytes when it is loaded into RAM. From
        ROMFS only the module objects take heap: `edgebroker config check`
        weighs that (measured costs), so a ROMFS build never fails here."""
        if self.romfs_bytes is not None:
            return False
        return self.budget is not None and self.bytecode_bytes > self.budget


# ------------------------------------------------------------------ targets
def parse_value(text: str) -> Any:
    """A --set value: JSON if it parses, else the string (as the broker does);
    JSON past the reader's limits is a ProfileError (profiles.parse_override)."""
    return profiles.parse_override(f"value={text}")[1]


def resolve_board(arg: str) -> Path:
    """A board name (boards/<name>.json in the repo) or a path to a profile."""
    return profiles.resolve_board(arg)


def load_target(arg: str, overrides: Sequence[str] = (), *, lines: bool = False) -> Target:
    """The profile with its overrides, checked by the checker of `config
    check` (profiles.load_checked): a board never gets a profile that check
    refuses. Raises ProfileError (one line: key, value, allowed range)."""
    checked = profiles.load_checked(arg, overrides)
    warnings = tuple(str(i) for i in checked.report.warnings)
    return Target(checked.path, checked.name, checked.profile, warnings, lines)


#: Library modules a board gets only when its profile uses them (the
#: modules edgebroker.load_modules() imports, and config check counts:
#: profiles.modules_for): code is heap on a board without ROMFS, so what a
#: profile does not use is not shipped. A key the profile leaves out has
#: the broker's default (storage_type "ram", no bridges).
OPTIONAL_MODULES: Final = ("edgestore", "edgeopen", "edgeram", "edgeauth", "edgebridge")


def _wanted(stem: str, profile: Mapping[str, Any] | None) -> bool:
    if stem not in OPTIONAL_MODULES:
        return True
    cfg = dict(profile or {})
    cfg.setdefault("storage_type", "ram")
    cfg.setdefault("bridges", [])
    return stem in profiles.shipped_modules(cfg)


#: The firmware build's freeze manifest: its module("X.py") lines name what
#: a `"frozen": true` board has in its firmware already.
FREEZE_MANIFEST: Final = Path("firmware") / "freeze" / "manifest.py"
_FROZEN_RE: Final = re.compile(r'^\s*module\(\s*"([A-Za-z_][A-Za-z0-9_]*)\.py"', re.MULTILINE)


def frozen_modules() -> frozenset[str]:
    """The modules firmware/freeze/manifest.py freezes (by stem)."""
    text = (runner.repo_root() / FREEZE_MANIFEST).read_text(encoding="utf-8")
    return frozenset(_FROZEN_RE.findall(text))


def sources(profile: Mapping[str, Any] | None = None) -> list[Source]:
    """The files a board gets, in copy order: library modules first, the
    entry points last (a board reset half-way finds no main.py rather than
    a main.py without its modules). An optional module (OPTIONAL_MODULES)
    only when `profile` uses it; with `"frozen": true` none of the modules
    the freeze manifest puts in the firmware (found there before /lib)."""
    root = runner.repo_root()
    frozen = frozen_modules() if profile is not None and profile.get("frozen") is True else ()
    mods = [
        p
        for p in sorted((root / "lib").glob("*.py"))
        if _wanted(p.stem, profile) and p.stem not in frozen
    ]
    fw = sorted(
        p
        for p in (root / "firmware").glob("*.py")
        if p.name not in ENTRY_POINTS and p.stem not in frozen
    )
    seen: set[str] = set()
    out: list[Source] = []
    for p in [*mods, *fw]:
        remote = f"lib/{p.stem}.mpy"
        if remote in seen:
            raise CommandError(
                f"two modules named {p.stem}: lib/ and firmware/ must not share names"
            )
        seen.add(remote)
        out.append(Source(p, remote))
    for name in ENTRY_POINTS:
        p = root / "firmware" / name
        if not p.is_file():
            raise CommandError(f"missing {p}")
        out.append(Source(p, name))
    return out


def profile_bytes(target: Target) -> bytes:
    return (json.dumps(target.profile, indent=2, sort_keys=True) + "\n").encode()


def uses_romfs(target: Target) -> bool:
    return target.profile.get("romfs") is True


def mpy_cross_version() -> str:
    exe = runner.mpy_cross_executable()
    res = subprocess.run([str(exe), "--version"], capture_output=True, text=True, check=False)
    return res.stdout.strip() or res.stderr.strip()


def inputs_digest(target: Target, files: Sequence[Source]) -> str:
    """What a build depends on: sources, profile, --lines, mpy-cross and tool versions."""
    h = hashlib.sha256()
    h.update(f"edgebroker-tools {__version__}\n{mpy_cross_version()}\n".encode())
    h.update(f"-O{opt_level(target)}\n".encode())
    h.update(profile_bytes(target))
    for s in files:
        h.update(f"\0{s.remote}\0".encode())
        h.update(s.source.read_bytes())
    return h.hexdigest()


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------ building
def opt_level(target: Target) -> int:
    """runner.BOARD_OPT (no line numbers), or 0 for a --lines build."""
    return 0 if target.lines else runner.BOARD_OPT


def compile_mpy(source: Path, target: Path, opt: int = runner.BOARD_OPT) -> None:
    """mpy-cross one module's board build (runner.board_source: host-only
    blocks blanked, the other lines where they were) at level `opt`."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        text = runner.board_source(source.read_text(), str(source))
        runner.mpy_cross_text(text.encode(), source.name, target, opt)
    except runner.RunnerError as e:
        raise CommandError(str(e)) from None


def mpy_major(path: Path) -> int:
    """The .mpy format version in the header (b"M", version, flags, ...)."""
    head = path.read_bytes()[:4]
    if len(head) < 4 or head[0:1] != b"M":
        raise CommandError(f"{path} is not a .mpy file")
    return head[1]


def check_dist(dist_root: Path) -> None:
    """--dist: a directory, or a path where one can be made (`build` and
    `flash`, before anything is built or run). One line otherwise."""
    allowed = "must be a directory, or a path where one can be made"
    for parent in (dist_root, *dist_root.parents):
        try:
            exists = parent.exists()
        except OSError as exc:  # e.g. a parent that cannot be searched
            raise CommandError(f"--dist {dist_root}: {exc.strerror or exc}; {allowed}") from None
        if exists:
            if not parent.is_dir():
                what = "is" if parent == dist_root else f"is inside {parent}, which is"
                raise CommandError(f"--dist {dist_root}: {what} a file, not a directory; {allowed}")
            return


def prepare_out_dir(out_dir: Path) -> None:
    """Empty dist/<board>/ (a renamed module must not linger), but only a
    directory an earlier build made."""
    try:
        if out_dir.exists():
            if not out_dir.is_dir():
                raise CommandError(f"{out_dir} exists and is not a directory")
            if any(out_dir.iterdir()) and not (out_dir / MANIFEST).is_file():
                raise CommandError(
                    f"{out_dir} is not empty and has no {MANIFEST}: not removing what "
                    "`edgebroker build` did not make (choose another --dist)"
                )
            shutil.rmtree(out_dir)
        out_dir.mkdir(parents=True)
    except OSError as exc:
        raise CommandError(
            f"cannot make {out_dir}: {exc.strerror or exc} (choose another --dist)"
        ) from None


def build_romfs(lib_dir: Path, image: Path) -> int:
    """`mpremote romfs build` of a directory holding lib/ only (the bytecode
    already compiled): the image mounts at /rom, so modules are /rom/lib/*."""
    with tempfile.TemporaryDirectory(prefix="edgebroker-romfs-") as tmp:
        shutil.copytree(lib_dir, Path(tmp) / "lib")
        argv = [*mpremote_command(), "romfs", "--output", str(image), "--no-mpy", "build", tmp]
        res = subprocess.run(argv, capture_output=True, text=True, check=False)
    if res.returncode != 0 or not image.is_file():
        raise CommandError(f"mpremote romfs build failed: {(res.stderr or res.stdout).strip()}")
    return image.stat().st_size


def mpremote_command() -> list[str]:
    """The mpremote of this venv (beside sys.executable), else on PATH."""
    beside = Path(sys.executable).parent / "mpremote"
    if beside.is_file():
        return [str(beside)]
    found = shutil.which("mpremote")
    if found is not None:
        return [found]
    return [sys.executable, "-m", "mpremote"]


def read_manifest(out_dir: Path) -> dict[str, Any] | None:
    """dist/<board>/manifest.json, or None when it is missing or unreadable
    (then the build is stale and made again)."""
    try:
        data = profiles.read_json(out_dir / MANIFEST, "build manifest")
    except profiles.ProfileError:
        return None
    return cast("dict[str, Any]", data) if isinstance(data, dict) else None


def is_current(target: Target, out_dir: Path) -> bool:
    """dist/<board>/ was built from exactly these inputs and is intact."""
    man = read_manifest(out_dir)
    if man is None or man.get("inputs") != inputs_digest(target, sources(target.profile)):
        return False
    for f in man.get("files", []):
        p = out_dir / str(f.get("path"))
        if not p.is_file() or sha256_file(p) != f.get("sha256"):
            return False
    return True


def build(target: Target, dist_root: Path) -> BuildResult:
    """Build dist_root/<board>/ from the sources and the profile. A
    directory that cannot be made or written is one CommandError line."""
    out_dir = dist_root / target.name
    prepare_out_dir(out_dir)
    try:
        return _build_into(target, out_dir)
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename else ""
        raise CommandError(f"cannot build into {out_dir}: {exc.strerror or exc}{where}") from None


def _build_into(target: Target, out_dir: Path) -> BuildResult:
    files = sources(target.profile)
    result = BuildResult(target=target, out_dir=out_dir)
    budget = target.profile.get("code_budget_bytes")
    result.budget = budget if isinstance(budget, int) and not isinstance(budget, bool) else None
    for s in files:
        dest = out_dir / s.remote
        if s.compiled:
            compile_mpy(s.source, dest, opt_level(target))
            result.bytecode_bytes += dest.stat().st_size
            result.mpy_version = mpy_major(dest)
        else:
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(s.source, dest)
        result.files.append(
            Built(s.remote, dest.stat().st_size, sha256_file(dest), s.source.stat().st_size)
        )
    (out_dir / PROFILE_FILE).write_bytes(profile_bytes(target))
    result.files.append(
        Built(
            PROFILE_FILE,
            (out_dir / PROFILE_FILE).stat().st_size,
            sha256_file(out_dir / PROFILE_FILE),
        )
    )
    if uses_romfs(target):
        result.romfs_bytes = build_romfs(out_dir / "lib", out_dir / ROMFS_IMAGE)
    manifest = {
        "board": target.name,
        "profile": str(target.path),
        "inputs": inputs_digest(target, files),
        "mpy_version": result.mpy_version,
        "line_numbers": target.lines,
        "bytecode_bytes": result.bytecode_bytes,
        "code_budget_bytes": result.budget,
        "over_budget": result.over_budget,
        "romfs": ROMFS_IMAGE if result.romfs_bytes is not None else None,
        "files": [{"path": f.remote, "bytes": f.size, "sha256": f.sha256} for f in result.files],
    }
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return result


def report(result: BuildResult) -> str:
    """The size report: per file, then bytecode against the budget."""
    lines = [f"edgebroker build: {result.target.name} -> {result.out_dir}"]
    lines.append(f"  {'file':<24} {'source':>9} {'on board':>9}")
    for f in result.files:
        src = f"{f.source_size:,}" if f.source_size is not None else "-"
        lines.append(f"  {f.remote:<24} {src:>9} {f.size:>9,}")
    if result.budget is None:
        lines.append(
            f"  bytecode (.mpy) total {result.bytecode_bytes:,} bytes "
            "(no code_budget_bytes in the profile)"
        )
    else:
        pct = 100 * result.bytecode_bytes / result.budget if result.budget else float("inf")
        verdict = "OVER BUDGET" if result.over_budget else "ok"
        if result.target.profile.get("frozen") is True:
            verdict = (
                "frozen: the modules of firmware/freeze/manifest.py are in the firmware, "
                "not here; `edgebroker config check` weighs their heap"
            )
        elif result.romfs_bytes is not None:
            verdict = "runs from ROMFS (flash), not RAM: `edgebroker config check` weighs its heap"
        lines.append(
            f"  bytecode (.mpy) total {result.bytecode_bytes:,} of "
            f"{result.budget:,} bytes code_budget_bytes ({pct:.0f}%): {verdict}"
        )
    if result.romfs_bytes is not None:
        lines.append(
            f"  {ROMFS_IMAGE}: {result.romfs_bytes:,} bytes (lib/ as ROMFS, mounted at /rom)"
        )
    if result.target.lines:
        lines.append(
            "  --lines: tracebacks give line numbers; the code takes about 5% more heap "
            "(4-6 KB on a 32-bit board), which `edgebroker config check` does not count "
            "(it weighs the default build, whose tracebacks name functions only)"
        )
    return "\n".join(lines)


def default_dist() -> Path:
    return runner.repo_root() / "dist"


def ensure_built(target: Target, dist_root: Path, *, quiet: bool = False) -> BuildResult | None:
    """Build unless dist/<board>/ is current. Returns the fresh result, or
    None when the existing build was current."""
    if is_current(target, dist_root / target.name):
        return None
    result = build(target, dist_root)
    if not quiet:
        print(report(result))
    return result


# ------------------------------------------------------------------ command
def add_target_arguments(parser: argparse.ArgumentParser) -> None:
    """BOARD, --set, --dist and --lines: shared with `edgebroker flash`."""
    parser.add_argument(
        "board",
        metavar="BOARD",
        help="board profile: a name in boards/ (esp32, rp2040_picow, host) or a JSON file",
    )
    add_set_option(parser)
    parser.add_argument(
        "--dist",
        type=Path,
        default=None,
        metavar="DIR",
        help="output root (default: <repo>/dist); the build goes to DIR/<board>/",
    )
    parser.add_argument(
        "--lines",
        action="store_true",
        help="keep line numbers in the bytecode, for debugging: a board traceback then "
        "gives lines, not just function names; the code takes about 5%% more heap, "
        "which config check does not count",
    )


def register(subparsers: Subparsers) -> None:
    """Add the `build` subcommand."""
    parser = subparsers.add_parser(
        "build",
        help="compile the broker and firmware for a board into dist/<board>/",
        description=(
            "mpy-cross lib/*.py and firmware modules into dist/<board>/lib/, copy boot.py, "
            "main.py and the profile (board.json), build a ROMFS image when the profile says "
            "romfs: true, and report sizes against code_budget_bytes (exit 1 when over)."
        ),
    )
    add_target_arguments(parser)
    parser.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    target = load_target(
        cast(str, args.board), cast("list[str]", args.overrides), lines=bool(args.lines)
    )
    for warning in target.warnings:
        print(f"edgebroker build: {warning}", file=sys.stderr)
    dist = cast("Path | None", args.dist) or default_dist()
    check_dist(dist)
    result = build(target, dist)
    print(report(result))
    if result.over_budget:
        print(
            f"edgebroker build: error: {result.bytecode_bytes:,} bytes of bytecode is over "
            f"{target.name}'s code_budget_bytes ({result.budget:,})",
            file=sys.stderr,
        )
        return EXIT_OVER_BUDGET
    return 0
