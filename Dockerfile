# syntax=docker/dockerfile:1
# pd-sidecar's image: the sidecar (the entrypoint) and, with the command overridden, the engine
# emulator (`python -m sidecar.emulator`), so that a cluster without GPUs runs the whole demo.
#   docker build -t ghcr.io/pd-sidecar/pd-sidecar:0.1.0 .   (not published: docs/image.md)
# docs/image.md says how to run it. tests/test_image.py runs this file's pip steps as written,
# outside a container (/wheels moved to a temporary directory, a venv for the final stage's
# Python), and takes the user below with setpriv: a step of another kind needs a stand-in there.

# --- build: the project's wheel and every dependency's, into /wheels ---------------------------
FROM python:3.11-slim-bookworm AS build
WORKDIR /src
# The build needs these and nothing else; .dockerignore admits only them to the context.
COPY pyproject.toml README.md LICENSE ./
COPY sidecar/ sidecar/
# Every dependency ships wheels for CPython 3.11 on x86_64 and arm64, so no compiler is needed
# here either; on a platform without one pip stops with an error naming the package. The tracing
# extra (OpenTelemetry SDK, OTLP/HTTP exporter) is in: SIDECAR_TRACING=true works in the image;
# so is the kvevents extra (pyzmq, msgpack): SIDECAR_KV_EVENTS=true does too.
RUN --mount=type=cache,target=/root/.cache/pip \
    python -m pip wheel --disable-pip-version-check --wheel-dir /wheels ".[tracing,kvevents]"

# --- run: the wheels installed on the same base, nothing to build with -------------------------
FROM python:3.11-slim-bookworm

# The version below must be the one in pyproject.toml: the install names it, so a mismatch
# fails the build rather than mislabelling the image.
ARG VERSION=0.1.0
# Filled in by the build, e.g. --build-arg REVISION="$(git rev-parse HEAD)".
ARG REVISION=""
ARG SOURCE=""

LABEL org.opencontainers.image.title="pd-sidecar" \
      org.opencontainers.image.description="Decode-pod sidecar for prefill/decode-disaggregated LLM serving, with its vLLM-compatible engine emulator" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="docker.io/library/python:3.11-slim-bookworm"

# The wheels are bind-mounted from the build stage, so no layer keeps them. setuptools and wheel
# come with the base image and are needed by nothing at run time: removed.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    python -m pip install --disable-pip-version-check --root-user-action=ignore --no-cache-dir \
        --no-index --find-links /wheels "pd-sidecar[tracing,kvevents]==${VERSION}" \
 && python -m pip uninstall --disable-pip-version-check --root-user-action=ignore --yes \
        setuptools wheel

# A numeric user (Kubernetes' runAsNonRoot can only verify a number) with a passwd entry, no
# home and no shell; it owns nothing, so it can change nothing of the installation.
RUN groupadd --gid 10001 sidecar \
 && useradd --no-log-init --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin sidecar
USER 10001:10001

# Nothing is written at run time (the bytecode was compiled at install), so the root filesystem
# can be mounted read-only. PYTHONSAFEPATH: the working directory never shadows the package.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONSAFEPATH=1

# The sidecar's API (SIDECAR_PORT); the decode engine listens behind it on loopback (8200).
EXPOSE 8000

# No HEALTHCHECK: Kubernetes ignores it (the manifests probe /health and /ready), and one image
# runs two programs on ports set at run time, which a baked-in check could not know.
ENTRYPOINT ["python", "-m", "sidecar"]
