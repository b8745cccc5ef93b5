"""Warehouse and snapshot locations through the Hadoop FileSystem API of a Spark session.

    fs = Hfs(spark)
    root = fs.qualify("warehouse/")        # file:/abs/warehouse (hdfs://..., s3a://... as given)
    fs.write_new(root + "/_commits/x.json", data)   # whole or not at all
    fs.read(root + "/_commits/x.json")

The build never touches a warehouse or snapshot location with os, pathlib,
shutil or open: a location is a URI (a plain path means the driver's
file://), and every operation here is the JVM's org.apache.hadoop.fs
FileSystem of the session's Hadoop configuration, so the same code runs
on a local disk, HDFS, S3 (s3a://, with the cluster's connector jars) or
a viewfs:// mount table. Files are written whole: to a hidden temporary
name, then renamed to a name that does not exist yet (a rename within one
directory is atomic on HDFS and local disks; on an object store the
object appears whole when its upload completes).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:  # the report uses to_uri()/is_local() without importing pyspark
    from pyspark.sql import SparkSession


def to_uri(location: str) -> str:
    """A location as a URI: a plain (relative or absolute) path becomes file:///abs/path."""
    scheme = urlsplit(location).scheme
    if len(scheme) > 1:  # not a Windows drive letter
        return location
    return "file://" + os.path.abspath(location)  # noqa: PTH100 (a path string, not a file)


def is_local(location: str) -> bool:
    """True for a plain path or a file: URI (the driver's own disk)."""
    scheme = urlsplit(location).scheme
    return len(scheme) <= 1 or scheme == "file"


def local_path(location: str) -> str:
    """The driver path of a plain path or file: URI (for tools that run without Spark)."""
    parts = urlsplit(location)
    return parts.path if len(parts.scheme) > 1 else location


@dataclass(frozen=True)
class Status:
    """One directory entry."""

    path: str  # qualified URI
    name: str
    is_dir: bool
    length: int
    mtime_ms: int


class Hfs:
    """The Hadoop FileSystem operations the build needs (see the module docstring)."""

    def __init__(self, spark: SparkSession) -> None:
        sc = spark.sparkContext
        self._jvm: Any = sc._jvm
        self._conf: Any = sc._jsc.hadoopConfiguration()

    def _path(self, uri: str) -> tuple[Any, Any]:
        p = self._jvm.org.apache.hadoop.fs.Path(uri)
        return p, p.getFileSystem(self._conf)

    def qualify(self, location: str) -> str:
        """The fully qualified URI of a location (scheme and authority filled in)."""
        p, fs = self._path(to_uri(location))
        return str(fs.makeQualified(p).toString())

    def exists(self, uri: str) -> bool:
        p, fs = self._path(uri)
        return bool(fs.exists(p))

    def is_dir(self, uri: str) -> bool:
        p, fs = self._path(uri)
        return bool(fs.exists(p) and fs.getFileStatus(p).isDirectory())

    def mkdirs(self, uri: str) -> None:
        p, fs = self._path(uri)
        fs.mkdirs(p)

    def delete(self, uri: str) -> bool:
        """Delete a file or a directory tree; False when there was nothing."""
        p, fs = self._path(uri)
        return bool(fs.delete(p, True))

    def rename(self, src: str, dest: str) -> bool:
        """Rename src to dest, which must not exist; False when it could not."""
        p, fs = self._path(src)
        q, _ = self._path(dest)
        if fs.exists(q):
            return False
        return bool(fs.rename(p, q))

    def list(self, uri: str) -> list[Status]:
        """The entries of a directory (none when it does not exist), sorted by name."""
        p, fs = self._path(uri)
        if not fs.exists(p):
            return []
        out = [
            Status(
                path=str(st.getPath().toString()),
                name=str(st.getPath().getName()),
                is_dir=bool(st.isDirectory()),
                length=int(st.getLen()),
                mtime_ms=int(st.getModificationTime()),
            )
            for st in fs.listStatus(p)
        ]
        return sorted(out, key=lambda s: s.name)

    def read(self, uri: str) -> bytes:
        """A whole file (FileNotFoundError when it does not exist)."""
        p, fs = self._path(uri)
        if not fs.exists(p):
            raise FileNotFoundError(uri)
        stream = fs.open(p)
        try:
            return bytes(self._jvm.org.apache.commons.io.IOUtils.toByteArray(stream))
        finally:
            stream.close()

    def write_new(self, uri: str, data: bytes) -> None:
        """Write a file that does not exist yet, whole or not at all (FileExistsError)."""
        p, fs = self._path(uri)
        tmp, _ = self._path(_hidden(uri, ".tmp"))
        if fs.exists(p):
            raise FileExistsError(uri)
        fs.delete(tmp, False)
        stream = fs.create(tmp, True)
        try:
            stream.write(bytearray(data))
        finally:
            stream.close()
        if not fs.rename(tmp, p):
            fs.delete(tmp, False)
            raise FileExistsError(uri)

    def write(self, uri: str, data: bytes) -> None:
        """Write (or replace) a file that nothing reads until a later commit names it."""
        p, fs = self._path(uri)
        stream = fs.create(p, True)
        try:
            stream.write(bytearray(data))
        finally:
            stream.close()


def _hidden(uri: str, suffix: str) -> str:
    head, _, name = uri.rpartition("/")
    return f"{head}/.{name}{suffix}"


def join(base: str, *parts: str) -> str:
    """base/part/...: a URI joined with relative names."""
    return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts)])
