"""What the notebooks in `notebooks/` share: widgets that fall back to environment variables when
a notebook runs outside Databricks, a `display` that prints there, and one `varadhi.Client` from
the four connection widgets.

    nb = Notebook(globals())          # the notebook's own namespace: `dbutils`, `display`
    display = nb.display
    client = nb.client(spark)         # widgets bootstrap, catalog_topic, kafka_config, warehouse
    NAME = nb.widget("subscription", "", "Subscription")

On Databricks, `dbutils` and `display` are globals of the notebook, not importable, hence the
namespace. Outside it, widget `name` reads `$VARADHI_NB_<NAME>` (or its default), and the
connection widgets default to the same variables as the command line (`VARADHI_BOOTSTRAP`,
`VARADHI_CATALOG_TOPIC`, `VARADHI_KAFKA_CONFIG`, `VARADHI_WAREHOUSE`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def _print(obj: Any) -> None:
    print(obj.to_string() if hasattr(obj, "to_string") else obj)


class Notebook:
    def __init__(self, namespace: Mapping[str, Any], env: Mapping[str, str] | None = None):
        self._dbutils = namespace.get("dbutils")
        self._env = os.environ if env is None else env
        self.on_databricks = self._dbutils is not None
        self.display: Callable[[Any], None] = namespace.get("display") or _print

    def widget(
        self, name: str, default: str, label: str, choices: Sequence[str] | None = None
    ) -> str:
        """The widget's value (a dropdown when `choices` is given); outside Databricks
        `$VARADHI_NB_<NAME>` or `default`."""
        if self._dbutils is None:
            return self._env.get(f"VARADHI_NB_{name.upper()}", default)
        if choices:
            self._dbutils.widgets.dropdown(name, default, list(choices), label)
        else:
            self._dbutils.widgets.text(name, default, label)
        return self._dbutils.widgets.get(name)

    def connection(self) -> dict[str, str]:
        """The connection widgets' values: bootstrap, catalog_topic, kafka_config, warehouse."""
        env = self._env
        return {
            "bootstrap": self.widget(
                "bootstrap",
                env.get("VARADHI_BOOTSTRAP", "127.0.0.1:19092"),
                "Kafka bootstrap servers",
            ),
            "catalog_topic": self.widget(
                "catalog_topic",
                env.get("VARADHI_CATALOG_TOPIC", "__varadhi_catalog"),
                "Catalog topic",
            ),
            "kafka_config": self.widget(
                "kafka_config",
                env.get("VARADHI_KAFKA_CONFIG", ""),
                "Kafka client properties file (security.protocol, sasl.*, ssl.*; secrets as "
                "${env:...})",
            ),
            "warehouse": self.widget(
                "warehouse",
                env.get("VARADHI_WAREHOUSE", ".varadhi/warehouse"),
                "Warehouse (the shards' VARADHI_WAREHOUSE: dbfs:/, s3://, abfss://, a volume path)",
            ),
        }

    def client(self, spark: Any = None):
        """A `varadhi.Client` on the connection widgets (see `connection`) and `spark` (the
        notebook's session; None: the client starts one only when an operation needs it)."""
        from varadhi import Client, Settings

        c = self.connection()
        settings = Settings.from_env(
            c["kafka_config"] or None,
            bootstrap=c["bootstrap"],
            catalog_topic=c["catalog_topic"],
            warehouse=c["warehouse"],
        )
        return Client(settings, spark=spark)
