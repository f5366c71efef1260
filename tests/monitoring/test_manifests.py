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
from typing import Any

import jsonschema
import pytest
import yaml

from sidecar.metrics import Metrics
from tests.monitoring.assets import (
    DASHBOARD,
    JOB,
    MONITORING,
    OPERATIONS,
    PODMONITOR,
    PROMETHEUS_RULE,
    RULE_TESTS,
    SCHEMAS,
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

# The operator needs (requirement of the issue), by panel title.
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


def _strict(schema: Any) -> Any:
    """``schema`` refusing unknown fields wherever the CRD lists an object's fields and does not
    preserve unknown ones (the API server would prune them; ``kubectl --validate=strict`` and
    this test refuse them)."""
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    strict = {key: _strict(value) for key, value in schema.items()}
    if (
        "properties" in schema
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        strict["additionalProperties"] = False
    return strict


def _crd_validator(kind: str) -> jsonschema.protocols.Validator:
    for path in SCHEMAS.glob("*.yaml"):
        crd = load_yaml(path)
        if crd["spec"]["names"]["kind"] == kind:
            version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
            schema = _strict(version["schema"]["openAPIV3Schema"])
            # Not check_schema(): the CRDs' patterns are Go's RE2 (``^(?i)...``), which the
            # metaschema's regex format refuses; patterns of fields we use compile in Python.
            return jsonschema.Draft7Validator(schema)
    raise AssertionError(f"no vendored CRD for {kind} in {SCHEMAS}")


@pytest.mark.parametrize("path", [PODMONITOR, PROMETHEUS_RULE], ids=lambda p: p.name)
def test_resource_matches_the_operators_crd(path: Path) -> None:
    resource = load_yaml(path)
    assert resource["apiVersion"] == "monitoring.coreos.com/v1"
    assert resource["metadata"]["name"]
    errors = sorted(
        _crd_validator(resource["kind"]).iter_errors(resource), key=lambda e: list(e.path)
    )
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)


def test_strict_validation_catches_a_typo() -> None:
    """The validation above would notice a misspelt field (the API server would drop it)."""
    resource = load_yaml(PODMONITOR)
    resource["spec"]["podMetricsEndpoints"][0]["intervall"] = "15s"
    errors = list(_crd_validator("PodMonitor").iter_errors(resource))
    assert [e.validator for e in errors] == ["additionalProperties"]


def test_podmonitor_scrapes_the_sidecar_port_as_one_job() -> None:
    spec = load_yaml(PODMONITOR)["spec"]
    (endpoint,) = spec["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("http", "/metrics")
    assert {"action": "replace", "targetLabel": "job", "replacement": JOB} in endpoint[
        "relabelings"
    ]
    assert spec["selector"]["matchLabels"]


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
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (its built-in kustomize builds the manifests)")
    built = subprocess.run(
        [kubectl, "kustomize", str(MONITORING)], capture_output=True, text=True, check=False
    )
    assert built.returncode == 0, built.stderr
    objects = {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(built.stdout)}
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
    have no sample before their first use)."""
    names: set[str] = set()
    for family in Metrics().registry.collect():
        suffixes = {
            "counter": ["_total", "_created"],
            "histogram": ["_bucket", "_count", "_sum", "_created"],
            "summary": ["_count", "_sum", "_created", ""],
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
