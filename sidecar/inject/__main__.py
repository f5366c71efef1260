"""``python -m sidecar.inject`` / ``pd-sidecar-inject``: YAML in (files or stdin), YAML out."""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence

import yaml

from sidecar.inject import environment
from sidecar.inject.check import check_text
from sidecar.inject.documents import inject_text
from sidecar.inject.environment import EnvError
from sidecar.inject.pod import InjectError
from sidecar.inject.template import Options, defaults, render

MODULE = "python -m sidecar.inject"
_DNS_NAME = re.compile(
    r"^(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
)
DESCRIPTION = """\
Inject pd-sidecar into the decode workloads (Deployment, StatefulSet, DaemonSet, ReplicaSet,
PodTemplate, Pod; also inside a List) of a YAML stream, and print the stream:

  {prog} -f decode.yaml | kubectl apply -f -

Which workloads: those named by --name; else, when any workload carries llm-d's role label
(llm-d.ai/role on its pods), those labelled decode, both or prefill-decode; else every one.
Each one left out is named on stderr with the reason.

The engine is the container serving the pod's serving port (--sidecar-port, a containerPort or a
--port argument). It is moved to --engine-port; the sidecar, a native sidecar (an init container
with restartPolicy Always, Kubernetes >= 1.29), takes the serving port. The engine gets a preStop
wait of --drain-s seconds and the pod a grace period of twice that + 5 s (docs/deploy.md). An
engine preStop hook of its own is kept: a sleep is lengthened to --drain-s if shorter, a command
runs after the wait and the grace period counts --engine-prestop-s for it.
With --tls-secret, the sidecar serves HTTPS with that Secret's certificate.
Workloads injected already are left as they are; documents that are not changed are printed as
they were read, comments included (a changed document loses its comments). On any workload it
cannot inject, it prints nothing, says why on stderr and exits with status 2.
"""
SETTING_OPTIONS = {
    "connector": "SIDECAR_CONNECTOR",
    "prefill_endpoints": "SIDECAR_PREFILL_ENDPOINTS",
    "prefill_dns": "SIDECAR_PREFILL_DNS",
    "inference_pool": "SIDECAR_INFERENCE_POOL",
}
"""Options that set one variable of the sidecar each (validated as --env is)."""


def prog_name(argv0: str, module: str = MODULE) -> str:
    """The command as it was typed: the console script's name, else ``module`` (``python -m
    ...``)."""
    name = os.path.basename(argv0)
    return name if name and not name.endswith(".py") and name != "-c" else module


def _port(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port (1-65535)")
    return value


def _seconds(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


def parser(prog: str = MODULE) -> argparse.ArgumentParser:
    base = defaults()
    p = argparse.ArgumentParser(
        prog=prog,
        description=DESCRIPTION.format(prog=prog),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "-f",
        "--filename",
        action="append",
        metavar="FILE",
        help="YAML file to read, '-' for stdin (repeatable; default: stdin)",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="inject nothing: check the workloads that carry the sidecar already (e.g. built "
        "with the kustomize component) for a port two containers take, an engine left on the "
        "sidecar's port and a grace period shorter than the drain needs; one line per "
        "problem, exit status 1 when there is one",
    )
    p.add_argument(
        "--name",
        action="append",
        default=[],
        help="inject only the workload of this name, whatever its role label (repeatable; "
        "default: the decode workloads)",
    )
    p.add_argument("--image", default=base.image, help="sidecar image (default: %(default)s)")
    p.add_argument(
        "--sidecar-port",
        type=_port,
        default=base.sidecar_port,
        help="the pod's serving port: the engine's now, the sidecar's after (default: %(default)s)",
    )
    p.add_argument(
        "--engine-port",
        type=_port,
        default=base.engine_port,
        help="where the engine is moved to (default: %(default)s)",
    )
    p.add_argument(
        "--admin-port",
        type=_port,
        default=base.admin_port,
        help="the sidecar's /metrics and /debug port (default: %(default)s)",
    )
    p.add_argument(
        "--drain-s",
        type=_seconds,
        default=base.drain_s,
        help="SIDECAR_DRAIN_TIMEOUT_S and the engine's preStop wait, in seconds "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--engine-prestop-s",
        type=_seconds,
        default=base.engine_prestop_s,
        metavar="SECONDS",
        help="the longest the engine's own preStop command runs (not a sleep, whose length is "
        "read): the grace period counts it (default: %(default)s)",
    )
    settings = p.add_argument_group(
        "the sidecar's settings",
        "checked as the sidecar checks them at start: a SIDECAR_ name that is no setting, or a "
        "bad value, exits with status 2 (python -m sidecar --help lists them)",
    )
    settings.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a variable of the sidecar container (repeatable)",
    )
    settings.add_argument(
        "--connector",
        help="SIDECAR_CONNECTOR: nixl, nixl-push, sglang or shared-storage (default: the "
        "sidecar's, nixl)",
    )
    settings.add_argument(
        "--prefill-endpoints",
        metavar="HOST:PORT,...",
        help="SIDECAR_PREFILL_ENDPOINTS: a static prefill pool the sidecar schedules on",
    )
    settings.add_argument(
        "--prefill-dns",
        metavar="NAME:PORT",
        help="SIDECAR_PREFILL_DNS: a headless Service of the prefill pods the sidecar schedules on",
    )
    settings.add_argument(
        "--inference-pool",
        metavar="NAMESPACE/NAME",
        help="SIDECAR_INFERENCE_POOL: only the pods of this InferencePool are prefill targets a "
        "gateway's header may name (needs RBAC, docs/deploy.md)",
    )
    p.add_argument(
        "--tls-secret",
        metavar="NAME",
        help="serve HTTPS with the certificate of this kubernetes.io/tls Secret, mounted "
        "read-only; the probes follow (default: plain HTTP)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> None:
    prog = prog_name(sys.argv[0])
    p = parser(prog)
    args = p.parse_args(argv)
    ports = {"--sidecar-port": args.sidecar_port, "--engine-port": args.engine_port}
    ports["--admin-port"] = args.admin_port
    if len(set(ports.values())) < len(ports):
        p.error("--sidecar-port, --engine-port and --admin-port must differ: " + str(ports))
    if not args.image.strip():
        p.error("--image is empty")
    if args.tls_secret is not None and not _DNS_NAME.match(args.tls_secret):
        p.error(f"--tls-secret {args.tls_secret!r} is not a Secret name (a lower-case DNS name)")
    try:
        given = [
            (variable, getattr(args, dest), "--" + dest.replace("_", "-"))
            for dest, variable in SETTING_OPTIONS.items()
            if getattr(args, dest) is not None
        ]
        given += [(name, value, "--env") for name, value in environment.parse(args.env)]
        env = environment.merge(given)
    except EnvError as exc:
        p.error(str(exc))
    options = Options(
        image=args.image,
        sidecar_port=args.sidecar_port,
        engine_port=args.engine_port,
        admin_port=args.admin_port,
        drain_s=args.drain_s,
        tls_secret=args.tls_secret,
        engine_prestop_s=args.engine_prestop_s,
        env=env,
    )
    texts: list[str] = []
    for name in args.filename or ["-"]:
        try:
            texts.append(sys.stdin.read() if name == "-" else _read(name))
        except OSError as exc:
            print(f"{prog}: cannot read {name}: {exc.strerror}", file=sys.stderr)
            raise SystemExit(2) from None
    if args.check:
        _check(prog, _join(texts))
        return
    try:
        output, report = inject_text(_join(texts), options, args.name)
    except (InjectError, EnvError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    lines = [f"{name}: injected already, left as it is" for name in report.unchanged]
    lines += [*report.skipped, *report.notes]
    if report.injected:
        lines += [f"note: {note}" for note in environment.notes(render(options).container["env"])]
    for line in lines:
        print(f"{prog}: {line}", file=sys.stderr)
    sys.stdout.write(output)


def _check(prog: str, text: str) -> None:
    try:
        checked, problems = check_text(text)
    except yaml.YAMLError as exc:
        print(f"{prog}: the input is not valid YAML: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    for problem in problems:
        print(f"{prog}: {problem}", file=sys.stderr)
    if not checked:
        print(f"{prog}: no workload carries the sidecar: nothing to check", file=sys.stderr)
        raise SystemExit(1)
    if problems:
        raise SystemExit(1)
    print(f"{prog}: {checked} workload(s) with the sidecar checked: no problem", file=sys.stderr)


def _read(name: str) -> str:
    with open(name, encoding="utf-8") as f:
        return f.read()


def _join(texts: list[str]) -> str:
    """Several files as one stream: each after the first starts a new document."""
    out = texts[0]
    for text in texts[1:]:
        if out and not out.endswith("\n"):
            out += "\n"
        out += text if text.startswith("---") else "---\n" + text
    return out


if __name__ == "__main__":
    main()
