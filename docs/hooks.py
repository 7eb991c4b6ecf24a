"""MkDocs hooks (mkdocs.yml `hooks:`): tables generated from the code at build time, so that the
reference pages stay true to it. A page asks for one with a marker line, e.g. `<!-- paratrain:metrics -->`."""

from __future__ import annotations

import dataclasses
from typing import Any


def _metrics_table() -> str:
    """Every Prometheus series the scheduler's /metrics and `paratrain serve`'s /metrics export."""
    from paratrain.metrics.prometheus import BoardCollector
    from paratrain.serve.app import ServeMetrics

    class _NoJob:  # the collector yields every family, with no samples, for a job of no processes
        def state(self) -> dict[str, Any]:
            return {"roles": [], "workers": [], "servers": [], "job": {}}

    rows = ["| name | type | labels | where | what |", "| --- | --- | --- | --- | --- |"]
    job, serve = BoardCollector(_NoJob()).collect(), ServeMetrics(32).registry.collect()
    for where, families in (("scheduler", job), ("serve", serve)):
        for family in families:
            name = family.name + ("_total" if family.type == "counter" else "")
            labels = ", ".join(f"`{label}`" for label in getattr(family, "_labelnames", ()))
            rows.append(f"| `{name}` | {family.type} | {labels} | {where} | {family.documentation} |")
    return "\n".join(rows)


def _strategy_names_table() -> str:
    """What each strategy name stands for: the fields it sets apart from the defaults."""
    from paratrain.train.strategy import NAMED, Strategy

    default = Strategy()
    rows = ["| name | the strategy |", "| --- | --- |"]
    for name, strategy in NAMED.items():
        changed = [
            f"{f.name}={getattr(strategy, f.name)!r}"
            for f in dataclasses.fields(strategy)
            if getattr(strategy, f.name) != getattr(default, f.name) or f.name == "architecture"
        ]
        rows.append(f"| `{name}` | `Strategy({', '.join(changed)})` |")
    return "\n".join(rows)


TABLES = {
    "<!-- paratrain:metrics -->": _metrics_table,
    "<!-- paratrain:strategy-names -->": _strategy_names_table,
}


def on_page_markdown(markdown: str, **_: Any) -> str:
    for marker, table in TABLES.items():
        if marker in markdown:
            markdown = markdown.replace(marker, table())
    return markdown
