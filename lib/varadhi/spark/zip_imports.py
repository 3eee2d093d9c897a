"""Keep Python 3.10 and 3.11 from re-reading `pyspark.zip` every time a Spark task starts.

PySpark's worker calls `importlib.invalidate_caches()` at the start of every task (its
`setup_spark_files`). On Python 3.10 and 3.11, a `zipimport.zipimporter` answers that by reading
its archive's whole directory again, at once (CPython gh-103200; 3.12 only marks it stale and
reads it when next needed). A worker that imported pyspark from `pyspark.zip` (under
`SPARK_HOME/python/lib`, which Spark puts first on every Python worker's path: ours, EMR's)
holds one importer per package it imported from the archive, each re-reading the same 1,300
entries: 14 importers and 56 ms of CPU per task start on the test machine, measured with
`importlib.invalidate_caches()` in such a process. A micro-batch starts one task per delivery
task, so that is paid every batch, before the first message of the task is sent.

`keep_unchanged_zip_directories()` replaces `zipimporter.invalidate_caches` in the calling
process with one that reads an archive's directory again only when the archive's size or
modification time changed since this process last read it; otherwise every importer of that
archive takes the directory already read. So a changed archive is still seen, as before, and an
unchanged one costs a `stat`. It does nothing on Python versions without the eager re-read.

Called first thing by the functions Spark tasks run (`batch.deliver_records`,
`batch.process_partition`, `replay.deliver_partition`). Spark reuses a Python worker for the next
task (`spark.python.worker.reuse`, on by default), so a worker's first task still pays, and its
later ones do not. Hazard: it changes a standard-library class for the whole worker process,
including other code running there; the behaviour it keeps (a changed archive is read again) is
the one that code could rely on.
"""

from __future__ import annotations

import os
import sys
import zipimport

_EAGER_RE_READ = sys.version_info[:2] in ((3, 10), (3, 11))
_read_at: dict[str, tuple[int, int]] = {}  # archive -> (mtime ns, size) when this process read it


def keep_unchanged_zip_directories() -> bool:
    """Install the replacement in this process (once); whether it is installed."""
    if not _EAGER_RE_READ:
        return False
    importer = zipimport.zipimporter
    if getattr(importer.invalidate_caches, "_varadhi_keeps_unchanged", False):
        return True
    re_read = importer.invalidate_caches

    def invalidate_caches(self) -> None:
        stamp = _stamp(self.archive)
        cached = zipimport._zip_directory_cache.get(self.archive)
        if stamp is not None and cached is not None and _read_at.get(self.archive) == stamp:
            self._files = cached
            return
        re_read(self)
        if stamp is not None:
            _read_at[self.archive] = stamp

    invalidate_caches._varadhi_keeps_unchanged = True  # type: ignore[attr-defined]
    importer.invalidate_caches = invalidate_caches  # type: ignore[method-assign]
    return True


def _stamp(archive: str) -> tuple[int, int] | None:
    try:
        status = os.stat(archive)
    except OSError:
        return None
    return status.st_mtime_ns, status.st_size
