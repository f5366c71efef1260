"""The docs hold together for a reader who has only this repository: every relative link in
``docs/*.md`` and ``README.md`` names a file that exists (and, with a ``#fragment``, a heading of
that file as GitHub renders its anchors), and the commands they quote name no path outside the
repository (another checkout's ``../``, a machine's ``/work/...`` or home directory)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote

import pytest

from tests.processes import free_port

ROOT = Path(__file__).resolve().parent.parent
PAGES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]

FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.I)
INLINE_CODE = re.compile(r"(`+)(.+?)\1")

# A quoted command starts (after `$ `, environment assignments and `cd DIR &&`) with one of these.
PROGRAMS = (
    "python",
    "python3",
    ".venv/bin/",
    "make",
    "bash",
    "sh",
    "curl",
    "pytest",
    "pip",
    "git",
    "docker",
    "kubectl",
    "kind",
    "helm",
    "redis-cli",
    "redis-server",
    "valgrind",
    "taskset",
    "e2e/",
    "devkit/",
)
# Paths no reader has: above the repository, a machine's work tree, someone's home.
OUTSIDE = re.compile(r"(?<![\w./:-])(?:\.\./[^\s`'\"]*|/work/\S*|/home/\S*|/root/\S*|/Users/\S*)")


def _prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """The lines outside fenced code blocks, numbered from 1."""
    inside = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            inside = not inside
            continue
        if not inside:
            yield number, line


def _code_blocks(text: str) -> Iterator[tuple[int, str]]:
    """The lines inside fenced code blocks, numbered from 1."""
    inside = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            inside = not inside
            continue
        if inside:
            yield number, line


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its text without markup, lower-cased, every character
    but letters, digits, `_`, `-` and spaces dropped, spaces made hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.replace("`", "").replace("*", "")
    text = re.sub(r"(?<!\w)_+|_+(?!\w)", "", text)  # emphasis underscores, not snake_case
    text = text.strip().lower()
    text = "".join(c for c in text if c.isalnum() or c in "_- ")
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor of a Markdown page: its headings' (duplicates numbered as GitHub numbers
    them) and explicit `<a name>`/`id`s."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    text = page.read_text()
    for _, line in _prose_lines(text):
        found.update(HTML_ANCHOR.findall(line))
        match = HEADING.match(line)
        if not match:
            continue
        slug = github_slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def links(page: Path) -> Iterator[tuple[int, str]]:
    """The relative link targets of a page (not in code), with their line numbers."""
    for number, line in _prose_lines(page.read_text()):
        bare = INLINE_CODE.sub("", line)
        for target in LINK.findall(bare):
            yield number, target
        reference = REFERENCE.match(bare)
        if reference:
            yield number, reference.group(1)


def broken_links(page: Path) -> list[str]:
    return broken_links_in(page, ROOT)


def broken_links_in(page: Path, root: Path) -> list[str]:
    problems = []
    for number, target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:, ...
            continue
        path_part, _, fragment = target.partition("#")
        where = f"{page.relative_to(root)}:{number}: {target}"
        linked = (page.parent / unquote(path_part)).resolve() if path_part else page
        if not linked.exists():
            problems.append(f"{where} (no such file)")
            continue
        if root not in linked.parents and linked != root:
            problems.append(f"{where} (outside the repository)")
            continue
        if fragment and linked.suffix == ".md" and unquote(fragment) not in anchors(linked):
            problems.append(f"{where} (no heading with that anchor)")
    return problems


def _command(text: str) -> bool:
    """Whether a line or a span of code is a command someone would run."""
    words = text.strip().removeprefix("$ ").lstrip("(").split()
    while words and (re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]) or words[0] == "cd"):
        if words[0] == "cd":  # `cd DIR && ...`: the directory is checked, the command after it
            return len(words) > 3 and words[2] == "&&" and _command(" ".join(words[3:]))
        words = words[1:]
    return bool(words) and words[0].startswith(PROGRAMS)


def commands(page: Path) -> Iterator[tuple[int, str]]:
    """The commands a page quotes: in code blocks (a line that starts with a program, and the
    lines it continues onto with a trailing backslash) and in inline code."""
    text = page.read_text()
    continued = False
    for number, line in _code_blocks(text):
        if continued or _command(line):
            yield number, line
        continued = (continued or _command(line)) and line.rstrip().endswith("\\")
    for number, line in _prose_lines(text):
        for _, span in INLINE_CODE.findall(line):
            if _command(span):
                yield number, span


def outside_paths(page: Path) -> list[str]:
    return [
        f"{page.relative_to(ROOT)}:{number}: {path!r} in {command.strip()!r}"
        for number, command in commands(page)
        for path in OUTSIDE.findall(re.sub(r"\w+://\S+", "", command))
    ]


def test_the_slugs_are_github_s() -> None:
    assert github_slug("Large request bodies (`bench/bodies.py`)") == (
        "large-request-bodies-benchbodiespy"
    )
    assert github_slug("Standalone: the sidecar's own scheduler") == (
        "standalone-the-sidecars-own-scheduler"
    )
    assert github_slug("`GET /debug/requests`") == "get-debugrequests"
    assert github_slug("The `ttft_ratio` trade-off — 2 × 3") == "the-ttft_ratio-trade-off--2--3"


def test_commands_are_found_and_outside_paths_named(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "Run `python -m bench overhead --baseline ../base` or `ls ../x` (not a command).\n\n"
        "```\nmake bench\npython -m bench simulate \\\n  --trace /work/traces/t.jsonl\n"
        "curl http://127.0.0.1:8000/v1/models\n```\n"
    )
    found = [line for _, line in commands(page)]
    assert found == [
        "make bench",
        "python -m bench simulate \\",
        "  --trace /work/traces/t.jsonl",
        "curl http://127.0.0.1:8000/v1/models",
        "python -m bench overhead --baseline ../base",
    ]
    named = [
        path
        for _, command in commands(page)
        for path in OUTSIDE.findall(re.sub(r"\w+://\S+", "", command))
    ]
    assert named == ["/work/traces/t.jsonl", "../base"]


def test_a_missing_file_or_heading_is_a_broken_link(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Its title\n\n## A `code` part\n\n## A `code` part\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[fine](other.md#its-title) [second](other.md#a-code-part-1) [here](#top)\n\n"
        "# Top\n\n[gone](missing.md) [no heading](other.md#nothing) "
        "[web](https://example.com/x#y)\n\n```\n[in code](nowhere.md)\n```\n"
    )
    problems = [problem.split(": ", 1)[1] for problem in broken_links_in(page, tmp_path)]
    assert problems == [
        "missing.md (no such file)",
        "other.md#nothing (no heading with that anchor)",
    ]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_relative_link_resolves(page: Path) -> None:
    problems = broken_links(page)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_quoted_commands_name_no_path_outside_the_repository(page: Path) -> None:
    problems = outside_paths(page)
    assert not problems, "\n".join(problems)


# The examples a reader can run on one machine carry a marker on the line before their fence:
#   <!-- runnable ports=8100,8200 cwd=manifests/base -->
# ``ports``: the fixed ports the block uses, each swapped for a free one; ``cwd``: where it runs
# (the repository's root by default). The block runs with ``bash -e``, this Python's scripts
# first on PATH and no SIDECAR_* variable, and must exit 0 within a minute; whatever it left
# running is killed with it.
RUNNABLE = re.compile(r"^<!--\s*runnable((?:\s+\w+=\S+)*)\s*-->\s*$")


@dataclasses.dataclass(frozen=True)
class Example:
    page: str
    line: int
    script: str
    ports: tuple[int, ...]
    cwd: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


def runnable_examples(pages: list[Path]) -> list[Example]:
    found = []
    for page in pages:
        lines = page.read_text().splitlines()
        for number, line in enumerate(lines):
            marker = RUNNABLE.match(line)
            if marker is None:
                continue
            options = dict(item.split("=", 1) for item in marker.group(1).split())
            assert FENCE.match(lines[number + 1]), f"{page.name}:{number + 1}: no block follows"
            end = next(i for i in range(number + 2, len(lines)) if FENCE.match(lines[i]))
            ports = tuple(int(port) for port in options.get("ports", "").split(",") if port)
            script = "\n".join(lines[number + 2 : end]) + "\n"
            found.append(Example(page.name, number + 2, script, ports, options.get("cwd", ".")))
    return found


EXAMPLES = runnable_examples(PAGES)


def test_the_runnable_examples_are_found() -> None:
    """The marker is seen where it is: the emulator's round trips and the manifests' check."""
    assert {str(example).split(":")[0] for example in EXAMPLES} >= {"emulator.md", "deploy.md"}


@pytest.mark.system
@pytest.mark.timeout(90)
@pytest.mark.parametrize("example", EXAMPLES, ids=str)
def test_a_runnable_example_runs(example: Example, tmp_path: Path) -> None:
    script = example.script
    for port in example.ports:
        assert re.search(rf"\b{port}\b", script), f"{example}: port {port} not in the block"
        script = re.sub(rf"\b{port}\b", str(free_port()), script)
    scripts = Path(sys.executable).parent
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIDECAR_")}
    env["PATH"] = f"{scripts}:{env.get('PATH', '')}"
    # Its output to a file, not a pipe: what it left running must not hold the test open.
    output = tmp_path / "output"
    with output.open("w") as sink:
        process = subprocess.Popen(
            ["bash", "-e", "-c", script],
            cwd=ROOT / example.cwd,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its background jobs go with it, whatever happens
        )
        try:
            status = process.wait(timeout=60)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
    assert status == 0, f"{example} exited {status}:\n{output.read_text()[-3000:]}"
