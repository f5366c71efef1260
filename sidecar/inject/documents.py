"""Multi-document YAML in, the same documents out with the workloads injected.

A document that is not changed (a Service, a ConfigMap, a workload not selected, one injected
already) is written back byte for byte, comments included; a changed one is written anew from its
data (its comments are lost). So a second run changes nothing.

Which workloads: those named by ``--name``; else, when any workload of the input carries llm-d's
role label (``llm-d.ai/role``, on its pods), only those whose role serves decode; else every one.
Each one left out is reported with the reason.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import yaml

from sidecar.inject.environment import check
from sidecar.inject.pod import InjectError, already_injected, inject_pod_spec
from sidecar.inject.template import Options, pod_labels, render

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


ROLE_LABEL = "llm-d.ai/role"
"""llm-d's pod role label: its inference scheduler's filters pick prefill and decode pods by it."""
DECODE_ROLES = ("decode", "both", "prefill-decode")
"""Roles of pods that serve decode requests: ``both`` (and its newer spelling ``prefill-decode``)
serve either leg, as llm-d's decode filter admits them."""
UNSUPPORTED = {
    "LeaderWorkerSet": "its leader and worker pod templates are not injected: add the sidecar "
    "to the leader's template by hand (docs/deploy.md)",
}
"""Workload kinds the command knows it does not inject, and what to do instead."""


@dataclass(slots=True)
class Report:
    """What a run did, for the messages on stderr."""

    injected: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    """``Kind/name: skipped: why``, one per workload left out."""
    notes: list[str] = field(default_factory=list)
    """What was done that the reader may not expect (an engine hook kept, ...)."""


@dataclass(frozen=True, slots=True)
class _Selection:
    """Which workloads to inject: those named, else by llm-d's role label when any carries one."""

    names: frozenset[str]
    by_role: bool

    def skip_reason(self, doc: dict[str, Any]) -> str | None:
        name = str((doc.get("metadata") or {}).get("name", ""))
        role = role_of(doc)
        if self.names:
            return None if name in self.names else "not named by --name"
        if not self.by_role or role in DECODE_ROLES:
            return None
        if role is None:
            return (
                f"no {ROLE_LABEL} label, while other workloads of the input have one "
                f"(--name {name} injects it)"
            )
        return (
            f"its pods are labelled {ROLE_LABEL}={role}; only {', '.join(DECODE_ROLES)} pods "
            f"get the sidecar (--name {name} injects it)"
        )


def role_of(doc: dict[str, Any]) -> str | None:
    """The workload's llm-d role: its pods' label, else its own."""
    pod = POD_METADATA_PATHS.get(str(doc.get("kind")))
    for path in (pod, ("metadata",)) if pod else (("metadata",),):
        node: Any = doc
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        labels = node.get("labels") if isinstance(node, dict) else None
        if isinstance(labels, dict) and ROLE_LABEL in labels:
            return str(labels[ROLE_LABEL])
    return None


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


def describe(doc: dict[str, Any]) -> str:
    metadata = doc.get("metadata") or {}
    return f"{doc.get('kind')}/{metadata.get('name', '?')}"


def pod_spec(doc: dict[str, Any]) -> dict[str, Any] | None:
    path = POD_SPEC_PATHS.get(str(doc.get("kind")))
    node: Any = doc
    for key in path or ():
        node = node.get(key) if isinstance(node, dict) else None
    return node if path and isinstance(node, dict) else None


def _inject_object(
    doc: dict[str, Any], options: Options, selection: _Selection, report: Report
) -> bool:
    """Inject one object (or the items of a ``List``) in place; True when it changed."""
    if doc.get("kind") == "List" and isinstance(doc.get("items"), list):
        changed = [_inject_object(item, options, selection, report) for item in doc["items"]]
        return any(changed)
    kind = str(doc.get("kind"))
    if kind in UNSUPPORTED:
        report.skipped.append(f"{describe(doc)}: skipped: {UNSUPPORTED[kind]}")
        return False
    spec = pod_spec(doc)
    if spec is None:
        return False
    reason = selection.skip_reason(doc)
    if reason is not None:
        report.skipped.append(f"{describe(doc)}: skipped: {reason}")
        return False
    if already_injected(spec):
        report.unchanged.append(describe(doc))
        return False
    try:
        notes = inject_pod_spec(spec, options)
    except InjectError as exc:
        raise InjectError(f"{describe(doc)}: {exc}") from None
    role = role_of(doc)
    if role is not None and role not in DECODE_ROLES:
        notes.append(f"injected although labelled {ROLE_LABEL}={role}: --name names it")
    report.notes.extend(f"{describe(doc)}: {note}" for note in notes)
    _label_pod(doc)
    report.injected.append(describe(doc))
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


def workloads(data: Any) -> Iterable[dict[str, Any]]:
    if isinstance(data, dict):
        if data.get("kind") == "List":
            for item in data.get("items") or []:
                yield from workloads(item)
        elif pod_spec(data) is not None:
            yield data


def inject_text(text: str, options: Options, names: Iterable[str] = ()) -> tuple[str, Report]:
    """Inject the decode workloads of a YAML stream: those named, when ``names`` is given; else,
    when a workload carries llm-d's role label, those whose role serves decode; else every one.

    Raises ``InjectError`` when a selected workload cannot be injected, a name matches nothing,
    there is no workload at all, or every one was skipped; ``EnvError`` when ``options.env`` is
    what the sidecar would refuse.
    """
    if options.env:
        check(render(options).container["env"])
    wanted = frozenset(names)
    chunks = split(text)
    parsed: list[Any] = []
    for index, chunk in enumerate(chunks, start=1):
        try:
            parsed.append(yaml.safe_load(chunk))
        except yaml.YAMLError as exc:
            raise InjectError(f"document {index} is not valid YAML: {exc}") from None
    objects = [w for data in parsed for w in workloads(data)]
    found = {str((w.get("metadata") or {}).get("name", "")) for w in objects}
    missing = sorted(wanted - found)
    if missing:
        raise InjectError(f"no Deployment, StatefulSet or pod named {', '.join(missing)}")
    kinds = [str(data.get("kind")) for data in parsed if isinstance(data, dict)]
    if not objects and not any(kind in UNSUPPORTED for kind in kinds):
        seen = ", ".join(sorted(set(kinds))) or "none"
        raise InjectError(
            "nothing to inject: no Deployment, StatefulSet, DaemonSet, ReplicaSet, PodTemplate or "
            f"Pod in the input (kinds: {seen})"
        )
    selection = _Selection(wanted, any(role_of(w) is not None for w in objects))
    report = Report()
    out: list[str] = []
    for chunk, data in zip(chunks, parsed, strict=True):
        if isinstance(data, dict) and _inject_object(data, options, selection, report):
            marker = _MARKER.match(chunk)
            out.append((marker.group(0) + "\n" if marker else "") + dump(data))
        else:
            out.append(chunk)
    if not report.injected and not report.unchanged:
        raise InjectError("nothing to inject: " + "; ".join(report.skipped))
    if len(report.injected) > 1 and not wanted and not selection.by_role:
        report.notes.append(
            f"injected {len(report.injected)} workloads ({', '.join(report.injected)}), none "
            f"labelled {ROLE_LABEL}: if one of them is a prefill workload, name the decode ones "
            "with --name"
        )
    return "".join(out), report
