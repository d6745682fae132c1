"""Helpers of the ops tests: where ops/ is and which metric names the code and PromQL use."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OPS = ROOT / "ops"
PROM_DIR = OPS / "prometheus"
DASHBOARD = OPS / "grafana" / "dashboards" / "kvserve.json"
SYSTEMD_DIR = OPS / "systemd"

# A kvserve metric reference inside PromQL: all kvserve metrics share the prefix.
METRIC_RE = re.compile(r"\bkvserve_[a-zA-Z0-9_:]+")


def promql_metric_names(expr: str) -> set[str]:
    """kvserve_* series names an expression reads (label values in quotes are skipped)."""
    unquoted = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    return set(METRIC_RE.findall(unquoted))


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, expr) for every query of the Grafana dashboard."""
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]


def code_metric_names() -> set[str]:
    """Every series name the metrics classes of the code export."""
    from kvserve.frontend.metrics import FrontendMetrics
    from kvserve.memsvc.metrics import MemsvcMetrics
    from kvserve.metrics import exported_names
    from kvserve.runner.metrics import RunnerMetrics

    names: set[str] = set()
    for obj in (RunnerMetrics(), FrontendMetrics(), MemsvcMetrics()):
        names |= exported_names(obj.registry)
    return names
