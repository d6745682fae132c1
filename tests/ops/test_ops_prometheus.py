"""ops/prometheus and ops/grafana checked with promtool and against the metric names in code."""

from __future__ import annotations

import json
import re
import subprocess

import yaml

from .opsfiles import (
    DASHBOARD,
    OPS,
    PROM_DIR,
    code_metric_names,
    dashboard_exprs,
    promql_metric_names,
)


def _run(cmd: list[str], cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=60)


def _alert_rules() -> list[dict]:
    doc = yaml.safe_load((PROM_DIR / "alerts.yml").read_text())
    return [r for g in doc["groups"] for r in g["rules"] if "alert" in r]


def test_promtool_check_config(promtool: str) -> None:
    res = _run([promtool, "check", "config", "prometheus.yml"], cwd=PROM_DIR)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout + res.stderr


def test_promtool_check_rules(promtool: str) -> None:
    res = _run([promtool, "check", "rules", "alerts.yml"], cwd=PROM_DIR)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"{len(_alert_rules())} rules found" in res.stdout


def test_promtool_test_rules(promtool: str) -> None:
    res = _run([promtool, "test", "rules", "alerts_test.yml"], cwd=PROM_DIR)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout


def test_every_alert_has_a_firing_and_a_silent_unit_test() -> None:
    tests = yaml.safe_load((PROM_DIR / "alerts_test.yml").read_text())["tests"]
    cases = [c for t in tests for c in t.get("alert_rule_test", [])]
    for rule in _alert_rules():
        name = rule["alert"]
        mine = [c for c in cases if c["alertname"] == name]
        assert any(c.get("exp_alerts") for c in mine), f"{name}: no test where it fires"
        assert any(not c.get("exp_alerts") for c in mine), f"{name}: no test where it stays silent"


def test_required_alerts_exist() -> None:
    exprs = {r["alert"]: r["expr"] for r in _alert_rules()}
    needed = {
        "runner down": 'up{job="kvserve-runner"}',
        "KV cache near full": "kvserve_kv_cache_usage_ratio",
        "TTFT p95": "kvserve_time_to_first_token_seconds_bucket",
        "invariant violation": "kvserve_memsvc_invariant_violations_total",
        "lease reclaims": "kvserve_memsvc_leases_reclaimed_total",
        "error rate": "kvserve_request_errors_total",
    }
    for what, needle in needed.items():
        assert any(needle in e for e in exprs.values()), f"no alert on {what} ({needle})"


def test_alert_and_dashboard_metrics_exist_in_code() -> None:
    known = code_metric_names()
    used: dict[str, str] = {}
    for rule in _alert_rules():
        for name in promql_metric_names(rule["expr"]):
            used.setdefault(name, f"alert {rule['alert']}")
    for title, expr in dashboard_exprs():
        for name in promql_metric_names(expr):
            used.setdefault(name, f"panel {title!r}")
    assert len(used) >= 20, sorted(used)
    missing = {n: where for n, where in used.items() if n not in known}
    assert not missing, f"metric names not defined by any kvserve metrics class: {missing}"


def test_up_jobs_match_scrape_config() -> None:
    cfg = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
    jobs = {j["job_name"] for j in cfg["scrape_configs"]}
    exprs = [r["expr"] for r in _alert_rules()] + [e for _, e in dashboard_exprs()]
    referenced = {m for e in exprs for m in re.findall(r'job="([^"]+)"', e)}
    assert referenced, "no alert or panel selects a job"
    assert referenced <= jobs, f"jobs not scraped: {referenced - jobs}"


def test_scrape_ports_match_config_defaults() -> None:
    from kvserve.config.frontend import FrontendConfig
    from kvserve.config.memsvc import MemsvcConfig
    from kvserve.config.runner import RunnerConfig

    cfg = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
    ports = {j["job_name"]: {t.rsplit(":", 1)[1] for s in j["static_configs"] for t in s["targets"]}
             for j in cfg["scrape_configs"]}
    assert ports["kvserve-frontend"] == {str(FrontendConfig().metrics_port)}
    assert ports["kvserve-memsvc"] == {str(MemsvcConfig().metrics_port)}
    assert str(RunnerConfig().metrics_port) in ports["kvserve-runner"]


def test_dashboard_queries_are_valid_promql(promtool: str, tmp_path) -> None:
    rules = [{"record": f"kvserve:dashboard_query:{i}",
              "expr": expr.replace("$__rate_interval", "1m")}
             for i, (_, expr) in enumerate(dashboard_exprs())]
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    res = _run([promtool, "check", "rules", str(path)])
    assert res.returncode == 0, res.stdout + res.stderr


def test_dashboard_shape_and_datasource_uid() -> None:
    dash = json.loads(DASHBOARD.read_text())
    ds = yaml.safe_load((OPS / "grafana/provisioning/datasources/kvserve.yml").read_text())
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus"
    assert dash["uid"] and dash["title"] and isinstance(dash["schemaVersion"], int)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for p in dash["panels"]:
        g = p["gridPos"]
        assert g["w"] > 0 and g["h"] > 0 and g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == source["uid"], p["title"]
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == source["uid"] and t["expr"].strip(), p["title"]
    titles = " | ".join(p["title"].lower() for p in dash["panels"])
    for needed in ("time to first token", "inter-token", "end-to-end", "throughput",
                   "running and waiting", "kv slots by state", "prefix cache hit rate",
                   "preemptions", "memsvc step latency", "leases", "errors by code"):
        assert needed in titles, f"dashboard lacks a panel on {needed}"


def test_dashboard_provisioning_points_at_a_folder() -> None:
    prov = yaml.safe_load((OPS / "grafana/provisioning/dashboards/kvserve.yml").read_text())
    (provider,) = prov["providers"]
    assert provider["type"] == "file"
    assert provider["options"]["path"].startswith("/")
