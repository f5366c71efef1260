"""The monitoring manifests as the tests see them: the PrometheusRule's rule groups, the Grafana
dashboard's PromQL expressions (its variables substituted as Grafana would), the metric
selectors inside any expression (from PromQL's syntax tree), and the Prometheus binaries."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import promql_parser
import yaml

from tests.tools import program

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "manifests" / "monitoring"
PODMONITOR = MONITORING / "podmonitor.yaml"
PROMETHEUS_RULE = MONITORING / "prometheusrule.yaml"
DASHBOARD = MONITORING / "dashboards" / "pd-sidecar.json"
RULE_TESTS = Path(__file__).with_name("alerts.test.yaml")
OPERATIONS = ROOT / "docs" / "operations.md"

JOB = "pd-sidecar"
"""The job label the PodMonitor sets; the alerts select ``up{job="pd-sidecar"}``."""

# Grafana's built-in interval variables, replaced by what Grafana would put there for a 1 s
# scrape interval (``$__rate_interval`` is at least four scrape intervals).
GRAFANA_INTERVALS = {"__rate_interval": "1m", "__interval": "15s", "__range": "1h"}
ALL = ".*"
"""The ``allValue`` of the dashboard's multi-value variables: "All" matches everything."""


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def rules_spec() -> dict[str, Any]:
    """The PrometheusRule's ``spec``: a plain Prometheus rules file (``groups: [...]``)."""
    spec: dict[str, Any] = load_yaml(PROMETHEUS_RULE)["spec"]
    return spec


def write_rules_file(path: Path) -> Path:
    """Write the PrometheusRule's ``spec`` as a rules file promtool and Prometheus read."""
    path.write_text(yaml.safe_dump(rules_spec(), sort_keys=False))
    return path


def alert_rules() -> list[dict[str, Any]]:
    return [rule for group in rules_spec()["groups"] for rule in group["rules"] if "alert" in rule]


def rule_expressions() -> dict[str, str]:
    """Every rule's expression, by alert (or recorded series) name."""
    return {
        rule.get("alert") or rule["record"]: rule["expr"]
        for group in rules_spec()["groups"]
        for rule in group["rules"]
    }


def dashboard() -> dict[str, Any]:
    board: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return board


def panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, those inside collapsed rows included; rows themselves excluded."""
    found = []
    for panel in board["panels"]:
        if panel["type"] == "row":
            found.extend(panel.get("panels", []))
        else:
            found.append(panel)
    return found


def variables(board: dict[str, Any]) -> list[dict[str, Any]]:
    listed: list[dict[str, Any]] = board["templating"]["list"]
    return listed


def variable_query(variable: dict[str, Any]) -> str:
    """A query variable's query (``definition``, else ``query`` as a string or an object)."""
    query = variable.get("definition") or variable["query"]
    return query if isinstance(query, str) else str(query["query"])


_LABEL_VALUES = re.compile(r"^\s*label_values\((?P<inner>.*),\s*[A-Za-z_][A-Za-z0-9_]*\s*\)\s*$")
_VARIABLE = re.compile(
    r"\$(?:\{(?P<braced>[A-Za-z_]\w*)(?::[a-z]+)?\}|(?P<bare>[A-Za-z_]\w*))", re.ASCII
)


def substitute(expr: str, board: dict[str, Any]) -> str:
    """``expr`` with the dashboard's variables replaced: the built-in intervals by durations, the
    dashboard's own variables by their "All" value. An unknown variable is an error."""
    own = {v["name"] for v in variables(board)}

    def replace(match: re.Match[str]) -> str:
        name = match["braced"] or match["bare"]
        if name in GRAFANA_INTERVALS:
            return GRAFANA_INTERVALS[name]
        if name in own:
            return ALL
        raise AssertionError(f"unknown variable ${name} in {expr!r}")

    return _VARIABLE.sub(replace, expr)


@dataclass(frozen=True, slots=True)
class Query:
    """A PromQL expression of the dashboard or the rules, and where it comes from."""

    where: str
    expr: str


def dashboard_queries() -> list[Query]:
    """Every PromQL expression of the dashboard, variables substituted: each panel target, and
    the series selector of each ``label_values(...)`` variable query."""
    board = dashboard()
    queries = []
    for panel in panels(board):
        for target in panel.get("targets", []):
            where = f"panel {panel['title']!r} target {target['refId']}"
            queries.append(Query(where, substitute(target["expr"], board)))
    for variable in variables(board):
        if variable["type"] != "query":
            continue
        query = variable_query(variable)
        match = _LABEL_VALUES.match(query)
        assert match, f"variable {variable['name']}: not label_values(selector, label): {query}"
        queries.append(Query(f"variable ${variable['name']}", substitute(match["inner"], board)))
    return queries


def rule_queries() -> list[Query]:
    return [Query(f"rule {name}", expr) for name, expr in rule_expressions().items()]


def selectors(expr: str) -> list[str]:
    """Every vector selector of ``expr`` (those inside range selectors, subqueries and function
    calls included) as a selector to query on its own: metric name and label matchers, without
    any offset or ``@`` (what is asked is whether such series exist now)."""
    found: list[str] = []

    def visit(node: promql_parser.Expr) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            assert node.name, f"a selector without a metric name in {expr!r}: {node}"
            found.append(f"{node.name}{node.matchers}")

    promql_parser.walk(promql_parser.parse(expr), visit)
    return found


def metric_names(expr: str) -> set[str]:
    return {selector.split("{", 1)[0] for selector in selectors(expr)}


def binary(name: str) -> str:
    """The path of ``prometheus`` or ``promtool``. Missing: the test fails under CI (``.ci/run``
    installs the Debian package ``prometheus``), and is skipped on a developer's machine."""
    return program(name, "prometheus")
