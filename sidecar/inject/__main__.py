"""``python -m sidecar.inject`` / ``pd-sidecar-inject``: YAML in (files or stdin), YAML out."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence

from sidecar.inject.documents import inject_text
from sidecar.inject.pod import InjectError
from sidecar.inject.template import Options, defaults

PROG = "pd-sidecar inject"
_DNS_NAME = re.compile(
    r"^(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
)
DESCRIPTION = """\
Inject pd-sidecar into the decode workloads (Deployment, StatefulSet, DaemonSet, ReplicaSet,
PodTemplate, Pod; also inside a List) of a YAML stream, and print the stream:

  python -m sidecar.inject -f decode.yaml | kubectl apply -f -

The engine is the container serving the pod's serving port (--sidecar-port, a containerPort or a
--port argument). It is moved to --engine-port; the sidecar, a native sidecar (an init container
with restartPolicy Always, Kubernetes >= 1.29), takes the serving port. The engine gets a preStop
wait of --drain-s seconds and the pod a grace period of twice that + 5 s (docs/deploy.md).
With --tls-secret, the sidecar serves HTTPS with that Secret's certificate.
Workloads injected already are left as they are; documents that are not changed are printed as
they were read, comments included (a changed document loses its comments). On any workload it
cannot inject, it prints nothing, says why on stderr and exits with status 2.
"""


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


def parser() -> argparse.ArgumentParser:
    base = defaults()
    p = argparse.ArgumentParser(
        prog=PROG, description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "-f",
        "--filename",
        action="append",
        metavar="FILE",
        help="YAML file to read, '-' for stdin (repeatable; default: stdin)",
    )
    p.add_argument(
        "--name",
        action="append",
        default=[],
        help="inject only the workload of this name (repeatable; default: every workload)",
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
        "--tls-secret",
        metavar="NAME",
        help="serve HTTPS with the certificate of this kubernetes.io/tls Secret, mounted "
        "read-only; the probes follow (default: plain HTTP)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> None:
    p = parser()
    args = p.parse_args(argv)
    ports = {"--sidecar-port": args.sidecar_port, "--engine-port": args.engine_port}
    ports["--admin-port"] = args.admin_port
    if len(set(ports.values())) < len(ports):
        p.error("--sidecar-port, --engine-port and --admin-port must differ: " + str(ports))
    if not args.image.strip():
        p.error("--image is empty")
    if args.tls_secret is not None and not _DNS_NAME.match(args.tls_secret):
        p.error(f"--tls-secret {args.tls_secret!r} is not a Secret name (a lower-case DNS name)")
    options = Options(
        image=args.image,
        sidecar_port=args.sidecar_port,
        engine_port=args.engine_port,
        admin_port=args.admin_port,
        drain_s=args.drain_s,
        tls_secret=args.tls_secret,
    )
    texts: list[str] = []
    for name in args.filename or ["-"]:
        try:
            texts.append(sys.stdin.read() if name == "-" else _read(name))
        except OSError as exc:
            print(f"{PROG}: cannot read {name}: {exc.strerror}", file=sys.stderr)
            raise SystemExit(2) from None
    try:
        output, report = inject_text(_join(texts), options, args.name)
    except InjectError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    for name in report.unchanged:
        print(f"{PROG}: {name}: injected already, left as it is", file=sys.stderr)
    sys.stdout.write(output)


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
