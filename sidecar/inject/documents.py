"""Multi-document YAML in, the same documents out with the workloads injected.

A document that is not changed (a Service, a ConfigMap, a workload not selected, one injected
already) is written back byte for byte, comments included; a changed one is written anew from its
data (its comments are lost). So a second run changes nothing.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import yaml

from sidecar.inject.pod import InjectError, already_injected, inject_pod_spec
from sidecar.inject.template import Options, pod_labels

POD_SPEC_PATHS: dict[str, tuple[str, ...]] = {
    "Deployment": ("spec", "template", "spec"),
    "StatefulSet": ("spec", "template", "spec"),
    "DaemonSet": ("spec", "template", "spec"),
    "ReplicaSet": ("spec", "template", "spec"),
    "PodTemplate": ("template", "spec"),
    "Pod": ("spec",),
}
"""Where each supported kind keeps its pod spec."""
POD_METADATA_PATHS: dict[str, tuple[str, ...]] = {
    kind: (*path[:-1], "metadata") for kind, path in POD_SPEC_PATHS.items()
}
"""Where each supported kind keeps its pod's metadata (the labels the injection adds)."""
_MARKER = re.compile(r"^---(?:[ \t].*)?$", re.M)


@dataclass(slots=True)
class Report:
    """What a run did, for the messages on stderr."""

    injected: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)


class _Dumper(yaml.SafeDumper):
    """Block style, sequences indented under their key (as in manifests/), multi-line strings as
    literal blocks, no line folding."""

    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        super().increase_indent(flow, False)


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def dump(data: Any) -> str:
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=4096)


def split(text: str) -> list[str]:
    """The documents of a stream as written, each with its own ``---`` line; joined back they are
    the stream again."""
    starts = [m.start() for m in _MARKER.finditer(text)]
    if not starts or starts[0] != 0:
        starts.insert(0, 0)
    return [text[a:b] for a, b in zip(starts, [*starts[1:], len(text)], strict=True)]


def _describe(doc: dict[str, Any]) -> str:
    metadata = doc.get("metadata") or {}
    return f"{doc.get('kind')}/{metadata.get('name', '?')}"


def _pod_spec(doc: dict[str, Any]) -> dict[str, Any] | None:
    path = POD_SPEC_PATHS.get(str(doc.get("kind")))
    node: Any = doc
    for key in path or ():
        node = node.get(key) if isinstance(node, dict) else None
    return node if path and isinstance(node, dict) else None


def _inject_object(
    doc: dict[str, Any], options: Options, names: frozenset[str], report: Report
) -> bool:
    """Inject one object (or the items of a ``List``) in place; True when it changed."""
    if doc.get("kind") == "List" and isinstance(doc.get("items"), list):
        changed = [_inject_object(item, options, names, report) for item in doc["items"]]
        return any(changed)
    spec = _pod_spec(doc)
    name = str((doc.get("metadata") or {}).get("name", ""))
    if spec is None or (names and name not in names):
        return False
    if already_injected(spec):
        report.unchanged.append(_describe(doc))
        return False
    try:
        inject_pod_spec(spec, options)
    except InjectError as exc:
        raise InjectError(f"{_describe(doc)}: {exc}") from None
    _label_pod(doc)
    report.injected.append(_describe(doc))
    return True


def _label_pod(doc: dict[str, Any]) -> None:
    """The injected pod's labels (its template's, for a workload): a workload's selector is not
    changed, so the new label only marks the pods for the PodMonitor."""
    node = doc
    for key in POD_METADATA_PATHS[str(doc["kind"])]:
        child = node.get(key)
        if not isinstance(child, dict):
            child = node[key] = {}
        node = child
    labels = node.get("labels")
    if not isinstance(labels, dict):
        labels = node["labels"] = {}
    labels.update(pod_labels())


def _workloads(data: Any) -> Iterable[dict[str, Any]]:
    if isinstance(data, dict):
        if data.get("kind") == "List":
            for item in data.get("items") or []:
                yield from _workloads(item)
        elif _pod_spec(data) is not None:
            yield data


def inject_text(text: str, options: Options, names: Iterable[str] = ()) -> tuple[str, Report]:
    """Inject every workload of a YAML stream (only those named, when ``names`` is given).

    Raises ``InjectError`` when a selected workload cannot be injected, a name matches nothing, or
    there is no workload at all.
    """
    wanted = frozenset(names)
    report = Report()
    out: list[str] = []
    found: set[str] = set()
    kinds: list[str] = []
    for index, chunk in enumerate(split(text), start=1):
        try:
            data = yaml.safe_load(chunk)
        except yaml.YAMLError as exc:
            raise InjectError(f"document {index} is not valid YAML: {exc}") from None
        if isinstance(data, dict):
            kinds.append(str(data.get("kind")))
        for workload in _workloads(data):
            found.add(str((workload.get("metadata") or {}).get("name", "")))
        if isinstance(data, dict) and _inject_object(data, options, wanted, report):
            marker = _MARKER.match(chunk)
            out.append((marker.group(0) + "\n" if marker else "") + dump(data))
        else:
            out.append(chunk)
    missing = sorted(wanted - found)
    if missing:
        raise InjectError(f"no Deployment, StatefulSet or pod named {', '.join(missing)}")
    if not found:
        seen = ", ".join(sorted(set(kinds))) or "none"
        raise InjectError(
            "nothing to inject: no Deployment, StatefulSet, DaemonSet, ReplicaSet, PodTemplate or "
            f"Pod in the input (kinds: {seen})"
        )
    return "".join(out), report
