"""What a new user finds before running anything: the licence, the image's one name, the
changelog's form, and documentation links that lead somewhere."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from sidecar.fleet import connectors
from sidecar.inject import defaults

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

# The Apache License 2.0's nine sections, in order (https://www.apache.org/licenses/LICENSE-2.0).
APACHE_2_SECTIONS = (
    "Definitions",
    "Grant of Copyright License",
    "Grant of Patent License",
    "Redistribution",
    "Submission of Contributions",
    "Trademarks",
    "Disclaimer of Warranty",
    "Limitation of Liability",
    "Accepting Warranty or Additional Liability",
)


def test_the_license_is_the_full_apache_2_text_the_package_declares() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert PROJECT["license"] == "Apache-2.0"
    assert PROJECT["license-files"] == ["LICENSE"]
    header = " ".join(text.split()[:6])
    assert header == "Apache License Version 2.0, January 2004"
    positions = [
        text.find(f"{number}. {title}.") for number, title in enumerate(APACHE_2_SECTIONS, start=1)
    ]
    assert -1 not in positions, dict(zip(APACHE_2_SECTIONS, positions, strict=True))
    assert positions == sorted(positions)
    assert "END OF TERMS AND CONDITIONS" in text
    assert "APPENDIX: How to apply the Apache License to your work." in text
    # The image's label says the same.
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert 'org.opencontainers.image.licenses="Apache-2.0"' in dockerfile


# The sidecar's image as the repository names it: repository and tag (a registry of the user's
# own, registry.example*, is how the docs show pushing it elsewhere).
IMAGE_REFERENCE = re.compile(r"[A-Za-z0-9./-]*/pd-sidecar:[A-Za-z0-9._-]+|\bpd-sidecar:\d[\w.-]*")
IMAGE = f"ghcr.io/pd-sidecar/pd-sidecar:{PROJECT['version']}"


def _image_references() -> dict[str, set[str]]:
    where = [ROOT / "README.md", ROOT / "Dockerfile", ROOT / "sidecar" / "inject" / "sidecar.yaml"]
    where += sorted((ROOT / "docs").rglob("*.md")) + sorted((ROOT / "manifests").rglob("*.yaml"))
    found: dict[str, set[str]] = {}
    for path in where:
        for reference in IMAGE_REFERENCE.findall(path.read_text()):
            if not reference.startswith("registry.example"):
                found.setdefault(reference, set()).add(path.relative_to(ROOT).as_posix())
    return found


def test_one_image_name_across_the_docs_the_manifests_and_the_injector() -> None:
    found = _image_references()
    assert set(found) == {IMAGE}, found
    # Everything that runs the image names it: the component, the emulated engines, the command.
    assert {
        "manifests/components/pd-sidecar/sidecar.yaml",
        "manifests/overlays/emulated/emulators.yaml",
        "docs/image.md",
        "docs/deploy.md",
        "Dockerfile",
    } <= found[IMAGE]
    assert defaults().image == IMAGE
    # And the docs say it is not published, and how to push it elsewhere.
    image_doc = " ".join((ROOT / "docs" / "image.md").read_text().split())
    assert "This project publishes no image yet" in image_doc
    assert "docker push registry.example.com/team/pd-sidecar" in image_doc
    assert "--image registry.example.com/team/pd-sidecar" in image_doc


def test_the_image_check_sees_a_second_name() -> None:
    """The pattern catches the spellings the docs once used (a bare local tag)."""
    assert IMAGE_REFERENCE.findall("docker build -t pd-sidecar:0.1.0 .") == ["pd-sidecar:0.1.0"]
    assert IMAGE_REFERENCE.findall("image: ghcr.io/other/pd-sidecar:0.2") == [
        "ghcr.io/other/pd-sidecar:0.2"
    ]
    assert IMAGE_REFERENCE.findall("trace pd-sidecar:request, pd-sidecar.io/inject") == []


# --- documentation links ---------------------------------------------------------------------

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*$", re.M)


def _prose(text: str) -> str:
    """Markdown without its fenced code blocks (a ``#`` line there is no heading)."""
    return _FENCE.sub("", text)


def anchors(text: str) -> set[str]:
    """The fragment each heading gets on GitHub: lower-cased, punctuation but ``-`` and ``_``
    dropped, spaces as ``-``; a repeated one gets ``-1``, ``-2``, ..."""
    seen: dict[str, int] = {}
    found = set()
    for heading in _HEADING.findall(_prose(text)):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def broken_links(page: Path) -> list[str]:
    """Relative links of ``page`` whose file, or whose heading, does not exist."""
    broken = []
    for target in _LINK.findall(_prose(page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked here
        path, _, fragment = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif fragment and linked.suffix == ".md" and fragment not in anchors(linked.read_text()):
            broken.append(f"{target}: no such heading")
    return broken


DOCUMENTATION = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", DOCUMENTATION, ids=lambda page: page.name)
def test_documentation_links_resolve(page: Path) -> None:
    assert broken_links(page) == []


def test_the_link_check_sees_a_missing_file_and_a_missing_heading(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text(
        "# Other\n\n## A `code` heading (with: punctuation)\n## Other\n"
    )
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#a-code-heading-with-punctuation) [ok](other.md#other-1) [ok](#here)\n"
        "[gone](missing.md) [no heading](other.md#nowhere) [web](https://example.invalid/x)\n"
        "# Here\n```sh\n# not a heading\n[not a link](nowhere.md)\n```\n"
    )
    assert broken_links(page) == ["missing.md: no such file", "other.md#nowhere: no such heading"]


def test_the_readme_opens_with_what_ships_and_states_the_scope() -> None:
    readme = (ROOT / "README.md").read_text()
    opening = " ".join(readme.split("\n\n")[1].split())
    # Every connector the code ships is a present-tense claim, none a promise.
    assert {"nixl", "sglang"} <= set(connectors.CONNECTORS)
    assert "(vLLM or SGLang)" in opening
    assert "next" not in opening
    assert "today" not in opening
    # The scope: one decode pod per sidecar; routing across decode pods is the gateway's.
    for page in (readme, (ROOT / "docs" / "architecture.md").read_text()):
        text = " ".join(page.split())
        assert "serves its own decode pod" in text
        assert "is the gateway's" in text
    assert "(docs/troubleshooting.md)" in readme


# --- the changelog ---------------------------------------------------------------------------

CHANGE_KINDS = ("Added", "Changed", "Deprecated", "Removed", "Fixed", "Security")
_VERSION = re.compile(r"^## \[(Unreleased|\d+\.\d+\.\d+)\](?: - (\d{4}-\d{2}-\d{2}))?$")


def changelog_problems(text: str) -> list[str]:
    """What keeps ``text`` from Keep a Changelog's form: ``## [Unreleased]`` first, then
    ``## [x.y.z] - YYYY-MM-DD`` newest first, each change kind at most once per version and
    nothing else as a heading; no internal issue numbers."""
    problems = []
    versions: list[str] = []
    kinds: list[str] = []
    for line in _prose(text).splitlines():
        if line.startswith("## "):
            match = _VERSION.match(line)
            if match is None or (match[1] == "Unreleased") == bool(match[2]):
                problems.append(f"not a version heading: {line}")
                continue
            versions.append(match[1])
            kinds = []
        elif line.startswith("### "):
            kind = line[4:].strip()
            if kind not in CHANGE_KINDS:
                problems.append(f"not a kind of change: {line}")
            elif kind in kinds:
                problems.append(f"{kind} twice in {versions[-1] if versions else 'no version'}")
            kinds.append(kind)
        elif line.startswith("#") and not line.startswith("# "):
            problems.append(f"a heading of another level: {line}")
    if versions[:1] != ["Unreleased"]:
        problems.append("the first section is not [Unreleased]")
    released = [tuple(int(n) for n in v.split(".")) for v in versions if v != "Unreleased"]
    if released != sorted(set(released), reverse=True):
        problems.append(f"versions not newest first, or repeated: {versions}")
    problems += [f"internal reference: {m}" for m in re.findall(r"\bissues? \d+", text, re.I)]
    return problems


def test_the_changelog_keeps_a_changelog_s_form() -> None:
    text = (ROOT / "CHANGELOG.md").read_text()
    assert changelog_problems(text) == []
    assert re.search(
        rf"^## \[{re.escape(PROJECT['version'])}\] - \d{{4}}-\d{{2}}-\d{{2}}$", text, re.M
    )


def test_the_changelog_check_sees_what_breaks_the_form() -> None:
    good = (
        "# Changelog\n\n## [Unreleased]\n\n### Added\n- x\n\n## [0.1.0] - 2026-12-03\n\n### Added\n"
    )
    assert changelog_problems(good) == []
    assert changelog_problems(good + "### Added\n- again\n") == ["Added twice in 0.1.0"]
    assert changelog_problems(good.replace("- x", "- x (issue 23)")) == [
        "internal reference: issue 23"
    ]
    assert changelog_problems(good.replace("### Added\n- x", "### Fixed (by the benchmarks)")) == [
        "not a kind of change: ### Fixed (by the benchmarks)"
    ]
    assert changelog_problems("# Changelog\n\n## Unreleased\n") == [
        "not a version heading: ## Unreleased",
        "the first section is not [Unreleased]",
    ]
    assert changelog_problems(good + "## [0.2.0] - 2027-01-01\n") == [
        "versions not newest first, or repeated: ['Unreleased', '0.1.0', '0.2.0']"
    ]
