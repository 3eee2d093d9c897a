"""The built wheel, installed into a fresh virtualenv outside the checkout, runs a shard.

One test, in steps: build the wheel offline from a copy of the checkout's sources (`pip wheel
--no-deps --no-build-isolation`, the project venv's setuptools); check its files (the jobs are
in, `varadhi.testing` is not, both console scripts, dependency ranges); make a fresh virtualenv in
a temporary folder and install the wheel into it with `--no-index`; from a working directory
outside the checkout run `varadhi --version`, `varadhi-job --help`, then a shard of a real
subscription with `spark-submit --master local[2]` on the installed `varadhi/jobs/shard.py`,
against the shared broker and a real `TestEndpoint` (from the checkout, in this process), until
it has delivered every message. Outside spark-submit the installed package takes its jars from
`$VARADHI_SPARK_JARS` only, and without them `varadhi-job smoke_count` refuses in one line (the
checkout's `.jars/spark`, the development default, is not found from an installed package).

Third-party libraries: the new venv does not download its dependencies again (pyspark alone is
~450 MB). A folder of symlinks to every entry of the project venv's site-packages *except*
varadhi's (its dist-info, the editable-install .pth that points at the checkout's lib/) is put on
the new venv's path by a .pth file. A .pth in that folder is never processed (it is not a site
directory), and `--system-site-packages` is not used (the project venv's site-packages holds the
editable install, which would expose the checkout). pip in the new venv sees the dependencies
installed, so the install checks the wheel's ranges against the constrained versions. The test
asserts that `varadhi` imports from the new venv and that the checkout's lib/ is not on its path.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import uuid
import zipfile
from pathlib import Path

import pytest

from varadhi.core.subscription_spec import parse_spec
from varadhi.kafka.subscriptions import SubscriptionService
from varadhi.kafka.topics import TopicService
from varadhi.testing.endpoint import TestEndpoint
from varadhi.testing.harness import delivered, produce, wait_for

pytestmark = [pytest.mark.wheel, pytest.mark.spark, pytest.mark.kafka]

ROOT = Path(__file__).resolve().parents[2]
MESSAGES = 12
JOBS = ("shard", "feeder", "replay", "outbox_relay", "smoke_count")


def run(cmd: list[str], timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)
    assert done.returncode == 0, f"{cmd}: exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done


def build_wheel(tmp: Path) -> Path:
    """The wheel of the checkout's current sources, built from a copy (the build writes
    build/ and *.egg-info next to the sources, which must not land in the shared work tree)."""
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(
        ROOT / "lib", src / "lib", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
    )
    dist = tmp / "dist"
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            str(dist),
            str(src),
        ],
        cwd=tmp,
    )
    (wheel,) = dist.glob("varadhi_spark-*.whl")
    return wheel


def third_party_dir(tmp: Path) -> Path:
    """Symlinks to the project venv's installed libraries, varadhi's own entries left out."""
    out = tmp / "third-party"
    out.mkdir()
    folders = dict.fromkeys(sysconfig.get_path(k) for k in ("purelib", "platlib"))
    for entry in (e for folder in folders for e in Path(folder).iterdir()):
        name = entry.name.lower()
        if name.startswith(("varadhi", "__editable__")) or name.endswith(".pth"):
            continue
        if name != "__pycache__" and not (out / entry.name).exists():
            (out / entry.name).symlink_to(entry)
    return out


def fresh_venv(tmp: Path, wheel: Path) -> Path:
    venv = tmp / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    py = venv / "bin" / "python"
    purelib = run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"])
    Path(purelib.stdout.strip(), "third_party.pth").write_text(f"{third_party_dir(tmp)}\n")
    run([str(py), "-m", "pip", "install", "-q", "--no-index", str(wheel)], cwd=tmp)
    return venv


def clean_env(venv: Path, **extra: str) -> dict[str, str]:
    drop = ("PYTHONPATH", "VIRTUAL_ENV", "PYSPARK_GATEWAY_PORT", "PYSPARK_GATEWAY_SECRET")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("SPARK_")}
    env = {
        k: v for k, v in env.items() if k not in ("VARADHI_SPARK_JARS", "VARADHI_SPARK_PACKAGES")
    }
    env.update(
        PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        PYSPARK_PYTHON=str(venv / "bin" / "python"),
        PYSPARK_DRIVER_PYTHON=str(venv / "bin" / "python"),
        SPARK_LOCAL_IP="127.0.0.1",
        **extra,
    )
    return env


@pytest.fixture
def endpoint():
    ep = TestEndpoint()
    ep.start()
    yield ep
    ep.stop()


def test_the_installed_wheel_runs_a_shard_outside_the_checkout(
    settings, catalog, endpoint, tmp_path
):
    wheel = build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as zf:
        files = set(zf.namelist())
        meta = next(zf.read(f).decode() for f in files if f.endswith(".dist-info/METADATA"))
        entry_points = next(
            zf.read(f).decode() for f in files if f.endswith(".dist-info/entry_points.txt")
        )
    assert {f"varadhi/jobs/{job}.py" for job in JOBS} <= files
    assert {
        "varadhi/jobs/runner.py",
        "varadhi/spark/session.py",
        "varadhi/cli/__init__.py",
    } <= files
    assert not [f for f in files if f.startswith("varadhi/testing")], "test helpers in the wheel"
    assert "varadhi-job = varadhi.jobs.runner:main" in entry_points
    assert "varadhi = varadhi.cli:main" in entry_points
    requires = [line for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    assert "Requires-Dist: kafka-python<4,>=3.0" in requires, requires
    assert not [r for r in requires if "==" in r.split(";")[0]], requires

    venv = fresh_venv(tmp_path, wheel)
    work = tmp_path / "work"  # outside the checkout: nothing relative to it can be found
    work.mkdir()
    env = clean_env(
        venv,
        VARADHI_BOOTSTRAP=settings.bootstrap,
        VARADHI_CATALOG_TOPIC=settings.catalog_topic,
        VARADHI_WAREHOUSE=str(tmp_path / "warehouse"),
    )
    py = str(venv / "bin" / "python")
    where = run(
        [
            py,
            "-c",
            "import sys, varadhi, varadhi.jobs.shard as s, pyspark; "
            "print(varadhi.__file__); print(s.__file__); "
            "print(pyspark.__file__); print('\\n'.join(sys.path))",
        ],
        cwd=work,
        env=env,
    ).stdout.splitlines()
    package, shard_py, pyspark_init, path = where[0], where[1], where[2], where[3:]
    assert package.startswith(str(venv)), package
    assert str(ROOT / "lib") not in path and str(ROOT) not in path, path
    gone = subprocess.run(
        [py, "-c", "import varadhi.testing"], cwd=work, env=env, capture_output=True, text=True
    )
    assert gone.returncode == 1 and "No module named 'varadhi.testing'" in gone.stderr

    version = run([str(venv / "bin" / "varadhi"), "--version"], cwd=work, env=env)
    assert version.stdout.strip() == "varadhi-spark 0.1.0"
    jobs_help = run([str(venv / "bin" / "varadhi-job"), "--help"], cwd=work, env=env).stdout
    assert [line.split()[0] for line in jobs_help.splitlines() if line.startswith("  ")] == list(
        JOBS
    )

    suffix = uuid.uuid4().hex[:8]
    topic, name = f"wh-{suffix}", f"whs-{suffix}"
    TopicService(catalog).create(topic, 2)
    SubscriptionService(catalog).create(
        parse_spec(
            {
                "name": name,
                "topic": topic,
                "endpoint": {"url": endpoint.url},
                "shards": 1,
                "consumption": {"trigger_interval": "200ms"},
            }
        )
    )
    ids = [f"m{i:02d}" for i in range(MESSAGES)]
    produce(settings, topic, [(f"g{i % 3}", msg_id) for i, msg_id in enumerate(ids)])

    # spark-submit takes a file: the installed module's. The jars are the launch's (--jars from
    # the configured folder): under spark-submit only those reach the driver's class path.
    jars = ",".join(sorted(str(j) for j in (ROOT / ".jars" / "spark").glob("*.jar")))
    spark_submit = str(Path(pyspark_init).parent / "bin" / "spark-submit")
    log = tmp_path / "shard.log"
    with open(log, "w") as out:
        shard = subprocess.Popen(
            [
                spark_submit,
                "--master",
                "local[2]",
                "--jars",
                jars,
                "--conf",
                "spark.ui.enabled=false",
                "--conf",
                "spark.driver.bindAddress=127.0.0.1",
                "--conf",
                "spark.driver.host=127.0.0.1",
                shard_py,
                "--subscription",
                name,
                "--shard",
                "0",
                "--stop-when-idle",
                "3",
            ],
            cwd=work,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        code = shard.wait(600)
    finally:
        if shard.poll() is None:
            os.killpg(shard.pid, 9)
            shard.wait(30)
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
    assert code == 0, tail
    wait_for(lambda: len(set(delivered(endpoint))) == MESSAGES, 120, "the deliveries")
    assert sorted(set(delivered(endpoint))) == ids
    for g in ("g0", "g1", "g2"):  # per-group order
        assert delivered(endpoint, g) == [i for n, i in enumerate(ids) if f"g{n % 3}" == g]
    assert not (work / ".varadhi").exists()  # the warehouse is where configured

    # Without spark-submit the package starts Spark itself: the jars come only from its
    # configuration (checked without a JVM), and without one it refuses before starting Spark.
    jar_dir = ROOT / ".jars" / "spark"
    configured = run(
        [
            py,
            "-c",
            "from varadhi.spark.session import local_jar_settings as s; print(s()['spark.jars'])",
        ],
        cwd=work,
        env={**env, "VARADHI_SPARK_JARS": str(jar_dir)},
    )
    assert configured.stdout.strip() == jars
    refused = subprocess.run(
        [str(venv / "bin" / "varadhi-job"), "smoke_count", "--topic", f"{topic}.0"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert (
        refused.stderr.strip()
        .splitlines()[-1]
        .startswith(
            "varadhi: spark jars: no Kafka connector and Delta jars for Spark: set VARADHI_SPARK_JARS"
        )
    ), refused.stderr
