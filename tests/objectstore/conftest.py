"""The object-storage tier: the warehouse on `s3a://` in a real S3-compatible store.

One SeaweedFS for the tier (`scripts/s3`: a running one is reused, else one is started here and
stopped with its data at the end), the shared Kafka broker, and the run's one SparkSession with
the store's `fs.s3a.*` settings (`varadhi.spark.s3a.hadoop_conf` of the `VARADHI_S3A_*`
variables `scripts/s3` prints, also exported to this process so the CLI and any subprocess see
them). The warehouse is `s3a://<bucket>/run-<id>/warehouse`; every test runs with it as
`$VARADHI_WAREHOUSE` and with a fresh, empty working directory, which must stay empty: nothing
of the warehouse may land on the local disk.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
S3 = str(ROOT / "scripts" / "s3")


def pytest_collection_modifyitems(items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.objectstore)


def _exports(text: str) -> dict[str, str]:
    """`export NAME=value` lines -> {NAME: value}."""
    out = {}
    for line in text.splitlines():
        if line.startswith("export ") and "=" in line:
            name, _, value = line[len("export ") :].partition("=")
            out[name] = value
    return out


@pytest.fixture(scope="session")
def object_store():
    """The S3 settings of a running SeaweedFS (`VARADHI_S3A_*`, `VARADHI_S3_BUCKET`), exported
    to this process for the tier's duration."""
    running = subprocess.run([S3, "status"], capture_output=True, text=True).returncode == 0
    command = "env" if running else "start"
    done = subprocess.run([S3, command], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        pytest.fail(f"scripts/s3 {command} failed: {done.stderr[-2000:]}")
    env = _exports(done.stdout)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield env
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    if not running:
        subprocess.run([S3, "stop"], capture_output=True, timeout=120)


@pytest.fixture(scope="session")
def s3_spark(object_store, spark):
    """The run's SparkSession, reaching the store (settings also made on a session that an
    earlier tier started before they were known)."""
    from varadhi.spark import s3a

    s3a.configure(spark, s3a.hadoop_conf(os.environ))
    return spark


@pytest.fixture(scope="session")
def s3_settings(object_store, bootstrap):
    from varadhi.kafka.settings import Settings

    warehouse = f"s3a://{object_store['VARADHI_S3_BUCKET']}/run-{uuid.uuid4().hex[:8]}/warehouse"
    return Settings(
        bootstrap=bootstrap, catalog_topic=os.environ["VARADHI_CATALOG_TOPIC"], warehouse=warehouse
    )


@pytest.fixture(scope="session")
def s3_catalog(s3_settings):
    from varadhi.kafka.catalog import Catalog

    cat = Catalog(s3_settings)
    yield cat
    cat.close()


@pytest.fixture(autouse=True)
def on_object_store(s3_settings, tmp_path, monkeypatch):
    """Each test: `$VARADHI_WAREHOUSE` on the store and an empty working directory that must
    stay empty (no `.varadhi/warehouse`, no `spark-warehouse`, nothing)."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.setenv("VARADHI_WAREHOUSE", s3_settings.warehouse)
    monkeypatch.chdir(cwd)
    yield cwd
    assert sorted(p.name for p in cwd.iterdir()) == [], "files were written to the local disk"
