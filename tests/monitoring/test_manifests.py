"""manifests/monitoring offline: the resources against the Prometheus Operator's CRD schemas,
the kustomization, the alerts through promtool (check and unit tests), the dashboard's shape,
and every metric either names against the sidecar's own registry — so a metric renamed in code
fails here, on every machine, before any Prometheus is started (test_prometheus.py then proves
the selectors against a real one)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from sidecar.observability.metrics import Metrics
from tests.k8s import MANIFESTS, crd_schemas, documents, kustomize, validate
from tests.monitoring.assets import (
    DASHBOARD,
    JOB,
    MONITORING,
    OPERATIONS,
    PODMONITOR,
    RULE_TESTS,
    alert_rules,
    binary,
    dashboard,
    dashboard_queries,
    load_yaml,
    metric_names,
    panels,
    rule_queries,
    selectors,
    variables,
    write_rules_file,
)

SEVERITIES = {"warning", "critical"}

# Series Prometheus itself adds to every target, which the rules and dashboard may use.
PROMETHEUS_SERIES = {"up"}

# What an operator needs to see on the dashboard, by panel title.
REQUIRED_PANELS = {
    "Request rate by decision",
    "Prefill leg",
    "Time to first byte",
    "Decode leg",
    "Total",
    "TTFT p50 and p99",
    "Fallbacks by reason",
    "Reserved prompt tokens per endpoint",
    "Waiting requests per endpoint",
    "Sidecars not using an endpoint",
    "Ejections per endpoint",
    "In-flight requests",
}
REQUIRED_ALERTS = {
    "PdSidecarHighFallbackRate",
    "PdSidecarPrefillEndpointEjected",
    "PdSidecarKVReleasesFailing",
    "PdSidecarTTFTP99High",
    "PdSidecarDecodeEngineNotReady",
    "PdSidecarTargetDown",
}


# --- CRD schemas ------------------------------------------------------------------------------


def test_resources_match_the_operators_crds() -> None:
    """The built kustomization (both resources and the dashboard's ConfigMap) against the
    Prometheus Operator's CRDs vendored in tests/crds/ and Kubernetes' own schemas."""
    validate(kustomize(MONITORING))


def test_strict_validation_catches_a_typo() -> None:
    """The validation above would notice a misspelt field (the API server would drop it)."""
    resource = load_yaml(PODMONITOR)
    assert (resource["apiVersion"], resource["kind"]) in crd_schemas()
    resource["spec"]["podMetricsEndpoints"][0]["intervall"] = "15s"
    with pytest.raises(AssertionError, match="intervall"):
        validate(yaml.safe_dump(resource))


def test_podmonitor_scrapes_the_sidecar_port_as_one_job() -> None:
    spec = load_yaml(PODMONITOR)["spec"]
    (endpoint,) = spec["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    assert {"action": "replace", "targetLabel": "job", "replacement": JOB} in endpoint[
        "relabelings"
    ]
    assert spec["selector"]["matchLabels"]


@pytest.mark.parametrize("overlay", ["standalone", "gateway", "emulated"])
def test_podmonitor_finds_exactly_the_injected_pods_on_their_metrics_port(overlay: str) -> None:
    """In every overlay, the PodMonitor's selector matches the decode pods (the injection labels
    them) and no other pod, and the port it names is the sidecar's, the one its /metrics is on
    (the admin port, SIDECAR_ADMIN_PORT)."""
    spec = load_yaml(PODMONITOR)["spec"]
    selector = spec["selector"]["matchLabels"]
    (endpoint,) = spec["podMetricsEndpoints"]
    scraped = []
    for doc in documents(kustomize(MANIFESTS / "overlays" / overlay)):
        template = (doc.get("spec") or {}).get("template")
        if doc["kind"] not in ("Deployment", "StatefulSet") or template is None:
            continue
        labels = template["metadata"].get("labels") or {}
        if selector.items() <= labels.items():
            scraped.append(doc["metadata"]["name"])
            (sidecar,) = template["spec"]["initContainers"]
            ports = {port["name"]: port["containerPort"] for port in sidecar["ports"]}
            env = {item["name"]: item["value"] for item in sidecar["env"]}
            assert ports[endpoint["port"]] == int(env["SIDECAR_ADMIN_PORT"])
    assert scraped == ["decode"]


# --- kustomization ----------------------------------------------------------------------------


def test_kustomization_lists_everything() -> None:
    kustomization = load_yaml(MONITORING / "kustomization.yaml")
    assert sorted(kustomization["resources"]) == ["podmonitor.yaml", "prometheusrule.yaml"]
    (generator,) = kustomization["configMapGenerator"]
    assert generator["files"] == [str(DASHBOARD.relative_to(MONITORING))]
    assert generator["options"]["labels"]["grafana_dashboard"] == "1"
    for name in kustomization["resources"] + generator["files"]:
        assert (MONITORING / name).is_file(), name


def test_kustomize_builds() -> None:
    objects = {(o["kind"], o["metadata"]["name"]): o for o in documents(kustomize(MONITORING))}
    assert set(objects) == {
        ("ConfigMap", "pd-sidecar-dashboard"),
        ("PodMonitor", "pd-sidecar"),
        ("PrometheusRule", "pd-sidecar"),
    }
    config_map = objects["ConfigMap", "pd-sidecar-dashboard"]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(config_map["data"]["pd-sidecar.json"]) == dashboard()


# --- alerts -----------------------------------------------------------------------------------


def test_promtool_check_rules(tmp_path: Path) -> None:
    rules = write_rules_file(tmp_path / "rules.yaml")
    checked = subprocess.run(
        [binary("promtool"), "check", "rules", str(rules)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in checked.stdout


def test_promtool_unit_tests(tmp_path: Path) -> None:
    write_rules_file(tmp_path / "rules.yaml")
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    tested = subprocess.run(
        [binary("promtool"), "test", "rules", RULE_TESTS.name],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        check=False,
    )
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout


def test_every_alert_has_a_unit_test_that_fires_it() -> None:
    cases = load_yaml(RULE_TESTS)["tests"]
    fired = {
        case["alertname"]
        for test in cases
        for case in test.get("alert_rule_test", [])
        if case["exp_alerts"]
    }
    assert fired == {rule["alert"] for rule in alert_rules()}


def test_alerts_are_actionable() -> None:
    names = [rule["alert"] for rule in alert_rules()]
    assert len(names) == len(set(names))
    assert set(names) >= REQUIRED_ALERTS
    headings = set(re.findall(r"^### (\w+)$", OPERATIONS.read_text(), flags=re.MULTILINE))
    for rule in alert_rules():
        name = rule["alert"]
        assert re.fullmatch(r"\d+m", rule.get("for", "")), f"{name}: no `for` in minutes"
        assert rule["labels"]["severity"] in SEVERITIES, name
        annotations = rule["annotations"]
        assert annotations["summary"], name
        assert annotations["description"], name
        assert annotations["runbook_url"] == f"docs/operations.md#{name.lower()}"
        assert name in headings, f"{name}: no '### {name}' section in docs/operations.md"


# --- dashboard --------------------------------------------------------------------------------


def test_dashboard_shape() -> None:
    board = dashboard()
    by_name = {v["name"]: v for v in variables(board)}
    assert by_name["datasource"]["type"] == "datasource"
    assert by_name["datasource"]["query"] == "prometheus"
    every = panels(board)
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    assert {panel["title"] for panel in every} >= REQUIRED_PANELS
    assert {panel["type"] for panel in every if panel["title"] in ("Prefill leg", "Total")} == {
        "heatmap"
    }
    for panel in every:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"], panel["title"]
    for variable in variables(board):
        if variable["type"] == "query":
            assert variable["datasource"]["uid"] == "${datasource}"


# --- metric names -----------------------------------------------------------------------------


def _exported_names() -> set[str]:
    """Every sample name the sidecar's registry can produce (labelled families included, which
    have no sample before their first use; no ``_created``, which /metrics leaves out)."""
    names: set[str] = set()
    for family in Metrics().registry.collect():
        suffixes = {
            "counter": ["_total"],
            "histogram": ["_bucket", "_count", "_sum"],
            "summary": ["_count", "_sum", ""],
        }.get(family.type, [""])
        names.update(family.name + suffix for suffix in suffixes)
    return names


def test_every_metric_used_is_exported() -> None:
    exported = _exported_names() | PROMETHEUS_SERIES
    queries = dashboard_queries() + rule_queries()
    assert len(queries) > 30
    for query in queries:
        unknown = metric_names(query.expr) - exported
        assert not unknown, f"{query.where}: {sorted(unknown)} not exported by the sidecar"


def test_selector_extraction_finds_every_vector_selector() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le) (rate(a_bucket{x="1"}[5m] offset 1m)))'
        " / on () group_left max_over_time(b[5m:1m]) > 2 and c unless absent(d{y=~'.+'})"
    )
    assert selectors(expr) == ['a_bucket{x="1"}', "b{}", "c{}", 'd{y=~".+"}']
