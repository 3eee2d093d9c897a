# Databricks notebook source
# MAGIC %md
# MAGIC # Subscription status over time
# MAGIC
# MAGIC Every shard publishes a progress document every few seconds to the *progress topic*
# MAGIC (`<catalog topic>_progress`, kept for 7 days, key `<subscription>/<shard>`): its state,
# MAGIC generation, the partitions it reads and the offsets it consumed, delivery rates and totals,
# MAGIC and what waits in its state (blocked groups, RQ/DLQ pending). `varadhi status` shows the
# MAGIC newest document; this notebook reads their history with Spark and plots:
# MAGIC
# MAGIC 1. **lag** per shard and queue: messages produced before each report that the shard had not
# MAGIC    consumed yet (Kafka's `offsets_for_times` gives what had been produced by then);
# MAGIC 2. **rates**: delivered and failed messages per second;
# MAGIC 3. **waiting**: blocked groups and messages pending in the RQ and DLQ.
# MAGIC
# MAGIC Read-only: nothing here changes the subscription.

# COMMAND ----------

# MAGIC %md
# MAGIC ## Set up
# MAGIC
# MAGIC Edit the wheel path to where your workspace keeps it. Locally (`python notebooks/status.py`,
# MAGIC with matplotlib installed: `pip install 'varadhi-spark[notebooks]'`; see docs/notebooks.md)
# MAGIC the `%pip` line is a comment, each widget reads the environment variable
# MAGIC `VARADHI_NB_<WIDGET>` or takes its default, and the plots are written as PNG files to
# MAGIC `plot_dir` (`<subscription>-lag.png`, `-rates.png`, `-waiting.png`). Everything goes
# MAGIC through `varadhi.Client`, the API the `varadhi` command line uses.

# COMMAND ----------

# MAGIC %pip install --no-deps /Volumes/main/varadhi/artifacts/varadhi_spark-0.1.0-py3-none-any.whl kafka-python==3.0.12 mmh3==5.3.1 pycurl==7.49.0

# COMMAND ----------

import os
import time

from varadhi.notebook import Notebook

nb = Notebook(globals())  # `dbutils` and `display` are globals of a Databricks notebook
display = nb.display
widget = nb.widget
ON_DATABRICKS = nb.on_databricks

NAME = widget("subscription", "", "Subscription")
HOURS = float(widget("hours", "6", "Hours of history"))
POINTS = int(widget("points", "120", "Points per shard"))
PLOT_DIR = widget("plot_dir", ".", "Where PNGs go when run locally")
if not NAME:
    raise ValueError("set the `subscription` widget to the subscription's name")

import pandas as pd
from kafka import TopicPartition
from pyspark.sql import functions as F

from varadhi.kafka import clients as kafka_clients
from varadhi.kafka.progress import progress_topic
from varadhi.ops.status import shard_rows

try:
    spark
except NameError:  # not on Databricks: a local session with the project's jars
    from varadhi.spark.session import get_spark

    spark = get_spark("varadhi-status-notebook")

client = nb.client(spark)  # on the widgets bootstrap, catalog_topic, kafka_config, warehouse
settings = client.settings
PROGRESS_TOPIC = progress_topic(settings)


def show(fig, name):
    """Display a matplotlib figure on Databricks; locally, save it as PLOT_DIR/<name>.png."""
    if ON_DATABRICKS:
        display(fig)
    else:
        path = os.path.join(PLOT_DIR, f"{NAME}-{name}.png")
        fig.savefig(path, dpi=100, bbox_inches="tight")
        print(f"saved {path}")


# COMMAND ----------

# MAGIC %md
# MAGIC ## Now
# MAGIC
# MAGIC The newest report of each shard plus Kafka's current end offsets (`varadhi status` on the
# MAGIC command line).

# COMMAND ----------

now = client.status(NAME)
print(f"{NAME}: {now['shard_count']} shard(s), generation {now['generation']}")
display(pd.DataFrame(shard_rows(now)))
print(now["stats"])

# COMMAND ----------

# MAGIC %md
# MAGIC ## Progress history
# MAGIC
# MAGIC A batch read of the progress topic with Spark's Kafka source, the subscription's documents
# MAGIC only, parsed with a schema for the fields plotted below.

# COMMAND ----------

PROGRESS_SCHEMA = (
    "shard INT, state STRING, generation INT, layout INT, updated_ms BIGINT, "
    "blocked_groups BIGINT, held BIGINT, rq_pending BIGINT, dlq_pending BIGINT, "
    "rates MAP<STRING, DOUBLE>, totals MAP<STRING, BIGINT>, "
    "consumed MAP<STRING, MAP<STRING, BIGINT>>, reading MAP<STRING, ARRAY<INT>>"
)
since_ms = int((time.time() - HOURS * 3600) * 1000)
progress = (
    spark.read.format("kafka")
    .options(**kafka_clients.spark_options(settings))
    .option("subscribe", PROGRESS_TOPIC)
    .option("startingOffsets", "earliest")
    .option("endingOffsets", "latest")
    .load()
    .select(F.col("key").cast("string").alias("key"), F.col("value").cast("string").alias("json"))
    .where(F.col("key").startswith(f"{NAME}/"))
    .where(~F.col("key").contains("/standby/"))  # standby instances report there, not shards
    .select(F.from_json("json", PROGRESS_SCHEMA).alias("p"))
    .select("p.*")
    .where(F.col("updated_ms") >= since_ms)
)
history = progress.toPandas()
print(f"{len(history)} progress report(s) of {NAME} in the last {HOURS:g} h")
if history.empty:
    raise RuntimeError(
        f"no progress of {NAME} on {PROGRESS_TOPIC} in the last {HOURS:g} h: "
        "have its shards run? (try a larger `hours`)"
    )


def as_dict(value):
    """A Spark map as a dict, maps inside it too (toPandas gives dicts or lists of pairs)."""
    if value is None:
        return {}
    pairs = value.items() if hasattr(value, "items") else value
    return {k: as_dict(v) if isinstance(v, dict | list) else v for k, v in pairs}


for col in ("rates", "totals", "consumed"):
    history[col] = history[col].map(as_dict)
history["reading"] = history["reading"].map(
    lambda r: {
        t: [int(p) for p in parts] for t, parts in (r.items() if hasattr(r, "items") else r or [])
    }
)
history["time"] = pd.to_datetime(history["updated_ms"], unit="ms", utc=True)

# Downsample: per shard, the last report of each of POINTS equal time buckets.
t0, t1 = history["updated_ms"].min(), history["updated_ms"].max()
width = max(1, (t1 - t0) // max(1, POINTS - 1))
history["bucket"] = (history["updated_ms"] - t0) // width
samples = (
    history.sort_values("updated_ms")
    .groupby(["shard", "bucket"], as_index=False)
    .last()
    .sort_values(["shard", "updated_ms"])
)
display(
    samples[
        ["time", "shard", "state", "generation", "blocked_groups", "rq_pending", "dlq_pending"]
    ].tail(20)
)

# COMMAND ----------

# MAGIC %md
# MAGIC ## Lag over time
# MAGIC
# MAGIC For every sample: per partition the shard read, the offset of the first message produced at
# MAGIC or after the report's time (Kafka `offsets_for_times`; the log end if there is none) minus
# MAGIC the offset the shard had consumed. Queues are told apart by storage-topic name.

# COMMAND ----------

sub = client.subscription(NAME)
QUEUE_OF = {}
for queue, composite in (("main", sub.spec.topic), ("rq", sub.spec.rq_topic)):
    for st in client.topic(composite).storage_topics:
        QUEUE_OF[st.name] = queue


def lag_history(samples):
    """Per sample: (time, shard, main lag, rq lag)."""
    tps = sorted(
        {
            TopicPartition(t, p)
            for reading in samples["reading"]
            for t, parts in reading.items()
            for p in parts
        },
        key=lambda tp: (tp.topic, tp.partition),
    )
    consumer = kafka_clients.consumer(settings, enable_auto_commit=False)
    try:
        ends_now = consumer.end_offsets(tps) if tps else {}
        produced_by = {}  # updated_ms -> {tp: offset of the first message at or after it}
        for ts in sorted(samples["updated_ms"].unique()):
            at = consumer.offsets_for_times({tp: int(ts) for tp in tps}) if tps else {}
            produced_by[ts] = {tp: at[tp].offset if at.get(tp) else ends_now[tp] for tp in tps}
    finally:
        consumer.close()
    rows = []
    for s in samples.itertuples():
        lag = {"main": 0, "rq": 0}
        for t, parts in s.reading.items():
            queue = QUEUE_OF.get(t)
            if queue is None:
                continue
            for p in parts:
                consumed = int((s.consumed.get(t) or {}).get(str(p), 0))
                lag[queue] += max(0, produced_by[s.updated_ms][TopicPartition(t, p)] - consumed)
        rows.append(
            {"time": s.time, "shard": s.shard, "main_lag": lag["main"], "rq_lag": lag["rq"]}
        )
    return pd.DataFrame(rows)


lags = lag_history(samples)
display(lags.tail(20))

# COMMAND ----------

# MAGIC %md
# MAGIC ## Plots

# COMMAND ----------

import matplotlib

if not ON_DATABRICKS:
    matplotlib.use("Agg")
import matplotlib.pyplot as plt


def per_shard(ax, frame, column, title):
    for shard, rows in frame.groupby("shard"):
        ax.plot(rows["time"], rows[column], label=f"shard {shard}")
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize="small")
    ax.grid(alpha=0.3)


fig, axes = plt.subplots(2, 1, figsize=(12, 7), sharex=True)
per_shard(axes[0], lags, "main_lag", "main queue lag (messages)")
per_shard(axes[1], lags, "rq_lag", "retry queue lag (messages)")
fig.autofmt_xdate()
show(fig, "lag")

# COMMAND ----------

rates = samples.assign(
    delivered_per_s=samples["rates"].map(lambda r: r.get("delivered_per_s", 0.0)),
    failures_per_s=samples["rates"].map(lambda r: r.get("failures_per_s", 0.0)),
)
fig, axes = plt.subplots(2, 1, figsize=(12, 7), sharex=True)
per_shard(axes[0], rates, "delivered_per_s", "delivered per second (1-minute window)")
per_shard(axes[1], rates, "failures_per_s", "failed attempts per second")
fig.autofmt_xdate()
show(fig, "rates")

# COMMAND ----------

fig, axes = plt.subplots(3, 1, figsize=(12, 9), sharex=True)
per_shard(axes[0], samples, "blocked_groups", "groups waiting (pending in RQ or DLQ, or held)")
per_shard(axes[1], samples, "rq_pending", "messages pending in the RQ")
per_shard(axes[2], samples, "dlq_pending", "messages parked in the DLQ")
fig.autofmt_xdate()
show(fig, "waiting")
client.close()
