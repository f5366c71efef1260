"""``python -m sidecar.inject``: what it does to real manifests, what it refuses, and its CLI."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest
import yaml

from sidecar.config import Settings
from sidecar.inject import InjectError, Options, defaults, inject_text
from sidecar.inject.environment import EnvError
from sidecar.inject.template import ENGINE_EXIT_S, load
from tests.imports import imported
from tests.k8s import validate, yamllint

DEPLOYMENT = """\
apiVersion: apps/v1
kind: Deployment
metadata:
  name: decode
spec:
  selector:
    matchLabels:
      app: decode
  template:
    metadata:
      labels:
        app: decode
    spec:
      containers:
        - name: vllm
          image: vllm/vllm-openai:v0.32.0
{engine}
"""
ENGINE_ARGS = """\
          args: ["--model", "m", "--port", "8000"]
          ports:
            - containerPort: 8000
"""


def deployment(engine: str = ENGINE_ARGS, kind: str = "Deployment") -> str:
    return DEPLOYMENT.format(engine=engine.rstrip("\n")).replace(
        "kind: Deployment", f"kind: {kind}"
    )


def inject(text: str, options: Options | None = None, names: tuple[str, ...] = ()) -> str:
    return inject_text(text, options or defaults(), names)[0]


def pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    if doc["kind"] == "Pod":
        return doc["spec"]
    if doc["kind"] == "PodTemplate":
        return doc["template"]["spec"]
    return doc["spec"]["template"]["spec"]


def only(text: str) -> dict[str, Any]:
    (doc,) = [d for d in yaml.safe_load_all(text) if d]
    return doc


def container(spec: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [c for c in spec["containers"] if c["name"] == name]
    return found


def sidecar_env(spec: dict[str, Any]) -> dict[str, str]:
    (sidecar,) = [c for c in spec["initContainers"] if c["name"] == "pd-sidecar"]
    return {item["name"]: item["value"] for item in sidecar["env"]}


def settings_of(spec: dict[str, Any]) -> Settings:
    """The sidecar's own Settings from the pod's env: every variable must exist and be valid."""
    values: dict[str, Any] = {
        name.removeprefix("SIDECAR_").lower(): value
        for name, value in sidecar_env(spec).items()
        if name.startswith("SIDECAR_")
    }
    return Settings(**values)


def check_termination(spec: dict[str, Any]) -> None:
    """The arithmetic of docs/deploy.md, from the numbers in the pod spec."""
    drain = float(sidecar_env(spec)["SIDECAR_DRAIN_TIMEOUT_S"])
    pre_stop = spec["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    wait = float(pre_stop[1])
    assert wait >= drain
    assert spec["terminationGracePeriodSeconds"] >= wait + drain + ENGINE_EXIT_S


def engine_command(spec: dict[str, Any]) -> list[str]:
    engine = spec["containers"][0]
    return [*engine.get("command", []), *engine.get("args", [])]


def test_a_deployment_gets_the_packaged_sidecar_and_its_engine_moves() -> None:
    out = inject(deployment())
    doc = only(out)
    spec = pod_spec(doc)
    assert spec["initContainers"] == [load()["container"]]
    labels = doc["spec"]["template"]["metadata"]["labels"]
    assert labels == {**labels, **load()["podLabels"]}, "the PodMonitor's label"
    sidecar = spec["initContainers"][0]
    assert sidecar["restartPolicy"] == "Always"
    assert "startupProbe" not in sidecar
    assert sidecar["livenessProbe"]["httpGet"]["path"] == "/health"
    assert sidecar["readinessProbe"]["httpGet"]["path"] == "/ready"
    engine = container(spec, "vllm")
    assert engine["args"] == ["--model", "m", "--port", "8200"]
    assert engine["ports"] == [{"containerPort": 8200, "name": "engine"}]
    settings = settings_of(spec)
    assert settings.port == 8000
    assert settings.decode_url == "http://127.0.0.1:8200"
    assert settings.admin_port == 9090
    check_termination(spec)
    validate(out)
    yamllint(stdin=out)


@pytest.mark.parametrize(
    ("engine", "expected"),
    [
        pytest.param(
            '          args: ["--model", "m", "--port=8000"]\n',
            ["--model", "m", "--port=8200"],
            id="--port=8000",
        ),
        pytest.param(
            '          command: ["vllm", "serve", "m", "--port", "8000"]\n',
            ["vllm", "serve", "m", "--port", "8200"],
            id="in command",
        ),
        pytest.param(
            '          command: ["sh", "-c", "vllm serve m --port 8000 --max-num-seqs 8000"]\n',
            ["sh", "-c", "vllm serve m --port 8200 --max-num-seqs 8000"],
            id="shell script",
        ),
        pytest.param(
            '          args: ["--model", "m"]\n          ports: [{containerPort: 8000}]\n',
            ["--model", "m", "--port", "8200"],
            id="containerPort only: --port added",
        ),
        pytest.param(
            '          command: ["vllm", "serve", "m"]\n          ports: [{containerPort: 8000}]\n',
            ["vllm", "serve", "m", "--port", "8200"],
            id="containerPort only, command only",
        ),
    ],
)
def test_every_form_of_the_port_is_moved(engine: str, expected: list[str]) -> None:
    out = inject(deployment(engine))
    spec = pod_spec(only(out))
    assert engine_command(spec) == expected
    assert {"containerPort": 8200, "name": "engine"} in container(spec, "vllm")["ports"]
    validate(out)


def test_a_named_port_goes_to_the_sidecar_and_the_engine_probes_follow_the_engine() -> None:
    engine = """\
          args: ["--port", "8000"]
          ports:
            - name: api
              containerPort: 8000
              protocol: TCP
            - name: nixl
              containerPort: 5600
          startupProbe:
            httpGet: {path: /health, port: api}
          livenessProbe:
            tcpSocket: {port: 8000}
          readinessProbe:
            httpGet: {path: /health, port: "8000"}
"""
    spec = pod_spec(only(inject(deployment(engine))))
    sidecar = spec["initContainers"][0]
    assert sidecar["ports"][0] == {"name": "api", "containerPort": 8000}
    vllm = container(spec, "vllm")
    assert vllm["ports"] == [
        {"name": "engine", "containerPort": 8200, "protocol": "TCP"},
        {"name": "nixl", "containerPort": 5600},
    ]
    assert vllm["startupProbe"]["httpGet"]["port"] == "engine"
    assert vllm["livenessProbe"]["tcpSocket"]["port"] == 8200
    assert vllm["readinessProbe"]["httpGet"]["port"] == 8200


@pytest.mark.parametrize("kind", ["StatefulSet", "DaemonSet", "ReplicaSet"])
def test_other_workloads_with_a_pod_template(kind: str) -> None:
    text = deployment(kind=kind)
    if kind == "StatefulSet":
        text = text.replace("spec:\n  selector:", "spec:\n  serviceName: decode\n  selector:")
    out = inject(text)
    doc = only(out)
    assert doc["kind"] == kind
    check_termination(pod_spec(doc))
    validate(out)


def test_a_bare_pod_and_a_pod_template() -> None:
    pod = """\
apiVersion: v1
kind: Pod
metadata:
  name: decode-0
spec:
  containers:
    - name: vllm
      image: vllm/vllm-openai:v0.32.0
      args: ["--port", "8000"]
---
apiVersion: v1
kind: PodTemplate
metadata:
  name: decode-template
template:
  spec:
    containers:
      - name: vllm
        image: vllm/vllm-openai:v0.32.0
        args: ["--port", "8000"]
"""
    out = inject(pod)
    docs = [d for d in yaml.safe_load_all(out) if d]
    assert [d["kind"] for d in docs] == ["Pod", "PodTemplate"]
    for doc in docs:
        spec = pod_spec(doc)
        assert engine_command(spec) == ["--port", "8200"]
        check_termination(spec)
    # The labels go where the pod's metadata is: the Pod's own, the template's (created).
    assert docs[0]["metadata"]["labels"] == load()["podLabels"]
    assert docs[1]["template"]["metadata"]["labels"] == load()["podLabels"]
    validate(out)


def test_a_list_is_injected_item_by_item() -> None:
    listed = {"apiVersion": "v1", "kind": "List", "items": [yaml.safe_load(deployment())]}
    out = inject(yaml.safe_dump(listed, sort_keys=False))
    doc = only(out)
    assert doc["kind"] == "List"
    check_termination(pod_spec(doc["items"][0]))
    validate(out)


SERVICE = """\
# The decode Service: kept as written, this comment included.
apiVersion: v1
kind: Service
metadata:
  name: decode   # odd spacing, kept
spec:
  ports: [{port: 8000, targetPort: 8000}]
"""
CONFIGMAP = """\
---
apiVersion: v1
kind: ConfigMap
metadata: {name: settings}
data:
  mode: "on"
"""


def test_documents_other_than_workloads_pass_through_byte_for_byte() -> None:
    text = SERVICE + CONFIGMAP + "---\n" + deployment() + "---\n# only a comment\n"
    out = inject(text)
    assert out.startswith(SERVICE + CONFIGMAP + "---\n")
    assert out.endswith("---\n# only a comment\n")
    kinds = [d["kind"] for d in yaml.safe_load_all(out) if d]
    assert kinds == ["Service", "ConfigMap", "Deployment"]


def test_injecting_twice_changes_nothing() -> None:
    text = SERVICE + "---\n" + deployment()
    once, report = inject_text(text, defaults())
    twice, again = inject_text(once, defaults())
    assert twice == once
    assert report.injected == ["Deployment/decode"]
    assert again.injected == []
    assert again.unchanged == ["Deployment/decode"]


def test_only_the_named_workloads_are_injected() -> None:
    prefill = deployment().replace("name: decode", "name: prefill")
    text = deployment() + "---\n" + prefill
    out = inject(text, names=("decode",))
    assert out.endswith("---\n" + prefill)
    with pytest.raises(InjectError, match="no Deployment, StatefulSet or pod named decoder"):
        inject(text, names=("decoder",))


def test_options_change_every_place_the_number_appears() -> None:
    engine = '          args: ["--port", "8080"]\n'
    options = Options(
        image="registry.example/pd-sidecar:dev",
        sidecar_port=8080,
        engine_port=9000,
        admin_port=9100,
        drain_s=10,
    )
    out = inject(deployment(engine), options)
    spec = pod_spec(only(out))
    sidecar = spec["initContainers"][0]
    assert sidecar["image"] == "registry.example/pd-sidecar:dev"
    assert [p["containerPort"] for p in sidecar["ports"]] == [8080, 9100]
    assert sidecar["readinessProbe"]["httpGet"]["port"] == 8080
    settings = settings_of(spec)
    assert (settings.port, settings.admin_port) == (8080, 9100)
    assert settings.decode_url == "http://127.0.0.1:9000"
    assert settings.drain_timeout_s == 10
    assert engine_command(spec) == ["--port", "9000"]
    assert spec["containers"][0]["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "10"]
    assert spec["terminationGracePeriodSeconds"] == 10 + 10 + ENGINE_EXIT_S
    check_termination(spec)


@pytest.mark.parametrize(("before", "after"), [(20, 65), (65, 65), (300, 300)])
def test_the_grace_period_is_raised_never_lowered(before: int, after: int) -> None:
    text = deployment().replace(
        "      containers:", f"      terminationGracePeriodSeconds: {before}\n      containers:"
    )
    assert pod_spec(only(inject(text)))["terminationGracePeriodSeconds"] == after


REFUSALS = [
    pytest.param(
        '          args: ["--port", "8000"]\n'
        "        - name: other\n"
        "          image: example/other:1\n"
        "          ports: [{containerPort: 8000}]\n",
        "Deployment/decode: containers 'vllm' and 'other' both claim port 8000",
        id="two containers on the port",
    ),
    pytest.param(
        '          args: ["--port", "9000"]\n',
        "Deployment/decode: no container serves port 8000",
        id="nothing on the serving port",
    ),
    pytest.param(
        '          args: ["--port", "8000"]\n'
        "        - name: istio-proxy\n"
        "          image: docker.io/istio/proxyv2:1.24.0\n",
        "Deployment/decode: container 'istio-proxy' (image 'docker.io/istio/proxyv2:1.24.0') "
        "looks like Istio's sidecar: the engine is already behind another proxy",
        id="istio",
    ),
    pytest.param(
        '          args: ["--port", "8200"]\n'
        "      initContainers:\n"
        "        - name: proxy\n"
        "          image: example/other-proxy:1\n"
        "          restartPolicy: Always\n"
        "          ports: [{containerPort: 8000}]\n",
        "Deployment/decode: init container 'proxy' already serves port 8000: "
        "the engine is behind another proxy",
        id="another native sidecar on the port",
    ),
    pytest.param(
        '          args: ["--port", "8000"]\n'
        "      initContainers:\n"
        "        - name: routing-proxy\n"
        "          image: ghcr.io/llm-d/llm-d-routing-sidecar:v0.3.0\n"
        "          restartPolicy: Always\n",
        "looks like llm-d's routing sidecar",
        id="llm-d routing sidecar",
    ),
    pytest.param(
        '          args: ["--port", "8000"]\n'
        "        - name: exporter\n"
        "          image: example/exporter:1\n"
        "          ports: [{containerPort: 8200}]\n",
        "Deployment/decode: container 'exporter' already uses port 8200, the engine's new port",
        id="engine port taken",
    ),
    pytest.param(
        '          args: ["--port", "8000"]\n'
        "          lifecycle:\n"
        "            preStop: {httpGet: {path: /drain, port: 8000}}\n",
        "Deployment/decode: engine container 'vllm' has an httpGet preStop hook (GET /drain): a "
        "container has one preStop handler and the sidecar needs a 30 s wait in it. Write both "
        "as one exec, e.g. command: [sh, -c, 'sleep 30; curl -fsS "
        "http://127.0.0.1:8200/drain']",
        id="an httpGet preStop",
    ),
    pytest.param(
        '          args: ["--port", "8000"]\n'
        "          lifecycle:\n"
        "            preStop: {tcpSocket: {port: 8000}}\n",
        "engine container 'vllm' has a tcpSocket preStop hook, which Kubernetes does not run",
        id="a tcpSocket preStop",
    ),
    pytest.param(
        "          ports: [{containerPort: 8000}]\n",
        "engine container 'vllm' has no command or args: --port cannot be added",
        id="no command to add --port to",
    ),
    pytest.param(
        '          command: ["/bin/sh", "-c", "exec vllm serve m"]\n'
        "          ports: [{containerPort: 8000}]\n",
        "engine container 'vllm' runs a shell script without --port",
        id="shell script without --port",
    ),
    pytest.param(
        '          args: ["--port", "9000"]\n          ports: [{containerPort: 8000}]\n',
        "engine container 'vllm' declares containerPort 8000 but runs with --port 9000",
        id="containerPort and --port disagree",
    ),
    pytest.param(
        '          args: ["--port", "$(PORT)"]\n          ports: [{containerPort: 8000}]\n',
        "engine container 'vllm' runs with --port $(PORT), which is not a number",
        id="--port not a number",
    ),
    pytest.param(
        '          args: ["--port", "8000"]\n'
        "        - name: pd-sidecar\n"
        "          image: ghcr.io/pd-sidecar/pd-sidecar:0.0.1\n",
        "container 'pd-sidecar' is a regular container, not the native sidecar",
        id="an old sidecar as a regular container",
    ),
]


@pytest.mark.parametrize(("engine", "message"), REFUSALS)
def test_refusals_name_the_object_and_the_reason(engine: str, message: str) -> None:
    with pytest.raises(InjectError) as caught:
        inject(deployment(engine))
    assert message in str(caught.value)


def test_input_without_any_workload_is_refused() -> None:
    with pytest.raises(InjectError, match=r"nothing to inject: .* \(kinds: Service\)"):
        inject(SERVICE)
    with pytest.raises(InjectError, match="document 2 is not valid YAML"):
        inject(SERVICE + "---\nkind: [\n")


# The command line, as run by a person: real files, stdin, exit status and stderr.


def cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sidecar.inject", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_the_injector_loads_no_aiohttp() -> None:
    """Neither the package nor its command line loads the engine client (it would cost the
    injector about half a second)."""
    for args in (["-c", "import sidecar.inject"], ["-m", "sidecar.inject", "--help"]):
        loaded = imported(*args)
        assert "sidecar.inject.template" in loaded, args
        assert "aiohttp" not in loaded, args


@pytest.mark.system
def test_cli_reads_a_file_and_its_output_reinjects_to_the_same_bytes(tmp_path: Path) -> None:
    source = tmp_path / "decode.yaml"
    source.write_text(SERVICE + "---\n" + deployment())
    first = cli("-f", str(source))
    assert first.returncode == 0, first.stderr
    # Only the one thing worth knowing about the defaults: any header target is called.
    assert first.stderr.splitlines() == [
        "python -m sidecar.inject: note: the sidecar will call any prefill server a request "
        "header names (no --inference-pool, no SIDECAR_PREFILL_ALLOWED_CIDRS or _HOSTS): safe "
        "only behind a gateway that removes that header from clients' requests (docs/deploy.md)"
    ]
    assert first.stdout == inject(source.read_text())
    second = cli(stdin=first.stdout)  # stdin by default
    assert second.returncode == 0
    assert second.stdout == first.stdout
    assert "Deployment/decode: injected already, left as it is" in second.stderr
    assert cli("-f", "-", stdin=first.stdout).stdout == first.stdout


@pytest.mark.system
def test_cli_reads_several_files_as_one_stream(tmp_path: Path) -> None:
    (tmp_path / "service.yaml").write_text(SERVICE)
    (tmp_path / "decode.yaml").write_text(deployment())
    result = cli("-f", str(tmp_path / "service.yaml"), "-f", str(tmp_path / "decode.yaml"))
    assert result.returncode == 0, result.stderr
    kinds = [d["kind"] for d in yaml.safe_load_all(result.stdout) if d]
    assert kinds == ["Service", "Deployment"]


@pytest.mark.system
def test_cli_refusal_is_exit_status_2_with_nothing_on_stdout(tmp_path: Path) -> None:
    source = tmp_path / "decode.yaml"
    source.write_text(deployment('          args: ["--port", "9000"]\n'))
    result = cli("-f", str(source))
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.startswith(
        "python -m sidecar.inject: Deployment/decode: no container serves"
    )
    missing = cli("-f", str(tmp_path / "absent.yaml"))
    assert missing.returncode == 2
    assert "cannot read" in missing.stderr


@pytest.mark.system
@pytest.mark.parametrize(
    "args",
    [
        ["--engine-port", "8000"],
        ["--admin-port", "8200"],
        ["--sidecar-port", "70000"],
        ["--drain-s", "-1"],
        ["--image", " "],
    ],
)
def test_cli_bad_options_are_exit_status_2(args: list[str]) -> None:
    result = cli(*args, stdin=deployment())
    assert result.returncode == 2
    assert result.stdout == ""


@pytest.mark.system
def test_cli_options_reach_the_output() -> None:
    result = cli(
        "--image", "registry.example/pd-sidecar:dev", "--drain-s", "12", stdin=deployment()
    )
    assert result.returncode == 0, result.stderr
    spec = pod_spec(only(result.stdout))
    assert spec["initContainers"][0]["image"] == "registry.example/pd-sidecar:dev"
    assert settings_of(spec).drain_timeout_s == 12
    assert spec["terminationGracePeriodSeconds"] == 12 + 12 + ENGINE_EXIT_S


def test_tls_secret_mounts_it_and_moves_the_probes_to_https() -> None:
    options = dataclasses.replace(defaults(), tls_secret="decode-tls")
    spec = pod_spec(only(inject(deployment(), options)))
    settings = settings_of(spec)
    assert settings.tls_cert_file == "/etc/pd-sidecar/tls/tls.crt"
    assert settings.tls_key_file == "/etc/pd-sidecar/tls/tls.key"
    (sidecar,) = spec["initContainers"]
    assert sidecar["volumeMounts"] == [
        {"name": "pd-sidecar-tls", "mountPath": "/etc/pd-sidecar/tls", "readOnly": True}
    ]
    assert spec["volumes"] == [{"name": "pd-sidecar-tls", "secret": {"secretName": "decode-tls"}}]
    assert sidecar["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert sidecar["livenessProbe"]["httpGet"]["scheme"] == "HTTPS"
    validate(inject(deployment(), options))
    # A pod that has a volume of that name already is refused.
    volume = "      volumes:\n        - name: pd-sidecar-tls\n          emptyDir: {}\n"
    taken = deployment().replace("      containers:", volume + "      containers:")
    with pytest.raises(InjectError, match="already has a volume named 'pd-sidecar-tls'"):
        inject(taken, options)


@pytest.mark.system
def test_cli_tls_secret(tmp_path: Path) -> None:
    source = tmp_path / "decode.yaml"
    source.write_text(deployment())
    argv = [sys.executable, "-m", "sidecar.inject", "-f", str(source)]
    done = subprocess.run([*argv, "--tls-secret", "decode-tls"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "secretName: decode-tls" in done.stdout
    bad = subprocess.run([*argv, "--tls-secret", "Not_A_Name"], capture_output=True, text=True)
    assert bad.returncode == 2
    assert "--tls-secret" in bad.stderr


@pytest.mark.system
def test_the_console_script_is_installed() -> None:
    script = Path(sysconfig.get_path("scripts")) / "pd-sidecar-inject"
    assert script.exists() or shutil.which("pd-sidecar-inject"), "pip install -e . installs it"
    result = subprocess.run(
        [str(script), "-f", "-"], input=deployment(), capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == inject(deployment())
    assert (
        "kubectl apply -f -"
        in subprocess.run(
            [str(script), "--help"], capture_output=True, text=True, timeout=30
        ).stdout
    )


# Real manifests: the engine's own preStop hook, llm-d's role label, the sidecar's settings on
# the command line, the command's name.

VLLM_DECODE = """\
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {name}
  labels:
    app.kubernetes.io/name: llama
spec:
  replicas: 2
  selector:
    matchLabels:
      app: llama-{name}
  template:
    metadata:
      labels:
        app: llama-{name}
{role}    spec:
      terminationGracePeriodSeconds: 30
      containers:
        - name: vllm
          image: vllm/vllm-openai:v0.32.0
          command: ["vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct"]
          args:
            - --port
            - "8000"
            - --kv-transfer-config
            - '{{"kv_connector":"NixlConnector","kv_role":"kv_both"}}'
          ports:
            - name: http
              containerPort: 8000
          readinessProbe:
            httpGet: {{path: /health, port: http}}
{lifecycle}"""


def vllm(name: str = "decode", role: str | None = None, pre_stop: str | None = None) -> str:
    """A vLLM Deployment as found in the wild: labels, a named port, a probe, maybe llm-d's role
    label on its pods and a preStop hook of its own (``pre_stop`` is the hook's flow YAML)."""
    role_line = f"        llm-d.ai/role: {role}\n" if role else ""
    lifecycle = f"          lifecycle:\n            preStop: {pre_stop}\n" if pre_stop else ""
    return VLLM_DECODE.format(name=name, role=role_line, lifecycle=lifecycle)


def injected_spec(text: str, options: Options | None = None) -> tuple[dict[str, Any], list[str]]:
    out, report = inject_text(text, options or defaults())
    validate(out)
    return pod_spec(only(out)), report.notes


@pytest.mark.parametrize(
    ("hook", "after", "wait"),
    [
        pytest.param(
            "{exec: {command: [sleep, '10']}}", {"exec": {"command": ["sleep", "30"]}}, 30
        ),
        pytest.param(
            "{exec: {command: [/bin/sh, -c, 'sleep 10']}}",
            {"exec": {"command": ["/bin/sh", "-c", "sleep 30"]}},
            30,
            id="sh -c sleep 10",
        ),
        pytest.param("{sleep: {seconds: 10}}", {"sleep": {"seconds": 30}}, 30, id="built-in"),
        pytest.param("{exec: {command: [sleep, 1m]}}", None, 60, id="sleep 1m: kept"),
        pytest.param("{sleep: {seconds: 90}}", None, 90, id="built-in 90: kept"),
    ],
)
def test_an_engine_wait_of_its_own_becomes_one_wait_of_the_longer(
    hook: str, after: dict[str, Any] | None, wait: int
) -> None:
    """A wait asks only that the engine serve that long after deletion, as the sidecar's does:
    one wait of the longer satisfies both, in the form the engine had (the built-in sleep needs
    no binary in the image)."""
    spec, notes = injected_spec(vllm(pre_stop=hook))
    engine = container(spec, "vllm")
    assert engine["lifecycle"]["preStop"] == (after or yaml.safe_load(hook))
    assert spec["terminationGracePeriodSeconds"] == wait + 30 + ENGINE_EXIT_S
    (note,) = notes
    assert note.startswith("Deployment/decode: engine container 'vllm': its preStop ")
    assert ("is kept: it covers the sidecar's 30 s drain" in note) == (after is None)


def test_an_engine_command_of_its_own_runs_after_the_wait_and_the_grace_counts_it() -> None:
    hook = "{exec: {command: [/bin/sh, -c, 'curl -fsS -X POST localhost:8000/v1/drain']}}"
    options = dataclasses.replace(defaults(), engine_prestop_s=20)
    spec, notes = injected_spec(vllm(pre_stop=hook), options)
    command = container(spec, "vllm")["lifecycle"]["preStop"]["exec"]["command"]
    assert command == [
        "sh",
        "-c",
        'sleep 30; exec "$@"',
        "engine-prestop",
        "/bin/sh",
        "-c",
        "curl -fsS -X POST localhost:8200/v1/drain",  # the engine's new port
    ]
    # The wait, the command's 20 s, then the sidecar's drain and the engine's exit.
    assert spec["terminationGracePeriodSeconds"] == 30 + 20 + 30 + ENGINE_EXIT_S
    (note,) = notes
    assert "keeps its preStop command (exec: [/bin/sh, -c, curl" in note
    assert "the grace period counts 20 s for it (--engine-prestop-s" in note
    assert "its loopback calls to port 8000, the sidecar's now, go to 8200" in note
    assert "it names port 8000" not in note


def test_an_engine_command_is_counted_10_s_unless_told_and_the_note_says_so() -> None:
    hook = "{exec: {command: [/usr/bin/flush-kv]}}"
    spec, notes = injected_spec(vllm(pre_stop=hook))
    assert spec["terminationGracePeriodSeconds"] == 30 + 10 + 30 + ENGINE_EXIT_S
    (note,) = notes
    assert "the grace period counts 10 s for it (--engine-prestop-s, 10 s unless given" in note


@pytest.mark.parametrize(
    ("script", "after"),
    [
        (
            "curl http://127.0.0.1:8000/drain && curl http://[::1]:8000/x",
            "curl http://127.0.0.1:8200/drain && curl http://[::1]:8200/x",
        ),
        ("wget -q localhost:80001/x", "wget -q localhost:80001/x"),  # another port
    ],
)
def test_loopback_calls_to_the_serving_port_follow_the_engine(script: str, after: str) -> None:
    hook = yaml.safe_dump({"exec": {"command": ["sh", "-c", script]}}, default_flow_style=True)
    spec, _ = injected_spec(vllm(pre_stop=hook.strip()))
    assert container(spec, "vllm")["lifecycle"]["preStop"]["exec"]["command"][-1] == after


def test_another_host_on_the_serving_port_is_left_as_written_with_a_warning() -> None:
    hook = "{exec: {command: [sh, -c, 'curl decode-svc:8000/drain']}}"
    spec, notes = injected_spec(vllm(pre_stop=hook))
    command = container(spec, "vllm")["lifecycle"]["preStop"]["exec"]["command"]
    assert command[-1] == "curl decode-svc:8000/drain"
    (note,) = notes
    assert "it names port 8000, the sidecar's now: the engine listens on 8200" in note
    assert "loopback calls" not in note


def test_the_composed_hook_runs_the_engine_command_exactly_as_written(tmp_path: Path) -> None:
    """Run by a real shell: the wait first, then the command, its arguments untouched (spaces,
    quotes, $), its exit status kept (the kubelet records a failed hook)."""
    out_file = tmp_path / "ran"
    argv = ["sh", "-c", 'printf "%s|" "$@" > "$0"; exit 3', str(out_file), "a b", "'q'", "$HOME"]
    hook = yaml.safe_dump({"exec": {"command": argv}}, default_flow_style=True).strip()
    options = dataclasses.replace(defaults(), drain_s=0)  # no time waited in a test
    spec, _ = injected_spec(vllm(pre_stop=hook), options)
    command = container(spec, "vllm")["lifecycle"]["preStop"]["exec"]["command"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=10)
    assert done.returncode == 3
    assert out_file.read_text() == "a b|'q'|$HOME|"


@pytest.mark.system
def test_the_cli_says_what_became_of_the_engine_hook(tmp_path: Path) -> None:
    source = tmp_path / "decode.yaml"
    source.write_text(vllm(pre_stop="{exec: {command: [sleep, '10']}}"))
    result = cli("-f", str(source), "--drain-s", "20")
    assert result.returncode == 0, result.stderr
    assert (
        "python -m sidecar.inject: Deployment/decode: engine container 'vllm': its preStop "
        "exec: [sleep, 10] now waits 20 s, the sidecar's drain (--drain-s)\n" in result.stderr
    )
    spec = pod_spec(only(result.stdout))
    assert spec["terminationGracePeriodSeconds"] == 20 + 20 + ENGINE_EXIT_S
    bad = cli("-f", str(source), "--engine-prestop-s", "-1")
    assert bad.returncode == 2


def test_with_role_labels_only_the_decode_workloads_are_injected() -> None:
    prefill = vllm("prefill", role="prefill")
    service = SERVICE
    text = vllm("decode", role="decode") + "---\n" + prefill + "---\n" + service
    out, report = inject_text(text, defaults())
    validate(out)
    docs = [d for d in yaml.safe_load_all(out) if d]
    assert [d["metadata"]["name"] for d in docs] == ["decode", "prefill", "decode"]
    assert "initContainers" in pod_spec(docs[0])
    assert "---\n" + prefill + "---\n" + service in out, "the prefill one, byte for byte"
    assert report.injected == ["Deployment/decode"]
    assert report.skipped == [
        "Deployment/prefill: skipped: its pods are labelled llm-d.ai/role=prefill; only decode, "
        "both, prefill-decode pods get the sidecar (--name prefill injects it)"
    ]


@pytest.mark.parametrize("role", ["decode", "both", "prefill-decode"])
def test_every_role_that_serves_decode_is_injected(role: str) -> None:
    text = vllm("a", role=role) + "---\n" + vllm("b", role="prefill")
    assert inject_text(text, defaults())[1].injected == ["Deployment/a"]


def test_an_unlabelled_workload_among_labelled_ones_is_skipped() -> None:
    redis = deployment().replace("name: decode", "name: redis")
    text = vllm("decode", role="decode") + "---\n" + redis
    _, report = inject_text(text, defaults())
    assert report.injected == ["Deployment/decode"]
    assert report.skipped == [
        "Deployment/redis: skipped: no llm-d.ai/role label, while other workloads of the input "
        "have one (--name redis injects it)"
    ]


def test_the_role_label_on_the_workload_counts_when_its_pods_have_none() -> None:
    prefill = vllm("prefill").replace(
        "    app.kubernetes.io/name: llama\n",
        "    app.kubernetes.io/name: llama\n    llm-d.ai/role: prefill\n",
    )
    _, report = inject_text(vllm("decode", role="decode") + "---\n" + prefill, defaults())
    assert report.injected == ["Deployment/decode"]
    assert [line.split(":")[0] for line in report.skipped] == ["Deployment/prefill"]


def test_name_wins_over_the_role_label_and_says_so() -> None:
    text = vllm("decode", role="decode") + "---\n" + vllm("prefill", role="prefill")
    _, report = inject_text(text, defaults(), ["prefill"])
    assert report.injected == ["Deployment/prefill"]
    assert report.skipped == ["Deployment/decode: skipped: not named by --name"]
    assert report.notes == [
        "Deployment/prefill: injected although labelled llm-d.ai/role=prefill: --name names it"
    ]


def test_nothing_to_inject_when_every_workload_is_skipped() -> None:
    with pytest.raises(InjectError) as caught:
        inject_text(vllm("prefill", role="prefill"), defaults())
    assert str(caught.value) == (
        "nothing to inject: Deployment/prefill: skipped: its pods are labelled "
        "llm-d.ai/role=prefill; only decode, both, prefill-decode pods get the sidecar "
        "(--name prefill injects it)"
    )


def test_several_unlabelled_workloads_are_injected_with_a_warning() -> None:
    """No role label anywhere: every workload, as before, but not without a word."""
    text = vllm("decode") + "---\n" + vllm("prefill")
    _, report = inject_text(text, defaults())
    assert report.injected == ["Deployment/decode", "Deployment/prefill"]
    assert report.notes == [
        "injected 2 workloads (Deployment/decode, Deployment/prefill), none labelled "
        "llm-d.ai/role: if one of them is a prefill workload, name the decode ones with --name"
    ]
    assert inject_text(vllm("decode"), defaults())[1].notes == [], "one: nothing to say"


LWS = """\
apiVersion: leaderworkerset.x-k8s.io/v1
kind: LeaderWorkerSet
metadata:
  name: decode-wide
spec:
  leaderWorkerTemplate:
    size: 2
    workerTemplate:
      metadata:
        labels: {llm-d.ai/role: decode}
      spec:
        containers:
          - name: vllm
            image: vllm/vllm-openai:v0.32.0
            args: ["--port", "8000"]
"""


def test_a_leaderworkerset_is_skipped_with_what_to_do() -> None:
    text = LWS + "---\n" + vllm("decode", role="decode")
    out, report = inject_text(text, defaults())
    assert out.startswith(LWS + "---\n")
    assert report.injected == ["Deployment/decode"]
    assert report.skipped == [
        "LeaderWorkerSet/decode-wide: skipped: its leader and worker pod templates are not "
        "injected: add the sidecar to the leader's template by hand (docs/deploy.md)"
    ]
    with pytest.raises(InjectError, match="nothing to inject: LeaderWorkerSet/decode-wide"):
        inject_text(LWS, defaults())


@pytest.mark.system
def test_cli_names_the_skipped_objects_on_stderr(tmp_path: Path) -> None:
    source = tmp_path / "pd.yaml"
    source.write_text(vllm("decode", role="decode") + "---\n" + vllm("prefill", role="prefill"))
    result = cli("-f", str(source), "--inference-pool", "llm/pool")
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines()[0] == (
        "python -m sidecar.inject: Deployment/prefill: skipped: its pods are labelled "
        "llm-d.ai/role=prefill; only decode, both, prefill-decode pods get the sidecar "
        "(--name prefill injects it)"
    )
    only_prefill = cli("--name", "nothing", stdin=source.read_text())
    assert only_prefill.returncode == 2


def test_settings_options_and_env_reach_the_sidecar_and_are_valid() -> None:
    options = dataclasses.replace(
        defaults(),
        env=(
            ("SIDECAR_CONNECTOR", "sglang"),
            ("SIDECAR_PREFILL_ENDPOINTS", "127.0.0.5:8000,127.0.0.6:8000#9000"),
            ("SIDECAR_LOG_REQUESTS", "true"),
            ("SIDECAR_HOST", "::"),
            ("OTEL_SERVICE_NAME", "decode"),
        ),
    )
    spec = pod_spec(only(inject(deployment(), options)))
    env = sidecar_env(spec)
    assert env["OTEL_SERVICE_NAME"] == "decode"
    names = [item["name"] for item in spec["initContainers"][0]["env"]]
    assert names.count("SIDECAR_HOST") == 1, "replaced, not repeated"
    settings = settings_of(spec)
    assert settings.connector == "sglang"
    assert [str(e.host) for e in settings.prefill_endpoints] == ["127.0.0.5", "127.0.0.6"]
    assert settings.prefill_endpoints[1].bootstrap_port == 9000
    assert settings.log_requests is True
    assert settings.host == ("::",)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        pytest.param(
            (("SIDECAR_PREFIL_DNS", "prefill:8000"),),
            "SIDECAR_PREFIL_DNS is not a setting of the sidecar; did you mean SIDECAR_PREFILL_DNS?",
            id="a typo",
        ),
        pytest.param(
            (("SIDECAR_CONNECTOR", "nixl3"),),
            "invalid configuration: SIDECAR_CONNECTOR: Input should be 'nixl', 'nixl-push', "
            "'sglang' or 'shared-storage'",
            id="a bad value",
        ),
        pytest.param(
            (("SIDECAR_DECODE_URLS", "http://127.0.0.1:8200,http://127.0.0.1:8201"),),
            None,
            id="ranks: fine with the default engine port",
        ),
        pytest.param(
            (("SIDECAR_INFERENCE_POOL", "Pool"),),
            "SIDECAR_INFERENCE_POOL: 'Pool': expected namespace/name",
            id="not namespace/name",
        ),
    ],
)
def test_env_is_checked_as_the_sidecar_checks_it(
    env: tuple[tuple[str, str], ...], message: str | None
) -> None:
    options = dataclasses.replace(defaults(), env=env)
    if message is None:
        inject(deployment(), options)
        return
    with pytest.raises(EnvError) as caught:
        inject(deployment(), options)
    assert message in str(caught.value)


def test_ranks_with_another_engine_port_are_refused_before_any_pod_sees_them() -> None:
    options = dataclasses.replace(
        defaults(), engine_port=9000, env=(("SIDECAR_DECODE_URLS", "http://127.0.0.1:9000"),)
    )
    with pytest.raises(EnvError, match="SIDECAR_DECODE_URL and SIDECAR_DECODE_URLS are both set"):
        inject(deployment(), options)


@pytest.mark.system
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--env", "SIDECAR_PORT=9000"],
            "--env SIDECAR_PORT: the command sets it; use --sidecar-port",
        ),
        (["--env", "SIDECAR_DRAIN_TIMEOUT_S=5"], "use --drain-s"),
        (["--env", "NOEQUALS"], "--env 'NOEQUALS': expected NAME=VALUE"),
        (
            ["--connector", "sglang", "--env", "SIDECAR_CONNECTOR=nixl"],
            "SIDECAR_CONNECTOR is given twice (by --connector and --env)",
        ),
        (["--env", "SIDECAR_LOG_LEVL=DEBUG"], "did you mean SIDECAR_LOG_LEVEL?"),
        (["--prefill-endpoints", "not a host"], "invalid configuration: SIDECAR_PREFILL_ENDPOINTS"),
    ],
)
def test_cli_refuses_settings_the_sidecar_would_refuse(args: list[str], message: str) -> None:
    result = cli(*args, stdin=deployment())
    assert result.returncode == 2
    assert result.stdout == ""
    assert message in result.stderr


@pytest.mark.system
def test_cli_settings_options_and_not_the_injectors_own_environment() -> None:
    """The check reads the values given, never the environment the command runs in."""
    polluted = {**os.environ, "SIDECAR_CONNECTOR": "bogus", "SIDECAR_PORT": "x"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "sidecar.inject",
            "--connector",
            "nixlv2",
            "--prefill-dns",
            "prefill:8000",
            "--inference-pool",
            "llm/decode-pool",
            "--env",
            "SIDECAR_LOG_LEVEL=debug",
        ],
        input=deployment(),
        capture_output=True,
        text=True,
        timeout=30,
        env=polluted,
    )
    assert result.returncode == 0, result.stderr
    env = sidecar_env(pod_spec(only(result.stdout)))
    assert env["SIDECAR_CONNECTOR"] == "nixlv2"
    assert env["SIDECAR_PREFILL_DNS"] == "prefill:8000"
    assert env["SIDECAR_INFERENCE_POOL"] == "llm/decode-pool"
    assert env["SIDECAR_LOG_LEVEL"] == "debug"
    assert "any prefill server a request header names" not in result.stderr, "a pool restricts"
    assert "needs get, list and watch on inferencepools and pods" in result.stderr


@pytest.mark.system
def test_help_names_the_command_as_it_was_typed() -> None:
    module = cli("--help")
    assert module.stdout.startswith("usage: python -m sidecar.inject ")
    assert "  python -m sidecar.inject -f decode.yaml | kubectl apply -f -" in module.stdout
    # What the console script does: its own path as argv[0], then main() (run from this tree).
    script = (
        "import sys; sys.argv[0] = '/usr/local/bin/pd-sidecar-inject'; "
        "from sidecar.inject.__main__ import main; main()"
    )
    for args, stream in ((["--help"], "stdout"), (["--drain-s", "-1"], "stderr")):
        run = subprocess.run(
            [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=30
        )
        assert getattr(run, stream).startswith("usage: pd-sidecar-inject "), run
    refused = subprocess.run(
        [sys.executable, "-c", script],
        input=deployment('          args: ["--port", "9000"]\n'),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert refused.stderr.startswith("pd-sidecar-inject: Deployment/decode: no container serves")
