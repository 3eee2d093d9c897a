# Databricks notebook source
# MAGIC %md
# MAGIC # Offset reset of a subscription
# MAGIC
# MAGIC Moves a subscription's shards to other positions of one of its queues, the way
# MAGIC `kafka-consumer-groups --reset-offsets` does for a consumer group:
# MAGIC
# MAGIC | queue | allowed | typical use |
# MAGIC |---|---|---|
# MAGIC | `main` | rewind and fast-forward | replay since an incident (`--to-datetime`), skip a poison backlog (`--to-latest`) |
# MAGIC | `rq`, `dlq` | fast-forward only | drop retries or dead letters nobody will re-drive |
# MAGIC
# MAGIC What to know before you start:
# MAGIC
# MAGIC * **Rewinding re-delivers.** Every replayed message is delivered again with its original
# MAGIC   idempotency key (message id); the endpoint must de-duplicate or tolerate repeats.
# MAGIC * **Fast-forwarding skips.** Skipped messages are never delivered. For the RQ and DLQ, groups
# MAGIC   that were waiting on a skipped message are unblocked.
# MAGIC * **The shards must be stopped or paused.** This notebook pauses the subscription, resets,
# MAGIC   and resumes it. The reset starts a new checkpoint *generation*: shards start again from
# MAGIC   the new positions with fresh checkpoints.
# MAGIC * Always look at the dry run first: it lists, per shard and partition, the current and the
# MAGIC   new offset and how many messages are skipped or replayed.
# MAGIC
# MAGIC Steps: **1** set up, **2** inspect, **3** pause, **4** dry run, **5** execute, **6** resume and
# MAGIC verify. Nothing changes before step 3, and step 5 runs only when the `execute` widget says
# MAGIC `yes`, so *Run all* is a safe way to get a dry run.

# COMMAND ----------

# MAGIC %md
# MAGIC ## 1. Set up
# MAGIC
# MAGIC Installs the varadhi-spark wheel (edit the path to where your workspace keeps it). `--no-deps`
# MAGIC keeps the runtime's own pyspark; the three packages after it are what varadhi adds. Run
# MAGIC locally (`python notebooks/offset_reset.py`, see docs/notebooks.md), the `%pip` line is a
# MAGIC comment and each widget reads the environment variable `VARADHI_NB_<WIDGET>` instead
# MAGIC (`VARADHI_NB_SUBSCRIPTION=orders-sub`), or takes its default.
# MAGIC
# MAGIC Everything below goes through `varadhi.Client`, the same API the `varadhi` command line
# MAGIC uses: `client.reset_offsets(...)` is `varadhi offsets reset ...`.

# COMMAND ----------

# MAGIC %pip install --no-deps /Volumes/main/varadhi/artifacts/varadhi_spark-0.1.0-py3-none-any.whl kafka-python==3.0.12 mmh3==5.3.1 pycurl==7.49.0

# COMMAND ----------

import time

import pandas as pd

from varadhi.notebook import Notebook

nb = Notebook(globals())  # `dbutils` and `display` are globals of a Databricks notebook
display = nb.display
widget = nb.widget

NAME = widget("subscription", "", "Subscription")
QUEUE = widget("queue", "main", "Queue", ["main", "rq", "dlq"])
MODE = widget(
    "mode",
    "to-datetime",
    "Reset to",
    ["to-datetime", "to-earliest", "to-latest", "shift-by", "to-storage-topic"],
)
TO_DATETIME = widget("to_datetime", "2026-01-01T00:00:00Z", "--to-datetime (ISO-8601, UTC)")
SHIFT_BY = widget("shift_by", "0", "--shift-by N (negative: back)")
STORAGE_TOPIC = widget("storage_topic", "0", "--to-storage-topic index (main only)")
EXECUTE = widget("execute", "no", "Execute the reset", ["no", "yes"]) == "yes"
WAIT_S = float(widget("wait_seconds", "120", "Seconds to wait for shards"))
if not NAME:
    raise ValueError("set the `subscription` widget to the subscription's name")

from varadhi.ops.status import shard_rows

client = nb.client(globals().get("spark"))  # Databricks' session; locally one starts if needed


def show_status():
    """Each shard's state, generation, lag, pending and rates (`varadhi status`)."""
    doc = client.status(NAME)
    display(pd.DataFrame(shard_rows(doc)))
    return doc


# COMMAND ----------

# MAGIC %md
# MAGIC ## 2. Inspect
# MAGIC
# MAGIC The subscription's state (paused flag, generation, shard count) and which partitions each
# MAGIC shard owns; then each shard's lag, rates and blocked groups. Check that no other operation
# MAGIC (a shard-count change) is in progress.

# COMMAND ----------

info = client.describe_subscription(NAME)
print(
    f"{NAME}: topic {info['spec']['topic']}, endpoint {info['spec']['endpoint']['url']}, "
    f"{info['state']['shard_count']} shard(s), paused={info['state']['paused']}, "
    f"generation {info['state']['generation']}"
)
display(
    pd.DataFrame(
        [
            {
                "shard": s["shard"],
                "queue": queue,
                "storage topic": a["storage_topic"],
                "partitions": a["partitions"],
            }
            for s in info["shards"]
            for queue in ("mq", "rq", "dlq")
            for a in s[queue]
        ]
    )
)

# COMMAND ----------

before = client.subscription(NAME)
# Multi-step operations (change-shards, offset-reset) record a `step`; re-drives do not block.
in_progress = {
    k: v for k, v in show_status()["operations"].items() if v.get("step", "done") != "done"
}
if in_progress:
    raise RuntimeError(f"operations in progress, finish them first: {in_progress}")
print(f"generation {before.generation}, {before.shard_count} shard(s), paused={before.paused}")

# COMMAND ----------

# MAGIC %md
# MAGIC ## 3. Pause
# MAGIC
# MAGIC Shards honour a pause between micro-batches and report `paused`. The reset refuses to run
# MAGIC while any shard may still be running (`client.running_shards`: the rule every operation
# MAGIC uses). Stopping the shard jobs works as well.

# COMMAND ----------

if EXECUTE:
    client.pause(NAME)
    deadline = time.monotonic() + WAIT_S
    while running := client.running_shards(NAME):
        if time.monotonic() > deadline:
            raise TimeoutError(f"shards still running after {WAIT_S:g} s: {running}")
        time.sleep(2)
    print(f"paused {NAME}: no shard is running")
else:
    print("dry run only (execute widget is `no`): not pausing")

# COMMAND ----------

# MAGIC %md
# MAGIC ## 4. Dry run
# MAGIC
# MAGIC Per shard, storage topic and partition: the current offset, the new one, and how many
# MAGIC messages are skipped (`delta` > 0) or replayed (`delta` < 0). Nothing changes.

# COMMAND ----------

VALUE = {"to-datetime": TO_DATETIME, "shift-by": SHIFT_BY, "to-storage-topic": STORAGE_TOPIC}.get(
    MODE
)


def reset(execute):
    """`varadhi offsets reset` for the widgets' queue and target; a dry run unless `execute`."""
    result = client.reset_offsets(NAME, QUEUE, MODE, VALUE, execute=execute)
    summary = result.summary
    display(pd.DataFrame(summary["moves"]))
    counts = f"{summary['skipped']} messages skipped, {summary['replayed']} replayed"
    if result.outcome == "done":
        print(f"done already and no shard has consumed since: nothing changed ({counts})")
    elif execute:
        print(f"reset ({result.outcome}): {counts}")
    else:
        print(f"would reset ({result.outcome}; dry run, nothing changed): {counts}")
    return result


dry_run = reset(execute=False)

# COMMAND ----------

# MAGIC %md
# MAGIC ## 5. Execute
# MAGIC
# MAGIC Only with the `execute` widget set to `yes`. The plan is computed again from the same
# MAGIC positions, so it matches the dry run unless messages arrived in between (`to-latest`
# MAGIC then skips those too). A reset that crashed part way can simply be run again.

# COMMAND ----------

executed = None
if EXECUTE:
    executed = reset(execute=True)
else:
    print("not executed: set the `execute` widget to `yes` and run from step 3")

# COMMAND ----------

# MAGIC %md
# MAGIC ## 6. Resume and verify
# MAGIC
# MAGIC After a main-queue or RQ reset the generation is one higher. Resume, then watch the shards
# MAGIC report the new generation (once their jobs are running) and their lag. Without running
# MAGIC shard jobs this waits `wait_seconds` and shows what the shards last reported.

# COMMAND ----------

if EXECUTE:
    after = client.subscription(NAME)
    print(f"generation {before.generation} -> {after.generation}")
    client.resume(NAME)
    deadline = time.monotonic() + WAIT_S
    while True:
        shards = client.status(NAME)["shards"]
        if all(s["generation"] == after.generation and s["state"] == "running" for s in shards):
            break
        if time.monotonic() > deadline:
            break
        time.sleep(2)
    print({s["shard"]: (s["state"], s["generation"]) for s in shards})
show_status()
client.close()
