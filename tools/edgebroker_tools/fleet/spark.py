"""The SparkSession the fleet job runs in, and the code it ships to executors.

    spark, owned = session("local[2]")      # owned: we started it, we stop it

A session that is already active (a test suite's, spark-submit's) is used as
it is. A new one is configured for this kind of machine: Python workers run
this interpreter (PYSPARK_PYTHON), and with a local master everything binds
to 127.0.0.1 with no UI. ship_code() adds lib/edgestore.py and a zip of
this package to the SparkContext, so executors that do not have the package
installed (a real cluster) can still run decode.ingest().

A master or driver memory Spark would not take, and a Spark that does not
start, are a SparkStartError (the commands' CommandError: one line, exit 2);
the master and memory are checked before a JVM is started.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Final

from pyspark.sql import SparkSession

from edgebroker_tools.commands import CommandError

#: Settings the build's results depend on: job.build() sets them on any session.
REQUIRED_CONF: Final = {
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.parquet.outputTimestampType": "TIMESTAMP_MICROS",
    "spark.sql.sources.partitionColumnTypeInference.enabled": "false",
}
#: Defaults for the rest, applied only where spark-submit's --conf did not set them.
DEFAULT_CONF: Final = {
    "spark.sql.adaptive.enabled": "true",
    "spark.sql.parquet.compression.codec": "zstd",
    "spark.sql.execution.arrow.maxRecordsPerBatch": "65536",
}
#: Static settings for a session this module starts itself.
LOCAL_CONF: Final = {
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    # the throughput collector: a batch job on a few cores does not need
    # G1's short pauses, and pays for its write barriers on every row (the
    # 6.3 M-row build 61.1 -> 56.1 s, its floor 19.8 -> 18.2 s, one run each)
    "spark.driver.extraJavaOptions": "-XX:+UseParallelGC",
}
LOOPBACK: Final = "127.0.0.1"

_shipped: set[str] = set()


def _python_env() -> None:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)


def session(
    master: str | None = None,
    *,
    app: str = "edgebroker-fleet",
    driver_memory: str = "4g",
    shuffle_partitions: int | None = None,
) -> tuple[SparkSession, bool]:
    """(session, owned): the active session if there is one, else a new one.

    Under spark-submit (the JVM is already running) the master, memory and
    every --conf come from spark-submit; only settings it left unset get
    this module's defaults. A master or (local) driver memory Spark would
    not take is a SparkStartError before anything starts, as is a Spark
    that fails to start.
    """
    if master is not None:  # a bad option is refused even when a session is active
        check_master(master)
    if master is None or master.startswith("local"):
        check_memory(driver_memory)
    _python_env()
    active = SparkSession.getActiveSession()
    if active is not None:
        return active, False
    builder = SparkSession.builder.appName(app)
    ours = "PYSPARK_GATEWAY_PORT" not in os.environ  # we start the JVM ourselves
    local = ours and (master is None or master.startswith("local"))
    if ours:
        if master is not None:
            builder = builder.master(master)
        for key, value in LOCAL_CONF.items():
            builder = builder.config(key, value)
        if local:
            os.environ.setdefault("SPARK_LOCAL_IP", LOOPBACK)
            builder = builder.config("spark.driver.host", LOOPBACK)
            builder = builder.config("spark.driver.bindAddress", LOOPBACK)
            builder = builder.config("spark.driver.memory", driver_memory)
    try:
        spark = builder.getOrCreate()
    except Exception as exc:  # Py4J's, PySpark's and the JVM's errors alike: one line
        given = [f"--master {master}"] if ours and master is not None else []
        given += [f"--driver-memory {driver_memory}"] if local else []
        with_ = f" with {' '.join(given)}" if given else ""
        raise SparkStartError(f"Spark did not start{with_}: {_reason(exc)}") from None
    spark.sparkContext.setLogLevel("ERROR")
    conf = spark.sparkContext.getConf()
    defaults = dict(DEFAULT_CONF)
    parallel = spark.sparkContext.defaultParallelism
    defaults["spark.sql.shuffle.partitions"] = str(shuffle_partitions or max(8, 4 * parallel))
    if shuffle_partitions is not None:
        spark.conf.set("spark.sql.shuffle.partitions", str(shuffle_partitions))
    for key, value in defaults.items():
        if not conf.contains(key):
            spark.conf.set(key, value)
    return spark, True


class SparkStartError(CommandError):
    """Spark could not start with the master or memory given (one line, exit 2)."""


#: What spark-submit takes as a master (SparkSubmit: "Master must either be
#: yarn or start with spark, k8s, or local"); anything else ends its JVM.
MASTER_HINT: Final = (
    "expected yarn or a master starting with local, spark or k8s: local, local[*], local[2], "
    "local-cluster[2,1,1024], spark://HOST:7077, k8s://https://HOST:443"
)
#: spark.driver.memory as Spark documents it ("JVM memory strings with a size
#: unit suffix"): the launcher passes it on as -Xmx, where no unit means bytes.
MEMORY_RE: Final = re.compile(r"[0-9]+[kmgt]", re.IGNORECASE)


def check_master(master: str) -> None:
    """--master in a form spark-submit accepts, checked before a JVM is started."""
    if master != "yarn" and not master.startswith(("local", "spark", "k8s")):
        raise SparkStartError(f"--master {master!r}: {MASTER_HINT}")


def check_memory(memory: str) -> None:
    """--driver-memory in a form the JVM accepts (4g, 512m), checked before it starts."""
    if MEMORY_RE.fullmatch(memory) is None:
        raise SparkStartError(
            f"--driver-memory {memory!r}: expected a number and a unit k, m, g or t, e.g. 4g, 512m"
        )


def _reason(exc: BaseException) -> str:
    """The first line that says why: a Java exception's message, else the error's first line."""
    lines = [line.strip().lstrip(":").strip() for line in str(exc).splitlines()]
    for line in lines:
        found = re.match(r"[\w.$]+(?:Exception|Error): (.+)", line)
        if found:
            return found.group(1)
    return next((line for line in lines if line), type(exc).__name__)


def user_set(spark: SparkSession, key: str) -> bool:
    """True when spark-submit's --conf (or the session's builder) set key."""
    return bool(spark.sparkContext.getConf().contains(key))


def apply_required(spark: SparkSession) -> None:
    """The settings the tables' content depends on (UTC, microsecond timestamps)."""
    for key, value in REQUIRED_CONF.items():
        spark.conf.set(key, value)


def _package_zip() -> Path:
    """A zip of edgebroker_tools (the .py files), made once per process."""
    pkg = Path(__file__).resolve().parents[1]
    target = (
        Path(tempfile.gettempdir()) / f"edgebroker-fleet-{os.getpid()}" / "edgebroker_tools.zip"
    )
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        atexit.register(shutil.rmtree, target.parent, ignore_errors=True)
        tmp = target.with_suffix(".tmp")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zf:
            for path in sorted(pkg.rglob("*.py")):
                zf.write(path, str(path.relative_to(pkg.parent)))
            zf.write(pkg / "py.typed", "edgebroker_tools/py.typed")
        tmp.replace(target)
    return target


def edgestore_path() -> Path:
    from edgebroker_tools import runner

    return runner.lib_path().resolve().parent / "edgestore.py"


def ship_code(spark: SparkSession) -> None:
    """Make decode.ingest() and lib/edgestore.py (with its reader,
    lib/edgeopen.py) importable on every executor."""
    sc = spark.sparkContext
    app = str(sc.applicationId)
    if app in _shipped:
        return
    sc.addPyFile(str(edgestore_path()))
    sc.addPyFile(str(edgestore_path().with_name("edgeopen.py")))
    sc.addPyFile(str(_package_zip()))
    _shipped.add(app)
