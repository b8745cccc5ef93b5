#!/usr/bin/env bash
# Bootstrap the host toolchain; `make venv` runs this, every other target depends on it.
#
#   1. .venv with python3 (>= 3.11), the pinned requirements.txt and the
#      editable edgebroker-tools package (pip install -e . --no-deps).
#      Skipped when .venv's stamp matches requirements.txt + pyproject.toml.
#      Also the MicroPython type stubs for firmware/ (mypy in host_tests/tools/test_firmware.py):
#      one folder per port, .venv/stubs/<port>, from tools/firmware_typecheck/<port>.txt
#      with pip --target (the port packages cannot share one site-packages).
#   2. mosquitto (reference broker) and mosquitto_pub/mosquitto_sub (a real C
#      client) for the tests. As root on Debian/Ubuntu they are installed with
#      apt-get; a mosquitto service the install starts is stopped and disabled
#      again (the tests start their own instances on free ports). Otherwise
#      the script says what to install and fails.
#   3. Java >= 17 for PySpark (the fleet pipeline and its tests). Missing or
#      older: as root with apt-get, openjdk-17-jre-headless is installed;
#      otherwise the script says what to install and fails.
#   4. chromium (headless) for the fleet report's rendering test: as root
#      with apt-get when missing; otherwise the script says what to install.
#   5. Node.js >= 18 and npm (as root with apt-get when missing), then the
#      pinned npm MicroPython WebAssembly port in tools/wasm (npm ci, again
#      when tools/wasm/package-lock.json changes): the 32-bit memory costs
#      (edgebroker_tools.measure32, host_tests/tools/test_memory_costs_fresh.py).
#
# Environment: PYTHON (default python3) picks the interpreter for a new .venv.
set -o errexit -o pipefail -o nounset

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
VPY="$VENV/bin/python"
STAMP="$VENV/.edgebroker-setup-stamp"
PYTHON="${PYTHON:-python3}"
MOSQUITTO_PIDFILE=/run/mosquitto/mosquitto.pid  # pid_file in Debian's /etc/mosquitto/mosquitto.conf

say() { printf 'setup: %s\n' "$*"; }
die() { printf 'setup: error: %s\n' "$*" >&2; exit 1; }

is_root() { [ "$(id -u)" -eq 0 ]; }
have_apt() { command -v apt-get >/dev/null 2>&1; }

apt_install() {  # apt_install PKG... (root only), non-interactive
    DEBIAN_FRONTEND=noninteractive apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@"
}

# --- 1. Python venv ----------------------------------------------------------

# Succeeds when interpreter $1 runs and is >= 3.11.
python_ok() {
    "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1
}

# Key of what the venv was built from; the stamp holds the last successful one.
setup_key() {
    "$VPY" - "$ROOT/requirements.txt" "$ROOT/pyproject.toml" "$ROOT"/tools/firmware_typecheck/*.txt <<'PY'
import hashlib, sys
h = hashlib.sha256(sys.version.encode())
for name in sys.argv[1:]:
    with open(name, "rb") as f:
        h.update(hashlib.sha256(f.read()).digest())
print(h.hexdigest())
PY
}

make_venv() {
    command -v "$PYTHON" >/dev/null 2>&1 \
        || die "$PYTHON not found: install Python >= 3.11 (Debian/Ubuntu: apt-get install python3 python3-venv), or set PYTHON=/path/to/python3.11"
    python_ok "$PYTHON" \
        || die "$PYTHON is $("$PYTHON" -c 'import platform; print(platform.python_version())' 2>/dev/null || echo unknown); edgebroker needs Python >= 3.11 (set PYTHON=/path/to/python3.11)"
    say "creating .venv with $PYTHON ($("$PYTHON" -c 'import platform; print(platform.python_version())'))"
    if ! "$PYTHON" -m venv --clear "$VENV"; then
        # Debian/Ubuntu ship venv's ensurepip separately.
        local pkg
        pkg="python$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')-venv"
        if is_root && have_apt; then
            say "installing $pkg (python3 -m venv needs it)"
            apt_install "$pkg"
            "$PYTHON" -m venv --clear "$VENV" || die "python3 -m venv still fails after installing $pkg"
        else
            die "python3 -m venv failed; install the venv module (Debian/Ubuntu: sudo apt-get install $pkg) and rerun make venv"
        fi
    fi
}

setup_venv() {
    if ! [ -x "$VPY" ]; then
        make_venv
    elif ! python_ok "$VPY"; then
        say ".venv's python is broken or older than 3.11; rebuilding .venv"
        make_venv
    fi
    local key
    key="$(setup_key)"
    if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$key" ] && [ -x "$VENV/bin/edgebroker" ] \
        && [ -f "$VENV/stubs/esp32/machine.pyi" ] && [ -f "$VENV/stubs/rp2/machine.pyi" ]; then
        return 0  # up to date: nothing to do
    fi
    rm -f "$STAMP"
    say "installing pinned requirements into .venv"
    "$VPY" -m pip install --disable-pip-version-check -q -r "$ROOT/requirements.txt"
    say "installing edgebroker-tools (editable) into .venv"
    "$VPY" -m pip install --disable-pip-version-check -q --no-deps -e "$ROOT"
    local req port
    for req in "$ROOT"/tools/firmware_typecheck/*.txt; do
        port="$(basename "$req" .txt)"
        say "installing MicroPython $port stubs into .venv/stubs/$port"
        rm -rf "$VENV/stubs/$port"
        "$VPY" -m pip install --disable-pip-version-check -q --no-deps \
            --target "$VENV/stubs/$port" -r "$req"
    done
    printf '%s\n' "$key" >"$STAMP"
}

# --- 2. mosquitto --------------------------------------------------------------

have_broker() { [ -x /usr/sbin/mosquitto ] || command -v mosquitto >/dev/null 2>&1; }
have_clients() { command -v mosquitto_pub >/dev/null 2>&1 && command -v mosquitto_sub >/dev/null 2>&1; }
systemd_running() { [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; }
pkg_installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'install ok installed'; }

# Stop and disable a mosquitto service that the install we just ran started.
# $1: mosquitto PIDs before the install; $2: "1" if the mosquitto package was
# already installed (then its service is the owner's business, not ours).
quiesce_new_mosquitto() {
    local before_pids="$1" had_pkg="$2"
    [ "$had_pkg" = 1 ] && return 0
    if systemd_running; then
        if systemctl is-active --quiet mosquitto 2>/dev/null; then
            say "stopping the mosquitto service the install started"
            systemctl stop mosquitto || true
        fi
        if systemctl is-enabled --quiet mosquitto 2>/dev/null; then
            systemctl disable --quiet mosquitto || true
        fi
    elif [ -x /etc/init.d/mosquitto ] && command -v update-rc.d >/dev/null 2>&1; then
        update-rc.d mosquitto disable >/dev/null 2>&1 || true  # no start at boot
    fi
    # Whatever init did: a mosquitto that the package's pid file names, that
    # is running as mosquitto and did not exist before the install, is ours.
    local pid
    [ -r "$MOSQUITTO_PIDFILE" ] || return 0
    pid="$(tr -dc '0-9' <"$MOSQUITTO_PIDFILE")"
    [ -n "$pid" ] || return 0
    [ "$(ps -o comm= -p "$pid" 2>/dev/null || true)" = mosquitto ] || return 0
    case " $before_pids " in *" $pid "*) return 0 ;; esac
    say "stopping mosquitto (pid $pid) started by the install"
    if command -v service >/dev/null 2>&1; then
        service mosquitto stop >/dev/null 2>&1 || true
    fi
    if kill -0 "$pid" 2>/dev/null; then
        kill "$pid" 2>/dev/null || true
    fi
}

setup_mosquitto() {
    have_broker && have_clients && return 0
    local missing=""
    have_broker || missing="mosquitto"
    have_clients || missing="${missing:+$missing }mosquitto-clients"
    if ! is_root; then
        die "missing $missing (the tests need mosquitto and mosquitto_pub/mosquitto_sub). Install with:
    sudo apt-get install -y mosquitto mosquitto-clients
then rerun make venv. (Run as root, this script installs them itself.)"
    fi
    have_apt || die "missing $missing and no apt-get here: install mosquitto and its clients (mosquitto_pub, mosquitto_sub) with this system's package manager"
    local before_pids had_pkg=0
    before_pids="$(pgrep -x mosquitto | tr '\n' ' ' || true)"
    pkg_installed mosquitto && had_pkg=1
    say "installing $missing with apt-get"
    apt_install mosquitto mosquitto-clients
    quiesce_new_mosquitto "$before_pids" "$had_pkg"
    have_broker && have_clients || die "mosquitto/mosquitto-clients still missing after apt-get install"
}

# --- 3. Java for PySpark -------------------------------------------------------

JAVA_MIN=17
JAVA_PKG=openjdk-17-jre-headless

# The major version of the java that PySpark will run ($JAVA_HOME/bin/java, else
# the one on PATH), or nothing when there is none. "1.8.0_x" counts as 8.
java_major() {
    local java=java
    if [ -n "${JAVA_HOME:-}" ] && [ -x "$JAVA_HOME/bin/java" ]; then
        java="$JAVA_HOME/bin/java"
    fi
    command -v "$java" >/dev/null 2>&1 || return 0
    "$java" -version 2>&1 | sed -n 's/.*version "\([0-9][0-9]*\)\.\{0,1\}\([0-9]*\).*/\1 \2/p' | head -n 1 \
        | awk '{ print ($1 == 1 ? $2 : $1) }'
}

setup_java() {
    local major
    major="$(java_major)"
    if [ -n "$major" ] && [ "$major" -ge "$JAVA_MIN" ]; then
        return 0
    fi
    local have="${major:+Java $major}"
    have="${have:-no Java}"
    if ! is_root; then
        die "PySpark (fleet pipeline) needs Java >= $JAVA_MIN, found $have. Install with:
    sudo apt-get install -y $JAVA_PKG
then rerun make venv. (Run as root, this script installs it itself.)"
    fi
    have_apt || die "PySpark needs Java >= $JAVA_MIN, found $have, and there is no apt-get here: install a Java $JAVA_MIN runtime"
    say "installing $JAVA_PKG with apt-get (PySpark needs Java >= $JAVA_MIN, found $have)"
    # The JRE package's postinst needs this man directory on slim images.
    mkdir -p /usr/share/man/man1
    apt_install "$JAVA_PKG"
    major="$(java_major)"
    if [ -z "$major" ] || [ "$major" -lt "$JAVA_MIN" ]; then
        die "java is still ${major:+version }${major:-missing} after installing $JAVA_PKG: point JAVA_HOME at /usr/lib/jvm/java-17-openjdk-*"
    fi
}

# --- 4. chromium (the fleet report's rendering test) ---------------------------

have_chromium() { command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; }

setup_chromium() {
    have_chromium && return 0
    if ! is_root; then
        die "the fleet report test renders the page in Debian's chromium, which is missing. Install with:
    sudo apt-get install -y chromium
then rerun make venv. (Run as root, this script installs it itself.)"
    fi
    have_apt || die "chromium is missing and there is no apt-get here: install chromium (headless) with this system's package manager"
    say "installing chromium with apt-get (the fleet report's rendering test)"
    apt_install chromium
    have_chromium || die "chromium still missing after apt-get install"
}

# --- 5. Node.js and the npm MicroPython (32-bit memory costs) -------------------

NODE_MIN=18
WASM_DIR="$ROOT/tools/wasm"

node_major() {
    command -v node >/dev/null 2>&1 || return 0
    node --version 2>/dev/null | sed -n 's/^v\([0-9][0-9]*\).*/\1/p'
}

setup_node() {
    local major
    major="$(node_major)"
    if [ -z "$major" ] || [ "$major" -lt "$NODE_MIN" ] || ! command -v npm >/dev/null 2>&1; then
        if ! is_root; then
            die "the 32-bit memory costs run MicroPython's WebAssembly port under Node.js >= $NODE_MIN with npm (found ${major:+Node $major}${major:-no Node}). Install with:
    sudo apt-get install -y nodejs npm
then rerun make venv. (Run as root, this script installs it itself.)"
        fi
        have_apt || die "Node.js >= $NODE_MIN and npm are missing and there is no apt-get here: install them with this system's package manager"
        say "installing nodejs and npm with apt-get (the 32-bit memory costs)"
        apt_install nodejs npm
        major="$(node_major)"
        [ -n "$major" ] && [ "$major" -ge "$NODE_MIN" ] || die "Node.js is ${major:-missing} after apt-get install nodejs: version $NODE_MIN or newer is needed"
    fi
    # the pinned npm package (tools/wasm/package-lock.json), again when the lock changed
    local stamp="$WASM_DIR/node_modules/.edgebroker-lock"
    if [ ! -f "$stamp" ] || ! cmp -s "$WASM_DIR/package-lock.json" "$stamp"; then
        say "installing the npm MicroPython (tools/wasm, npm ci)"
        (cd "$WASM_DIR" && npm ci --no-audit --no-fund --loglevel=error) \
            || die "npm ci in tools/wasm failed (the registry must be reachable once)"
        cp "$WASM_DIR/package-lock.json" "$stamp"
    fi
}

main() {
    setup_venv
    setup_mosquitto
    setup_java
    setup_chromium
    setup_node
}

# Sourcing the file (e.g. to test one function) defines the functions only.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    main "$@"
fi
