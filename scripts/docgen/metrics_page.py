"""docs/reference/metrics.md: every Prometheus metric, read from prometheus_client's registry.

The modules of services/ that use prometheus_client are imported (they define their metrics at
import) and the default registry's collectors are listed; each is traced to the module global
(or the dict of them) that holds it. The build-information metric each service creates when its
metrics server starts is created here by services.common.metrics.start_metrics_server itself,
with the HTTP server left out.
"""

from __future__ import annotations

import ast
import importlib
import math
import pathlib
from unittest import mock

from scripts.docgen import sources
from scripts.docgen.markdown import cell, code, page, table

# The series name a metric of each type is scraped as (histograms and summaries: the base of theirs).
SUFFIX = {"counter": "_total", "info": "_info"}


def metric_modules() -> list[str]:
    """Modules of services/ that import prometheus_client."""
    found = []
    for file, tree in sources.trees().items():
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n.split(".")[0] == "prometheus_client" for n in names):
                found.append(file.removesuffix(".py").replace("/", "."))
                break
    return found


def _holders(modules: list[str]) -> dict[int, str]:
    """id(collector) -> the module that holds it in a global (directly or in a dict / list / tuple)."""
    from prometheus_client.metrics import MetricWrapperBase

    held: dict[int, str] = {}
    for name in modules:
        for value in vars(importlib.import_module(name)).values():
            items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
            for item in items:
                if isinstance(item, MetricWrapperBase):
                    held.setdefault(id(item), name)
    return held


def _build_info(services) -> None:
    """Each service's rlmesh_<service>_build_info, as its metrics server would create it."""
    from services.common import metrics

    with mock.patch("prometheus_client.start_http_server"):
        for service in services:
            metrics.start_metrics_server(service, 0)


def collect() -> list[dict]:
    import prometheus_client
    from prometheus_client.metrics import MetricWrapperBase

    from services.cli import SERVICES

    modules = metric_modules()
    held = _holders(modules)
    _build_info(SERVICES)
    rows = []
    for collector in list(prometheus_client.REGISTRY._collector_to_names):
        if not isinstance(collector, MetricWrapperBase):
            continue  # the process / platform / GC collectors prometheus_client registers itself
        for metric in collector.describe():
            if not metric.name.startswith("rlmesh_"):
                continue
            labels = list(getattr(collector, "_labelnames", ()))
            if metric.type == "info":
                labels = sorted({k for s in collector.collect()[0].samples for k in s.labels})
            bounds = [b for b in getattr(collector, "_upper_bounds", []) if not math.isinf(b)]
            where = held.get(id(collector), "services.common.metrics" if metric.type == "info" else "")
            rows.append({"name": metric.name, "type": metric.type, "help": metric.documentation, "labels": labels,
                         "buckets": bounds, "module": where})
    return sorted(rows, key=lambda r: r["name"])


def _service(name: str) -> str:
    return name.split("_")[1]


def _bucket_text(bounds: list[float]) -> str:
    return ", ".join(f"{b:g}" for b in bounds)


def render() -> str:
    from services.cli import SERVICES

    rows = collect()
    unowned = [r["name"] for r in rows if not r["module"]]
    if unowned:
        raise SystemExit(f"metrics {unowned} are held by no module global of services/ that imports prometheus_client")
    sections = []
    for service in SERVICES:
        mine = [r for r in rows if _service(r["name"]) == service]
        table_rows = []
        for r in mine:
            exposed = code(r["name"] + SUFFIX.get(r["type"], ""))
            help_text = cell(r["help"].rstrip(".")) + "." + (f" Buckets: {_bucket_text(r['buckets'])}." if r["buckets"] else "")
            table_rows.append([exposed, r["type"], ", ".join(code(label) for label in r["labels"]), help_text,
                               code(pathlib.PurePosixPath(*r["module"].split(".")).as_posix() + ".py")])
        sections.append(f"## {service}\n\n" + table(["Series", "Type", "Labels", "Help", "Defined in"], table_rows))
    others = [r["name"] for r in rows if _service(r["name"]) not in SERVICES]
    if others:
        raise SystemExit(f"metrics {others} do not follow rlmesh_<service>_<what>_<unit> with a service of {SERVICES}")
    intro = ("Every service serves Prometheus metrics on its own port (`--metrics_port`; -1 disables, 0 picks a free "
             "one). Names follow `rlmesh_<service>_<what>_<unit>`: counters end in `_total`, durations in `_seconds`, "
             "sizes in `_bytes`. A histogram NAME is scraped as `NAME_bucket`, `NAME_sum` and `NAME_count` (the bucket "
             "bounds below are in the metric's unit; `+Inf` is added). Counters also export a `_created` series. "
             f"{len(rows)} metrics.")
    return page("Prometheus metrics", intro, sections)
