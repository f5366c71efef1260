"""The container image without a container daemon: the Dockerfile's shape, then its RUN steps as
written — the wheels built from a context holding only what it copies, installed into a fresh venv
outside the source tree — and the sidecar and the emulator started from that installation as the
image's non-root user, with one P/D request through them. This is what catches a module missing
from the wheel, a file missing from the context or a dependency missing from ``/wheels``.

What differs from a ``docker build``: the base image's ``python`` is an interpreter of this
machine (this one, or where the image's user cannot reach this one, the system's of the base
image's Python minor); this pip does the work, run by that interpreter (``--python``),
and keeps its cache (the image's build stage mounts one too); the final stage's system
interpreter is a venv made from that interpreter; the image's user is taken with ``setpriv``
rather than made with ``useradd``. The build reads PyPI's index for every dependency, as the
image's build does.
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest

import sidecar
from devkit.processes import Launcher, free_port
from sidecar.config import Settings
from tests.processes import START_TIMEOUT_S
from tests.tools import missing

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
EMULATOR_COMMAND = ("python", "-m", "sidecar.emulator")
"""The command the manifests give the image to run the emulator (docs/image.md)."""
WHEELS = "/wheels"
STEP_TIMEOUT_S = 150.0
BUILD_TIMEOUT_S = 240
"""For the first test of the module, which builds and installs: about 30 s on a busy 2-core
machine, most of it pip reading PyPI's index for each dependency; a slow link takes longer."""


# --- the Dockerfile, read ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Instruction:
    keyword: str
    arguments: str


@dataclass(frozen=True, slots=True)
class Stage:
    base: str
    name: str | None
    instructions: tuple[Instruction, ...]

    def all(self, keyword: str) -> list[str]:
        return [i.arguments for i in self.instructions if i.keyword == keyword]

    def one(self, keyword: str) -> str:
        [arguments] = self.all(keyword)
        return arguments

    def pairs(self, keyword: str) -> dict[str, str]:
        """``KEY=value`` pairs of every ``ENV``, ``LABEL`` or ``ARG`` (an ARG without a default
        maps to "")."""
        return {k: v for arguments in self.all(keyword) for k, v in pairs(arguments).items()}


def pairs(arguments: str) -> dict[str, str]:
    return {key: value for key, _, value in (w.partition("=") for w in shlex.split(arguments))}


def instructions(text: str) -> list[Instruction]:
    """Docker's reading: comment lines dropped (inside continuations too), a trailing backslash
    continues the instruction on the next line."""
    found: list[Instruction] = []
    pending = ""
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        whole = (pending + line).strip()
        pending = ""
        if whole:
            keyword, _, arguments = whole.partition(" ")
            found.append(Instruction(keyword.upper(), " ".join(arguments.split())))
    assert not pending, "the Dockerfile ends inside a continuation"
    return found


def stages(text: str = "") -> list[Stage]:
    parsed: list[Stage] = []
    for instruction in instructions(text or DOCKERFILE.read_text()):
        if instruction.keyword == "FROM":
            base, _, name = instruction.arguments.partition(" AS ")
            parsed.append(Stage(base, name or None, ()))
        else:
            assert parsed, f"{instruction} before any FROM"
            last = parsed[-1]
            parsed[-1] = Stage(last.base, last.name, (*last.instructions, instruction))
    return parsed


def shell_command(run: str) -> str:
    """A RUN's shell command, without its ``--mount`` (and other) flags."""
    return re.sub(r"^(--\S+\s+)*", "", run)


def commands(run: str) -> list[str]:
    return [part.strip() for part in shell_command(run).split("&&")]


def user_ids(final: Stage) -> tuple[int, int]:
    uid, _, gid = final.one("USER").partition(":")
    return int(uid), int(gid)


def is_user_creation(run: str) -> bool:
    return shell_command(run).startswith("groupadd ")


# --- the recipe, outside a container ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Installation:
    """The image's final stage as a venv: what it runs, as whom, with which environment."""

    wheels: Path
    venv: Path
    env: Mapping[str, str]
    """The environment of a process in the image (the final stage's ENV, its PATH)."""
    user: tuple[int, int] | None
    """uid and gid to run as (None: as this process's user, see ``unreachable``)."""
    unreachable: str | None
    """Why this process, root, cannot run the installation as the image's user (None: it can, or
    it is not root and runs it as itself)."""

    def argv(self, *command: str) -> list[str]:
        """``command`` as the image runs it: its program found on the image's PATH, as the
        image's user."""
        program = shutil.which(command[0], path=self.env["PATH"])
        assert program, f"{command[0]} is not on the image's PATH {self.env['PATH']}"
        assert Path(program).is_relative_to(self.venv), program
        argv = [program, *command[1:]]
        if self.user is None:
            return argv
        uid, gid = self.user
        return [
            "setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups",
            "--pdeathsig=SIGKILL",  # the launcher's own is cleared with the change of user
            *argv,
        ]  # fmt: skip

    def wheel(self) -> Path:
        [wheel] = self.wheels.glob("pd_sidecar-*.whl")
        return wheel


def reachable(path: Path) -> bool:
    """Whether a user who owns nothing here can reach ``path``: it and every directory above it
    are open to others."""
    return all(p.stat().st_mode & stat.S_IXOTH for p in (path, *path.parents))


def base_interpreter(base: str) -> tuple[Path, str | None]:
    """The interpreter standing for the base image's ``python``, and why the image's user could
    not run it (None: it can). This one's, unless it lives where that user cannot reach (pyenv
    under /root, say): then the system's interpreter of the base image's Python minor."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    ours = Path(sys.base_prefix, "bin", f"python{version}").resolve()
    if os.geteuid() != 0 or (reachable(ours) and reachable(Path(sys.base_prefix))):
        return ours, None
    minor = re.search(r"python:(\d+\.\d+)", base)
    assert minor, base
    for folder in ("/usr/local/bin", "/usr/bin"):
        candidate = Path(folder, f"python{minor.group(1)}")
        if candidate.exists() and reachable(candidate.resolve()):
            return candidate, None
    return ours, (
        f"the image's user cannot run {ours} (a directory above it is private) and there is no"
        f" python{minor.group(1)} in /usr/local/bin or /usr/bin"
    )


def run_steps(
    stage: Stage, run: str, python: Path, *, wheels: Path, cwd: Path, env: Mapping[str, str]
) -> None:
    """One RUN of ``stage``: each of its ``python -m pip`` commands with this pip run by
    ``python`` (``--python``), ``wheels`` for /wheels, ``cwd`` for the WORKDIR."""
    pip = f"{shlex.quote(sys.executable)} -m pip --python {shlex.quote(str(python))}"
    steps = commands(run)
    for step in steps:
        assert step.startswith("python -m pip "), f"{stage.base}: no stand-in for {step!r}"
    command = " && ".join(pip + step.removeprefix("python -m pip") for step in steps)
    done = subprocess.run(
        ["sh", "-c", command.replace(WHEELS, str(wheels))],
        cwd=cwd,
        env=dict(env),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=STEP_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def clean_environment() -> dict[str, str]:
    """Ours without anything that would point a child at the source tree or set the sidecar."""
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SIDECAR_", "PYTHON", "VIRTUAL_ENV"))
    }


def copy_context(build: Stage, context: Path) -> None:
    """The build context as .dockerignore admits it, holding only what the build stage copies,
    where it copies it (``context`` stands for the stage's WORKDIR)."""
    ignored = [p[3:] for p in DOCKERIGNORE.read_text().split() if p.startswith("**/")]
    for copy in build.all("COPY"):
        *sources, destination = shlex.split(copy)
        for source in sources:
            origin = ROOT / source
            target = context / destination
            if origin.is_dir():
                shutil.copytree(origin, target, ignore=shutil.ignore_patterns(*ignored))
            else:
                target.mkdir(parents=True, exist_ok=True)
                shutil.copy2(origin, target / origin.name)


def install(root: Path) -> Installation:
    """The Dockerfile's steps, in order, under ``root``."""
    build, final = stages()
    python, unreachable = base_interpreter(final.base)
    context, wheels, venv = root / "context", root / "wheels", root / "venv"
    copy_context(build, context)
    # The build stage, with this machine's pip configuration: it is how pip reaches PyPI here.
    env = clean_environment() | build.pairs("ENV")
    for run in build.all("RUN"):
        run_steps(build, run, python, wheels=wheels, cwd=context, env=env)

    # The final stage: a venv without pip is its system interpreter, this pip installs into it,
    # with none of this machine's configuration (which may name more wheels than /wheels holds).
    subprocess.run([str(python), "-m", "venv", "--without-pip", str(venv)], check=True)
    image_env = {"PATH": f"{venv / 'bin'}:/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
    install_env = {
        **{k: v for k, v in clean_environment().items() if not k.startswith("PIP_")},
        "PIP_CONFIG_FILE": os.devnull,
        **final.pairs("ARG"),
    }
    for instruction in final.instructions:
        if instruction.keyword == "ENV":
            image_env.update(pairs(instruction.arguments))
        if instruction.keyword == "RUN" and not is_user_creation(instruction.arguments):
            run_steps(
                final, instruction.arguments, venv / "bin" / "python", wheels=wheels,
                cwd=Path("/"), env=install_env | image_env,
            )  # fmt: skip
    image_env["HOME"] = re.findall(r"--home-dir (\S+)", " ".join(final.all("RUN")))[0]
    user = user_ids(final) if os.geteuid() == 0 and not unreachable else None
    return Installation(wheels, venv, image_env, user, unreachable)


@pytest.fixture(scope="module")
def installed() -> Iterator[Installation]:
    # Not pytest's tmp_path: its parent is private to root, and the image's user must read it.
    root = Path(tempfile.mkdtemp(prefix="pd-sidecar-image-"))
    try:
        root.chmod(0o755)
        yield install(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def output(argv: Sequence[str], env: Mapping[str, str]) -> str:
    process = await asyncio.create_subprocess_exec(
        *argv,
        cwd="/",
        env=dict(env),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(process.communicate(), START_TIMEOUT_S)
    assert process.returncode == 0, out.decode()
    return out.decode()


# --- the tests ---------------------------------------------------------------------------------


def test_the_dockerfile_is_the_documented_recipe() -> None:
    build, final = stages()
    assert build.name
    assert final.name is None
    assert build.base == final.base, "both stages need the same Python for the same wheels"
    assert re.fullmatch(r"python:3\.\d+-slim-\w+", final.base), final.base
    # The final stage copies nothing and installs no build tool; it removes the base's.
    assert not final.all("COPY")
    runs = " ".join(final.all("RUN"))
    assert not re.search(r"apt-get|apk |gcc|g\+\+|build-essential|\bmake\b", runs), runs
    assert "pip uninstall" in runs
    assert "setuptools wheel" in runs
    assert "--no-index --find-links /wheels" in runs
    uid, gid = user_ids(final)
    assert uid > 0
    assert gid > 0
    [creation] = [run for run in final.all("RUN") if is_user_creation(run)]
    assert f"--gid {gid}" in creation
    assert f"--uid {uid}" in creation
    assert orjson.loads(final.one("ENTRYPOINT")) == ["python", "-m", "sidecar"]
    assert not final.all("CMD")
    assert final.one("EXPOSE") == str(Settings.model_fields["port"].default)
    env = final.pairs("ENV")
    assert env["PYTHONDONTWRITEBYTECODE"] == env["PYTHONUNBUFFERED"] == "1"
    version = final.pairs("ARG")["VERSION"]
    assert version == PROJECT["version"] == sidecar.__version__
    labels = final.pairs("LABEL")
    assert labels["org.opencontainers.image.title"] == PROJECT["name"]
    assert labels["org.opencontainers.image.version"] == "${VERSION}"
    assert labels["org.opencontainers.image.licenses"] == PROJECT["license"]
    assert labels["org.opencontainers.image.base.name"].endswith(f"/{final.base}")
    # .dockerignore admits exactly what the build stage copies.
    patterns = [line for line in DOCKERIGNORE.read_text().splitlines() if line and line[0] != "#"]
    assert patterns[0] == "*"
    sources = [s for copy in build.all("COPY") for s in shlex.split(copy)[:-1]]
    assert sorted(p[1:] for p in patterns if p.startswith("!")) == sorted(sources)
    # The manifests run the emulator from the same image by overriding the command.
    quoted = ", ".join(f'"{word}"' for word in EMULATOR_COMMAND)
    assert f"command: [{quoted}]" in (ROOT / "docs" / "image.md").read_text()


def test_the_reader_joins_continuations_and_skips_comments() -> None:
    [stage] = stages(
        "# syntax=docker/dockerfile:1\nFROM base:1 AS b\nRUN --mount=type=cache,target=/c \\\n"
        '    # a comment inside\n    a && \\\n    b\nENV A=1 \\\n    B="two words"\n'
    )
    assert (stage.base, stage.name) == ("base:1", "b")
    assert commands(stage.one("RUN")) == ["a", "b"]
    assert stage.pairs("ENV") == {"A": "1", "B": "two words"}


@pytest.mark.system
@pytest.mark.timeout(BUILD_TIMEOUT_S)
def test_the_wheel_holds_every_module_and_both_scripts(installed: Installation) -> None:
    with zipfile.ZipFile(installed.wheel()) as wheel:
        names = set(wheel.namelist())
        [entry_points] = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        scripts = wheel.read(entry_points).decode()
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "sidecar").rglob("*.py")}
    assert modules - names == set()
    assert {name.split("/")[0] for name in names} == {
        "sidecar",
        f"pd_sidecar-{PROJECT['version']}.dist-info",
    }
    for script, target in PROJECT["scripts"].items():
        assert f"{script} = {target}" in scripts
    # The licence travels with the package (the build context admits LICENSE for it).
    license_file = f"pd_sidecar-{PROJECT['version']}.dist-info/licenses/LICENSE"
    assert license_file in names
    # Compiled at install, so a read-only root filesystem costs no start-up time.
    assert list(installed.venv.glob("lib/python3*/site-packages/sidecar/__pycache__/*.pyc"))


@pytest.mark.system
@pytest.mark.timeout(BUILD_TIMEOUT_S)
async def test_the_installation_runs_the_sidecar_and_the_emulator(installed, http) -> None:
    seen = orjson.loads(
        await output(
            installed.argv(
                "python",
                "-c",
                "import json, os, sys, sidecar;"
                # The tracing extra is installed: SIDECAR_TRACING=true works in the image; the
                # kvevents extra too: SIDECAR_KV_EVENTS=true does.
                "import opentelemetry.sdk.trace, opentelemetry.exporter.otlp.proto.http;"
                "import zmq, msgpack;"
                "print(json.dumps([sidecar.__file__, sys.path, os.getuid()]))",
            ),
            installed.env,
        )
    )
    where, path, uid = seen
    assert Path(where).is_relative_to(installed.venv), where
    assert not [entry for entry in path if entry and Path(entry).is_relative_to(ROOT)], path
    if installed.user is not None:
        assert uid == installed.user[0]
    assert (await output(installed.argv("pd-sidecar", "--version"), installed.env)).strip() == (
        PROJECT["version"]
    )

    _, final = stages()
    ports = {name: free_port() for name in ("prefill", "decode", "sidecar")}
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    async with Launcher(prefix="pd-sidecar-image-") as launcher:
        for name, program in (("prefill", EMULATOR_COMMAND), ("decode", ("pd-sidecar-emulator",))):
            argv = installed.argv(*program, "--port", str(ports[name]))
            await launcher.start(
                name,
                argv,
                env=installed.env,
                cwd=Path("/"),
                url=urls[name],
                ready="/health",
                timeout_s=START_TIMEOUT_S,
            )
        settings = {
            "SIDECAR_HOST": "127.0.0.1",
            "SIDECAR_PORT": str(ports["sidecar"]),
            "SIDECAR_DECODE_URL": urls["decode"],
            "SIDECAR_READY_INTERVAL_S": "0.05",
        }
        await launcher.start(
            "sidecar",
            installed.argv(*orjson.loads(final.one("ENTRYPOINT"))),
            env={**installed.env, **settings},
            cwd=Path("/"),
            url=urls["sidecar"],
            ready="/ready",
            timeout_s=START_TIMEOUT_S,
        )
        body = {
            "model": "emulated-model",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 8,
        }
        prefill = f"127.0.0.1:{ports['prefill']}"
        async with http.post(
            urls["sidecar"] + "/v1/chat/completions",
            json=body,
            headers={"x-prefiller-host-port": prefill},
        ) as response:
            assert response.status == 200, await response.text()
            answer = await response.json()
        assert answer["choices"][0]["message"]["content"]
        async with http.get(urls["sidecar"] + "/debug/requests?limit=1") as response:
            [record] = (await response.json())["recent"]
        assert (record["decision"], record["state"], record["status"]) == (
            "remote",
            "completed",
            200,
        )
        assert record["prefill_endpoint"] == prefill
        async with http.get(urls["prefill"] + "/emulator/requests") as response:
            assert len((await response.json())["requests"]) == 1
    if installed.unreachable:
        missing(f"ran as root, not as the image's user: {installed.unreachable}")
