# Databricks notebook source
# MAGIC %md
# MAGIC # Dead-letter queue: inspect and re-drive
# MAGIC
# MAGIC Messages land in a subscription's DLQ when their retries ran out or the endpoint's answer
# MAGIC was fatal (a 4xx, by default). In block mode (`on_dead_letter: block`, the default) the
# MAGIC group's later messages wait behind a parked one.
# MAGIC
# MAGIC This notebook:
# MAGIC
# MAGIC 1. lists the parked messages as a DataFrame (reason, HTTP status, attempts, failure times);
# MAGIC 2. summarises them by reason and status, and by group;
# MAGIC 3. lets you pick groups, message ids or a failure-time range;
# MAGIC 4. re-drives (unsidelines) them: each shard puts them back at their original position with
# MAGIC    their attempts reset and delivers them in their group's order, ahead of the group's live
# MAGIC    traffic, which then follows;
# MAGIC 5. watches until every shard applied the re-drive, and lists the DLQ again.
# MAGIC
# MAGIC Re-drive only after the cause is fixed (endpoint bug, missing resource), or the messages park
# MAGIC again. Nothing changes unless the `execute` widget is `yes`.

# COMMAND ----------

# MAGIC %md
# MAGIC ## Set up
# MAGIC
# MAGIC Edit the wheel path to where your workspace keeps it. Locally
# MAGIC (`python notebooks/dlq_inspection.py`, see docs/notebooks.md) the `%pip` line is a comment
# MAGIC and each widget reads the environment variable `VARADHI_NB_<WIDGET>`, or takes its default.
# MAGIC Everything goes through `varadhi.Client`, the API the `varadhi` command line uses.

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
GROUP_FILTER = widget("group_id", "", "Only this group (empty: all)")
LIMIT = int(widget("limit", "1000", "Newest N parked messages (0: all)"))
REDRIVE_GROUPS = widget("redrive_group_ids", "", "Re-drive groups (comma-separated)")
REDRIVE_MESSAGES = widget("redrive_message_ids", "", "Re-drive message ids (comma-separated)")
FAILED_SINCE = widget("failed_since", "", "Re-drive failed since (ISO-8601 or epoch ms)")
FAILED_UNTIL = widget("failed_until", "", "... and until (optional)")
RATE = widget("redrive_rate", "", "Re-drive at most N messages a second (empty: all at once)")
EXECUTE = widget("execute", "no", "Execute the re-drive", ["no", "yes"]) == "yes"
WAIT_S = float(widget("wait_seconds", "300", "Seconds to wait for the shards"))
if not NAME:
    raise ValueError("set the `subscription` widget to the subscription's name")

from varadhi.kafka.dlq import parse_time_ms
from varadhi.ops.status import shard_rows

client = nb.client()  # the widgets bootstrap, catalog_topic, kafka_config, warehouse


def split(text):
    return tuple(x.strip() for x in text.split(",") if x.strip())


def parked_frame():
    """The DLQ as a DataFrame: one row per parked message, newest last."""
    rows = client.dlq_messages(NAME, group_id=GROUP_FILTER or None, limit=LIMIT)
    df = pd.DataFrame(
        rows,
        columns=[
            "msg_id",
            "group_id",
            "state",
            "reason",
            "status",
            "attempts",
            "first_failure_ms",
            "last_failure_ms",
            "origin",
            "topic",
            "partition",
            "offset",
            "value_bytes",
        ],
    )
    for col in ("status", "attempts", "first_failure_ms", "last_failure_ms", "value_bytes"):
        df[col] = pd.to_numeric(df[col]).astype("Int64")  # None -> <NA>
    for col in ("first_failure_ms", "last_failure_ms"):
        df[col.replace("_ms", "")] = pd.to_datetime(df[col].astype("float"), unit="ms", utc=True)
    return df


# COMMAND ----------

# MAGIC %md
# MAGIC ## 1. Parked messages
# MAGIC
# MAGIC `state` is `parked`, `redrive requested` (a re-drive selected it and not every shard has
# MAGIC applied it yet) or `redriven`. The command-line equivalent is `varadhi dlq list NAME`.

# COMMAND ----------

parked = parked_frame()
print(f"{len(parked)} message(s) in the DLQ of {NAME}")
display(parked.drop(columns=["first_failure_ms", "last_failure_ms"]))

# COMMAND ----------

# MAGIC %md
# MAGIC ## 2. By reason and status, and by group
# MAGIC
# MAGIC One reason and status for most messages usually means one cause (an endpoint returning
# MAGIC 404 for a resource that does not exist yet). Groups with many parked messages are the ones
# MAGIC whose traffic waits longest.

# COMMAND ----------

waiting = parked[parked["state"] != "redriven"]
by_reason = (
    waiting.fillna({"reason": "?", "status": -1})
    .groupby(["reason", "status"])
    .agg(
        messages=("msg_id", "count"),
        groups=("group_id", "nunique"),
        first_failure=("first_failure", "min"),
        last_failure=("last_failure", "max"),
    )
    .sort_values("messages", ascending=False)
    .reset_index()
)
display(by_reason)

# COMMAND ----------

by_group = (
    waiting.groupby("group_id", dropna=False)
    .agg(
        messages=("msg_id", "count"),
        reasons=("reason", lambda r: ", ".join(sorted({str(x) for x in r}))),
        oldest_failure=("first_failure", "min"),
    )
    .sort_values(["messages", "oldest_failure"], ascending=[False, True])
    .reset_index()
)
display(by_group.head(50))

# COMMAND ----------

# MAGIC %md
# MAGIC ## 3. Pick what to re-drive
# MAGIC
# MAGIC Set one or more of the widgets `redrive_group_ids`, `redrive_message_ids`, `failed_since`
# MAGIC (with an optional `failed_until`). A message is selected if any of them matches. Selecting
# MAGIC a group re-drives all its parked messages, in order; selecting single messages of a group
# MAGIC leaves the group blocked on the others.

# COMMAND ----------

GROUP_IDS, MESSAGE_IDS = split(REDRIVE_GROUPS), split(REDRIVE_MESSAGES)
since = parse_time_ms(FAILED_SINCE, "failed_since") if FAILED_SINCE else None
until = parse_time_ms(FAILED_UNTIL, "failed_until") if FAILED_UNTIL else 2**63
picked = waiting[
    waiting["group_id"].isin(GROUP_IDS)
    | waiting["msg_id"].isin(MESSAGE_IDS)
    | (waiting["last_failure_ms"].between(since, until) if since is not None else False)
]
print(f"{len(picked)} parked message(s) selected in {picked['group_id'].nunique()} group(s)")
display(picked[["msg_id", "group_id", "reason", "status", "attempts", "last_failure"]])

# COMMAND ----------

# MAGIC %md
# MAGIC ## 4. Re-drive
# MAGIC
# MAGIC Records the re-drive in the catalog; every running shard applies it at its next
# MAGIC micro-batch; with `redrive_rate` N, at most N messages a second in all, a portion each
# MAGIC micro-batch, each group in order. The command-line equivalent is
# MAGIC `varadhi dlq unsideline NAME --group-ids G1 G2 [--rate N/s] --wait 300`.

# COMMAND ----------

op_id = None
if EXECUTE:
    op_id = client.redrive(
        NAME, GROUP_IDS, MESSAGE_IDS, FAILED_SINCE, FAILED_UNTIL, rate=RATE or None
    )
    print(f"re-drive {op_id} recorded")
else:
    print("not executed: set the `execute` widget to `yes` to re-drive the selection")

# COMMAND ----------

# MAGIC %md
# MAGIC ## 5. Watch until applied
# MAGIC
# MAGIC A shard marks the re-drive done once its state holds the messages again (with a rate, all
# MAGIC of them: the selection over the rate takes that many seconds at least). If nothing moves,
# MAGIC check that the shard jobs run and are not paused (`varadhi status`).

# COMMAND ----------

if op_id is not None:
    deadline = time.monotonic() + WAIT_S
    while not (progress := client.redrive_progress(NAME, op_id)).complete:
        print(f"applied by shard(s) {list(progress.done)} of {progress.shard_count}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"re-drive {op_id}: {progress.done} only, after {WAIT_S:g} s")
        time.sleep(5)
    print(f"re-drive {op_id} applied by every shard")
    after = parked_frame()
    display(after[after["msg_id"].isin(picked["msg_id"])][["msg_id", "group_id", "state"]])
display(pd.DataFrame(shard_rows(client.status(NAME))))
client.close()
