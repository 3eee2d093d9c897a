"""The local file system of `./spark-submit.sh` (jvm/src/varadhi/hadoop, built by scripts/setup
into .jars/localfs): Hadoop's answers, without its child processes.

A small Java program, compiled here against pyspark's Hadoop, renames files through FileContext
(as Spark's streaming checkpoints do) and prints `getFileLinkStatus` of a file, a directory, a
symbolic link and a missing path. It runs with a `readlink` spy first on its PATH: Hadoop's own
raw local file system starts `readlink` for every such call, which cost each checkpoint entry
about 27 ms on 2 cores."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOCALFS_JAR = ROOT / ".jars" / "localfs" / "varadhi-localfs.jar"

PROBE = r"""
import java.io.FileNotFoundException;
import java.net.URI;
import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.fs.*;

public class Probe {
  static String show(FileStatus s) {
    return "{\"dir\": " + s.isDirectory() + ", \"link\": " + s.isSymlink()
        + ", \"len\": " + s.getLen() + ", \"perm\": \"" + s.getPermission() + "\"}";
  }

  public static void main(String[] args) throws Exception {
    Configuration conf = new Configuration();
    RawLocalFileSystem fs = args[0].equals("hadoop")
        ? new RawLocalFileSystem() : new varadhi.hadoop.InProcessRawLocalFileSystem();
    fs.initialize(URI.create("file:///"), conf);
    String dir = args[1];
    for (String name : new String[] {"file", "dir", "link", "missing"}) {
      try {
        System.out.println("{\"" + name + "\": " + show(fs.getFileLinkStatus(new Path("file:" + dir + "/" + name))) + "}");
      } catch (FileNotFoundException e) {
        System.out.println("{\"" + name + "\": \"not found\"}");
      }
    }
    if (!args[0].equals("hadoop")) {  // FileContext over the product's file system, as Spark uses it
      conf.set("fs.AbstractFileSystem.file.impl", "varadhi.hadoop.InProcessLocalFs");
      FileContext fc = FileContext.getFileContext(URI.create("file:///"), conf);
      Path tmp = new Path("file:" + dir + "/entry.tmp"), entry = new Path("file:" + dir + "/entry");
      try (FSDataOutputStream out = fc.create(tmp, java.util.EnumSet.of(CreateFlag.CREATE))) {
        out.writeBytes("v1\n");
      }
      fc.rename(tmp, entry, Options.Rename.OVERWRITE);
      System.out.println("{\"renamed\": " + show(fc.getFileStatus(entry)) + "}");
    }
  }
}
"""


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    if not LOCALFS_JAR.exists():
        pytest.fail(f"{LOCALFS_JAR} is missing: run scripts/setup")
    import pyspark

    jars = Path(pyspark.__file__).parent / "jars"
    classpath = ":".join(
        [str(LOCALFS_JAR)]
        + [str(j) for j in jars.glob("hadoop-client-*.jar")]
        + [str(j) for j in jars.glob("slf4j-api-*.jar")]
        + [str(j) for j in jars.glob("commons-logging-*.jar")]
    )
    build = tmp_path_factory.mktemp("probe")
    (build / "Probe.java").write_text(PROBE)
    subprocess.run(
        ["javac", "-nowarn", "--release", "17", "-cp", classpath, "-d", str(build), "Probe.java"],
        cwd=build,
        check=True,
    )
    spy = tmp_path_factory.mktemp("bin")
    calls = spy / "calls"
    (spy / "readlink").write_text(
        f'#!/bin/sh\necho "$@" >> {calls}\nexec {shutil.which("readlink")} "$@"\n'
    )
    (spy / "readlink").chmod(0o755)

    def run(impl: str) -> tuple[dict, int]:
        data = tmp_path_factory.mktemp("data")
        (data / "file").write_text("twelve bytes")
        (data / "dir").mkdir()
        os.symlink(data / "file", data / "link")
        calls.unlink(missing_ok=True)
        env = {**os.environ, "PATH": f"{spy}:{os.environ['PATH']}"}
        out = subprocess.run(
            ["java", "-cp", f"{build}:{classpath}", "Probe", impl, str(data)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        seen: dict = {}
        for line in out.splitlines():
            if line.startswith("{"):
                seen.update(json.loads(line))
        started = len(calls.read_text().splitlines()) if calls.exists() else 0
        return seen, started

    return run


def test_a_files_link_status_is_hadoops_without_a_readlink_process(probe):
    hadoop, hadoop_started = probe("hadoop")
    ours, ours_started = probe("varadhi")
    assert hadoop_started >= 3  # the spy sees Hadoop's readlink: this test can tell
    for name in ("file", "dir", "missing"):
        assert ours[name] == hadoop[name], name
    assert ours["file"] == {"dir": False, "link": False, "len": 12, "perm": ours["file"]["perm"]}
    assert ours["dir"]["dir"] is True and ours["missing"] == "not found"
    assert ours["link"] == hadoop["link"]  # a symbolic link still goes Hadoop's way
    # Only the link started readlink; FileContext's rename of a checkpoint-like entry (and its
    # .crc) started none.
    assert ours_started == 1
    assert ours["renamed"]["len"] == 3 and ours["renamed"]["link"] is False
