"""`varadhi.notebook.Notebook`: widgets from Databricks' `dbutils` when the notebook has it, else
from `$VARADHI_NB_<NAME>` or the default; `display` from the notebook or a printing one."""

from __future__ import annotations

from varadhi.notebook import Notebook


class FakeWidgets:
    """What the notebooks use of `dbutils.widgets`, recording what was declared."""

    def __init__(self, values: dict[str, str]):
        self.values, self.declared = values, []

    def text(self, name, default, label):
        self.declared.append(("text", name, default, label))

    def dropdown(self, name, default, choices, label):
        self.declared.append(("dropdown", name, default, tuple(choices), label))

    def get(self, name):
        return self.values[name]


class FakeDbutils:
    def __init__(self, values):
        self.widgets = FakeWidgets(values)


def test_outside_databricks_a_widget_reads_its_environment_variable_or_default(capsys):
    nb = Notebook({}, env={"VARADHI_NB_LIMIT": "7"})
    assert not nb.on_databricks
    assert nb.widget("limit", "1000", "Newest N") == "7"
    assert nb.widget("execute", "no", "Execute", ["no", "yes"]) == "no"
    nb.display("a line")
    assert capsys.readouterr().out == "a line\n"


def test_on_databricks_widgets_are_declared_and_read_from_dbutils():
    dbutils = FakeDbutils({"limit": "5", "execute": "yes"})
    shown = []
    nb = Notebook({"dbutils": dbutils, "display": shown.append}, env={"VARADHI_NB_LIMIT": "7"})
    assert nb.on_databricks
    assert nb.widget("limit", "1000", "Newest N") == "5"
    assert nb.widget("execute", "no", "Execute", ["no", "yes"]) == "yes"
    assert dbutils.widgets.declared == [
        ("text", "limit", "1000", "Newest N"),
        ("dropdown", "execute", "no", ("no", "yes"), "Execute"),
    ]
    nb.display("x")
    assert shown == ["x"]


def test_the_connection_widgets_default_to_the_command_lines_variables():
    env = {
        "VARADHI_BOOTSTRAP": "broker:9092",
        "VARADHI_CATALOG_TOPIC": "cat",
        "VARADHI_WAREHOUSE": "s3a://bucket/wh",
        "VARADHI_NB_KAFKA_CONFIG": "/dbfs/kafka.properties",
    }
    assert Notebook({}, env=env).connection() == {
        "bootstrap": "broker:9092",
        "catalog_topic": "cat",
        "kafka_config": "/dbfs/kafka.properties",
        "warehouse": "s3a://bucket/wh",
    }
    assert Notebook({}, env={}).connection() == {
        "bootstrap": "127.0.0.1:19092",
        "catalog_topic": "__varadhi_catalog",
        "kafka_config": "",
        "warehouse": ".varadhi/warehouse",
    }
