"""What a new user finds before running anything: the licence, the image's one name, the
changelog's form, and documentation links that lead somewhere."""

from __future__ import annotations

import tomllib
from pathlib import Path

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
