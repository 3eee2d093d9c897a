"""Files in the warehouse, wherever it is: the one way operations read and remove Spark
checkpoints and warehouse folders outside Spark's own readers and writers.

The warehouse (`VARADHI_WAREHOUSE`) may be a local path or any URI Spark can write: `s3a://`,
`abfss://`, `gs://`, `hdfs://`, `dbfs:/`, a Unity Catalog volume (`/Volumes/...`). Delta tables
and streaming checkpoints are written by Spark; what varadhi itself reads or removes there (a
stopped shard's committed offsets, a batch plan to forget, a deleted subscription's folder) goes
through a `WarehouseFS`:

- `HadoopFS`: Hadoop's FileSystem API through a Spark session's JVM, with the session's Hadoop
  configuration, so it resolves a path exactly as Spark does (scheme, `fs.defaultFS`,
  credentials, the `fs.s3a.*` settings);
- `LocalFS`: the local file system, for a local warehouse in a process without Spark (tests of
  pure logic, and commands such as `offsets reset --dry-run` that need no Spark otherwise).

`for_path` chooses: an active (or given) Spark session's `HadoopFS`; else `LocalFS` for a local
path; else a Spark session is started (`varadhi.spark.session.get_spark`, or the caller's factory) and
its `HadoopFS` is used. So a command that needs checkpoint state of a warehouse on an object
store starts a local Spark session, whose Hadoop configuration must reach the store (see
`varadhi.spark.s3a` and docs/object-storage.md); with a local warehouse it starts none.

Hazard: a `HadoopFS` call is a JVM call, and on an object store a request (`exists` is a HEAD or a
LIST). Callers poll with sleeps of tens of milliseconds at most while a query stops, never in a
loop over records.
"""

from __future__ import annotations

import os
import shutil
import uuid
from typing import Any, Protocol
from urllib.parse import urlsplit

from varadhi.core.errors import InvalidArgument
from varadhi.kafka import jvm_errors


class WarehouseFS(Protocol):
    """What varadhi does to warehouse files. Paths are strings as Spark takes them."""

    where: str  # for messages: which file system this is

    def exists(self, path: str) -> bool: ...

    def list(self, path: str) -> list[str]:
        """Names (not paths) of the entries directly under `path`, sorted; [] when `path` does
        not exist or is not a folder."""
        ...

    def read_text(self, path: str) -> str:
        """The file's content as UTF-8; `FileNotFoundError` when it does not exist."""
        ...

    def delete(self, path: str) -> None:
        """Remove `path`, a file or a folder with everything under it; nothing if absent."""
        ...

    def write_text(self, path: str, text: str) -> None:
        """Create (or replace) the file `path` with `text` as UTF-8, and its parent folders."""
        ...


def is_local(path: str) -> bool:
    """A path of this machine's file system: no scheme, `file:`, or a Windows drive letter."""
    scheme = urlsplit(path).scheme
    return scheme in ("", "file") or (len(scheme) == 1 and os.name == "nt")


def child(path: str, name: str) -> str:
    return f"{path.rstrip('/')}/{name}"


class LocalFS:
    where = "local file system"

    @staticmethod
    def _local(path: str) -> str:
        return urlsplit(path).path if path.startswith("file:") else path

    def exists(self, path: str) -> bool:
        return os.path.lexists(self._local(path))

    def list(self, path: str) -> list[str]:
        p = self._local(path)
        return sorted(os.listdir(p)) if os.path.isdir(p) else []

    def read_text(self, path: str) -> str:
        with open(self._local(path), encoding="utf-8") as f:
            return f.read()

    def delete(self, path: str) -> None:
        p = self._local(path)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        elif os.path.lexists(p):
            os.remove(p)

    def write_text(self, path: str, text: str) -> None:
        p = self._local(path)
        os.makedirs(os.path.dirname(p) or ".", exist_ok=True)
        with open(p, "w", encoding="utf-8") as f:
            f.write(text)


class HadoopFS:
    """Hadoop's FileSystem API through a Spark session's JVM (any scheme Spark can read:
    s3a://, abfss://, gs://, hdfs://, dbfs:/, file:), with the session's Hadoop configuration
    (`spark.hadoop.*` and the session's SQL settings, as Spark's own readers see them)."""

    where = "Hadoop FileSystem (Spark)"

    def __init__(self, spark: Any):
        self._jvm = spark.sparkContext._jvm
        self._conf = spark._jsparkSession.sessionState().newHadoopConf()

    def _fs(self, path: str) -> tuple[Any, Any]:
        p = self._jvm.org.apache.hadoop.fs.Path(path)
        return p.getFileSystem(self._conf), p

    def exists(self, path: str) -> bool:
        fs, p = self._fs(path)
        return bool(fs.exists(p))

    def list(self, path: str) -> list[str]:
        fs, p = self._fs(path)
        if not fs.exists(p) or not fs.getFileStatus(p).isDirectory():
            return []
        return sorted(str(s.getPath().getName()) for s in fs.listStatus(p))

    def read_text(self, path: str) -> str:
        fs, p = self._fs(path)
        if not fs.exists(p):
            raise FileNotFoundError(path)
        stream = fs.open(p)
        try:
            return str(self._jvm.org.apache.commons.io.IOUtils.toString(stream, "UTF-8"))
        finally:
            stream.close()

    def delete(self, path: str) -> None:
        fs, p = self._fs(path)
        fs.delete(p, True)

    def write_text(self, path: str, text: str) -> None:
        fs, p = self._fs(path)
        stream = fs.create(p, True)
        try:
            stream.write(bytearray(text.encode("utf-8")))
        finally:
            stream.close()


def check_writable(fs: WarehouseFS, warehouse: str) -> None:
    """Refuse, before any side effect, a warehouse this process cannot write (a read-only
    folder, a bucket that does not exist or denies writes, missing credentials): writes and
    removes one small file under `<warehouse>/_varadhi/`. Raises `InvalidArgument` with one line
    naming the warehouse and the file system's own reason (its first line)."""
    probe = child(child(warehouse, "_varadhi"), f"write-check-{uuid.uuid4().hex}")
    try:
        fs.write_text(probe, "varadhi write check\n")
        fs.delete(probe)
    except Exception as e:  # noqa: BLE001 - OSError locally, Py4JJavaError through Spark
        raise InvalidArgument(
            f"the warehouse {warehouse} is not writable through the {fs.where}: "
            f"{jvm_errors.headline(e)}",
            field="warehouse",
        ) from None


def for_path(path: str, spark: Any = None, purpose: str = "varadhi") -> WarehouseFS:
    """How to reach `path`: a `HadoopFS` on `spark` (a session, or a factory called only when a
    session is needed) or on the active session; else `LocalFS` for a local path; else a
    `HadoopFS` on a session the factory (default `varadhi.spark.session.get_spark(purpose)`) starts.
    Raises `InvalidArgument` (one line) when that session cannot be started."""
    if spark is not None and not callable(spark):
        return HadoopFS(spark)
    active = _active_session()
    if active is not None:
        return HadoopFS(active)
    if is_local(path):
        return LocalFS()
    try:
        if spark is None:
            from varadhi.spark.session import get_spark

            return HadoopFS(get_spark(purpose))
        return HadoopFS(spark())
    except Exception as e:  # noqa: BLE001 - any failure to start Spark is one line to the user
        raise InvalidArgument(
            f"the warehouse {path} is not a local path and Spark could not be started to "
            f"reach it ({jvm_errors.headline(e)})",
            field="warehouse",
        ) from None


def _active_session() -> Any:
    try:
        from pyspark.sql import SparkSession
    except (
        ImportError
    ):  # pragma: no cover - pyspark is a dependency of every command that gets here
        return None
    return SparkSession.getActiveSession()
