"""docs/configuration.md's settings table is what ``describe_fields()`` generates, and the
descriptions ``--help`` prints say what the settings accept."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest

from devkit.configuration_doc import BEGIN, END, DocumentError, main, read_details, rewrite
from sidecar.config import Settings, describe_fields

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "configuration.md"

ROWS = [
    ("SIDECAR_A", "1", "The first."),
    ("SIDECAR_B", "", "The second, with a | in it."),
]
PAGE = f"# Title\n\nProse before.\n\n{BEGIN}\n(anything)\n{END}\n\nProse after.\n"


def _table(document: str) -> list[str]:
    return document[document.index(BEGIN) : document.index(END)].splitlines()[1:]


def test_the_page_is_what_the_code_generates() -> None:
    """Names, order, defaults and descriptions: any difference fails here (run
    ``python -m devkit.configuration_doc`` to regenerate the table)."""
    document = DOC.read_text()
    assert rewrite(document, describe_fields()) == document
    generated = [line.split(" | ")[0] for line in _table(document)[2:]]
    assert generated == [f"| `{name}`" for name, _, _ in describe_fields()]


def test_every_row_holds_the_code_s_default_and_description() -> None:
    rows = {line.split(" | ")[0][3:-1]: line for line in _table(DOC.read_text())[2:]}
    for name, default, description in describe_fields():
        shown = f"`{default}`" if default else "(empty)"
        assert rows[name].startswith(f"| `{name}` | {shown} | {description} | "), name


def test_generating_writes_the_rows_in_order_and_keeps_the_prose() -> None:
    document = rewrite(PAGE, ROWS)
    assert document.startswith(f"# Title\n\nProse before.\n\n{BEGIN}\n| Variable |")
    assert document.endswith(f"{END}\n\nProse after.\n")
    assert _table(document)[2:] == [
        "| `SIDECAR_A` | `1` | The first. |  |",
        "| `SIDECAR_B` | (empty) | The second, with a \\| in it. |  |",
    ]
    assert rewrite(document, ROWS) == document


def test_a_changed_setting_is_rewritten_and_its_detail_kept() -> None:
    detailed = rewrite(PAGE, ROWS).replace("| The first. |  |", "| The first. | More, by hand. |")
    changed = [("SIDECAR_B", "x", "Now described."), ("SIDECAR_A", "2", "The first, renamed.")]
    table = _table(rewrite(detailed, changed))[2:]
    assert table == [
        "| `SIDECAR_B` | `x` | Now described. |  |",
        "| `SIDECAR_A` | `2` | The first, renamed. | More, by hand. |",
    ]
    # A setting gone from the code leaves the page.
    assert _table(rewrite(detailed, changed[:1]))[2:] == [
        "| `SIDECAR_B` | `x` | Now described. |  |"
    ]


def test_a_row_written_by_hand_in_the_older_form_is_adopted() -> None:
    """Another branch may add a setting with a three-column row: re-running the generator after
    the merge keeps its text as the detail (or drops it when it only repeats the description)."""
    table = (
        "| `SIDECAR_A` | `1` | The first, at length. |\n"
        "| `SIDECAR_B` | (empty) | The second, with a \\| in it. |\n"
        "| `SIDECAR_UNKNOWN` | `0` | Not in the code. |\n"
    )
    assert read_details(table, ROWS) == {
        "SIDECAR_A": "The first, at length.",
        "SIDECAR_B": "",
        "SIDECAR_UNKNOWN": "Not in the code.",
    }
    merged = rewrite(f"{BEGIN}\n{table}{END}\n", ROWS)
    assert "| `SIDECAR_A` | `1` | The first. | The first, at length. |" in merged
    assert "SIDECAR_UNKNOWN" not in merged


def test_a_page_without_its_markers_is_refused() -> None:
    with pytest.raises(DocumentError):
        rewrite("# Title\n\nno table\n", ROWS)
    with pytest.raises(DocumentError):
        rewrite(f"{END}\n{BEGIN}\n", ROWS)


def test_the_command_checks_and_regenerates(tmp_path: Path, capsys) -> None:
    page = tmp_path / "configuration.md"
    current = DOC.read_text()
    stale = current.replace("| `SIDECAR_PORT` |", "| `SIDECAR_PORT_OLD` |", 1)
    page.write_text(stale)
    assert main(["--doc", str(page), "--check"]) == 1
    assert "out of date" in capsys.readouterr().err
    assert page.read_text() == stale
    assert main(["--doc", str(page)]) == 0
    assert page.read_text() == current
    assert main(["--doc", str(page), "--check"]) == 0
    page.write_text("no markers\n")
    assert main(["--doc", str(page)]) == 2


def test_a_setting_with_a_fixed_set_of_values_names_them_all() -> None:
    """``--help`` shows the description: a reader learns there what a setting accepts."""
    for name, field in Settings.model_fields.items():
        annotation = field.annotation
        if typing.get_origin(annotation) is not typing.Literal:
            continue
        description = field.description or ""
        missing = [value for value in typing.get_args(annotation) if value not in description]
        assert not missing, f"SIDECAR_{name.upper()}'s description does not name {missing}"


def test_the_prefill_pool_is_not_described_as_round_robin() -> None:
    """The pool is scheduled by SIDECAR_SCHEDULER_POLICY (qoe by default), whatever its kind."""
    description = Settings.model_fields["prefill_endpoints"].description or ""
    assert "round-robin" not in description
    assert "SIDECAR_SCHEDULER_POLICY" in description


MISSPELT_ON_PURPOSE = {
    "SIDECAR_PREFILL_URLS": "configuration.md: the nearest-name warning's example",
    "SIDECAR_SERVICE_HOST": "configuration.md: a variable Kubernetes sets for a Service",
    "SIDECAR_PORT_8000_TCP": "configuration.md: a variable Kubernetes sets for a Service",
    "SIDECAR_PREFIL_DNS": "deploy.md: the inject command's nearest-name refusal",
    "SIDECAR_DECODE_ULR": "configuration.md: a misspelling one edit away",
}


def test_every_variable_the_docs_and_manifests_name_is_a_setting() -> None:
    """A page or manifest naming a variable the code does not read (renamed, removed, misspelt)
    sends a reader to a setting that does nothing; only the examples of a misspelling may."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    manifests = sorted((ROOT / "manifests").rglob("*.yaml"))
    known = {name for name, _, _ in describe_fields()}
    unknown = {
        f"{path.relative_to(ROOT)}: {name}"
        for path in [*pages, *manifests, ROOT / "sidecar" / "inject" / "sidecar.yaml"]
        for name in re.findall(r"\bSIDECAR_[A-Z0-9_]+", path.read_text())
        if name not in known and name not in MISSPELT_ON_PURPOSE
    }
    assert not unknown, sorted(unknown)
    assert len(pages) > 10  # the glob found the pages
