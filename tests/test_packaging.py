"""What a new user finds before running anything: the licence, the image's one name, the
changelog's form, and documentation links that lead somewhere."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

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
