"""manifests/: every overlay builds and validates, the component injects what the command does,
and the termination arithmetic holds in the YAML itself."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

import sidecar
from sidecar.emulator.config import config_from_args
from sidecar.inject import defaults, inject_text
from sidecar.inject.__main__ import main as inject_main
from sidecar.inject.check import check_text
from sidecar.inject.template import ENGINE_EXIT_S, grace_period_s, load
from tests.k8s import MANIFESTS, ROOT, crd_schemas, documents, kustomize, validate, yamllint
from tests.test_inject import check_termination, settings_of

COMPONENT = MANIFESTS / "components" / "pd-sidecar"
TLS_COMPONENT = MANIFESTS / "components" / "pd-sidecar-tls"
OVERLAYS = sorted(p.parent for p in (MANIFESTS / "overlays").glob("*/kustomization.yaml"))
BUILDS = [MANIFESTS / "base", *OVERLAYS]


@pytest.fixture(scope="module")
def built() -> dict[str, list[dict[str, Any]]]:
    """Every kustomization, built once for the module."""
    return {path.name: documents(kustomize(path)) for path in BUILDS}


def by_kind(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def injected(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The workloads that carry the sidecar."""
    found = []
    for doc in docs:
        template = doc.get("spec", {}).get("template", {})
        init = template.get("spec", {}).get("initContainers", [])
        if any(c["name"] == "pd-sidecar" for c in init):
            found.append(doc)
    return found


def test_the_three_overlays_exist() -> None:
    assert [p.name for p in OVERLAYS] == ["emulated", "gateway", "standalone"]


@pytest.mark.parametrize("path", BUILDS, ids=lambda p: p.name)
def test_every_build_validates(path: Path) -> None:
    validate(kustomize(path))


def _quantity_mib(value: str) -> float:
    units = {"Ki": 1 / 1024, "Mi": 1.0, "Gi": 1024.0}
    return float(value[:-2]) * units[value[-2:]]


@pytest.mark.parametrize("name", ["base", "emulated", "gateway", "standalone"])
def test_the_sidecar_runs_restricted_with_resources(built: dict, name: str) -> None:
    """The container meets Pod Security's "restricted" profile on its own (non-root as the
    image's user, no privilege escalation, every capability dropped, the runtime's seccomp
    profile) with a read-only root filesystem, and asks for resources: requests for CPU and
    memory, a memory limit above the request, no CPU limit (throttling would be latency)."""
    spec = by_kind(built[name], "Deployment", "decode")["spec"]["template"]["spec"]
    (container,) = [c for c in spec["initContainers"] if c["name"] == "pd-sidecar"]
    security = container["securityContext"]
    assert security["runAsNonRoot"] is True
    image_user = re.search(r"^USER (\d+):(\d+)$", (ROOT / "Dockerfile").read_text(), re.M)
    assert image_user is not None
    assert (security["runAsUser"], security["runAsGroup"]) == tuple(map(int, image_user.groups()))
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert security["capabilities"]["drop"] == ["ALL"]
    assert "add" not in security["capabilities"]
    assert security["seccompProfile"]["type"] == "RuntimeDefault"
    assert not security.get("privileged", False)
    resources = container["resources"]
    assert set(resources["requests"]) == {"cpu", "memory"}
    assert set(resources["limits"]) == {"memory"}
    request, limit = resources["requests"]["memory"], resources["limits"]["memory"]
    assert _quantity_mib(limit) > _quantity_mib(request) >= 128  # peak RSS measured ~100 MiB


@pytest.mark.parametrize("name", ["base", "emulated", "gateway", "standalone"])
def test_the_decode_pods_carry_the_sidecar_and_only_they(built: dict, name: str) -> None:
    docs = built[name]
    assert [d["metadata"]["name"] for d in injected(docs)] == ["decode"]
    spec = by_kind(docs, "Deployment", "decode")["spec"]["template"]["spec"]
    check_termination(spec)  # grace >= preStop wait + drain + 5, preStop wait >= drain
    settings = settings_of(spec)  # every SIDECAR_* variable exists and is valid
    assert settings.decode_url == "http://127.0.0.1:8200"
    # Both families: on an IPv6-primary cluster the kubelet probes the pod's IPv6 address.
    assert settings.host == ("0.0.0.0", "::")
    engine_ports = {p["containerPort"] for p in spec["containers"][0]["ports"]}
    assert 8200 in engine_ports
    assert 8000 not in engine_ports
    service = by_kind(docs, "Service", "decode")
    (port,) = service["spec"]["ports"]
    sidecar_ports = {p["name"]: p["containerPort"] for p in spec["initContainers"][0]["ports"]}
    assert sidecar_ports[port["targetPort"]] == settings.port


def test_standalone_schedules_over_dns_with_redis(built: dict) -> None:
    docs = built["standalone"]
    spec = by_kind(docs, "Deployment", "decode")["spec"]["template"]["spec"]
    settings = settings_of(spec)
    assert settings.state_backend == "redis"
    assert settings.prefill_dns is not None
    prefill = by_kind(docs, "Service", settings.prefill_dns.host)
    assert prefill["spec"]["clusterIP"] == "None"
    assert prefill["spec"]["ports"][0]["port"] == settings.prefill_dns.port
    redis_url = settings.redis_url.get_secret_value()
    match = re.fullmatch(r"redis://([\w-]+):(\d+)/0", redis_url)
    assert match, redis_url
    redis = by_kind(docs, "Service", match.group(1))
    assert redis["spec"]["ports"][0]["port"] == int(match.group(2))


def test_gateway_allows_the_pods_of_its_inference_pool_and_pools_both_roles(built: dict) -> None:
    docs = built["gateway"]
    decode = by_kind(docs, "Deployment", "decode")
    settings = settings_of(decode["spec"]["template"]["spec"])
    assert settings.inference_pool == f"{decode['metadata']['namespace']}/pd-llm"
    assert not settings.prefill_allowed_cidrs  # the pool's pods, and nothing else
    assert settings.prefill_dns is None
    assert not settings.prefill_endpoints
    pool = by_kind(docs, "InferencePool", "pd-llm")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["metadata"]["namespace"] == decode["metadata"]["namespace"]
    selector = pool["spec"]["selector"]["matchLabels"]
    for name, role in (("decode", "decode"), ("prefill", "prefill")):
        labels = by_kind(docs, "Deployment", name)["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items()
        assert labels["llm-d.ai/role"] == role
    assert pool["spec"]["targetPorts"] == [{"number": settings.port}]


def test_gateway_grants_its_sidecars_what_following_the_pool_needs(built: dict) -> None:
    """The decode pods' ServiceAccount is bound to a Role that may get, list and watch
    InferencePools (both API groups) and pods, in the pool's namespace."""
    docs = built["gateway"]
    decode = by_kind(docs, "Deployment", "decode")
    namespace = decode["metadata"]["namespace"]
    account = decode["spec"]["template"]["spec"]["serviceAccountName"]
    assert by_kind(docs, "ServiceAccount", account)["metadata"]["namespace"] == namespace
    (binding,) = [
        d
        for d in docs
        if d["kind"] == "RoleBinding"
        and {"kind": "ServiceAccount", "name": account, "namespace": namespace} in d["subjects"]
    ]
    assert binding["metadata"]["namespace"] == namespace
    assert binding["roleRef"]["kind"] == "Role"
    role = by_kind(docs, "Role", binding["roleRef"]["name"])
    assert role["metadata"]["namespace"] == namespace
    granted = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    for group, resource in (
        ("inference.networking.k8s.io", "inferencepools"),
        ("inference.networking.x-k8s.io", "inferencepools"),
        ("", "pods"),
    ):
        for verb in ("get", "list", "watch"):
            assert (group, resource, verb) in granted
    assert len(granted) == 9, "nothing more than that"
    # Only the decode pods run as it; the prefill pods need no API access.
    prefill = by_kind(docs, "Deployment", "prefill")["spec"]["template"]["spec"]
    assert "serviceAccountName" not in prefill


def _with_tls(tmp_path: Path) -> dict[str, Any]:
    """The base's decode Deployment with the TLS component after the sidecar's."""
    (tmp_path / "kustomization.yaml").write_text(
        f"resources: [{os.path.relpath(MANIFESTS / 'base', tmp_path)}]\n"
        f"components: [{os.path.relpath(TLS_COMPONENT, tmp_path)}]\n"
    )
    text = kustomize(tmp_path)
    validate(text)
    return by_kind(documents(text), "Deployment", "decode")


def test_the_tls_component_serves_https_from_a_mounted_secret(tmp_path: Path) -> None:
    decode = _with_tls(tmp_path)
    spec = decode["spec"]["template"]["spec"]
    settings = settings_of(spec)
    assert settings.tls_cert_file is not None  # SIDECAR_PORT serves HTTPS
    assert settings.admin_tls
    (sidecar,) = spec["initContainers"]
    (mount,) = sidecar["volumeMounts"]
    assert mount["readOnly"] is True
    files = [Path(str(settings.tls_cert_file)), Path(str(settings.tls_key_file))]
    assert [f.parent for f in files] == [Path(mount["mountPath"])] * 2
    assert [f.name for f in files] == ["tls.crt", "tls.key"]  # a kubernetes.io/tls Secret's keys
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["secretName"] == "pd-sidecar-tls"
    for probe in ("livenessProbe", "readinessProbe"):
        assert sidecar[probe]["httpGet"]["scheme"] == "HTTPS"
        assert sidecar[probe]["httpGet"]["port"] == settings.port


def test_the_tls_component_and_the_command_with_tls_secret_inject_the_same_pod(
    tmp_path: Path,
) -> None:
    by_component = _with_tls(tmp_path)
    source = (MANIFESTS / "base" / "decode.yaml").read_text()
    before_move = source.replace("8200", "8000").replace("name: engine", "name: http")
    options = dataclasses.replace(defaults(), tls_secret="pd-sidecar-tls")
    by_command = yaml.safe_load(inject_text(before_move, options)[0])
    assert by_command == by_component


def test_emulated_runs_the_emulator_with_flags_it_accepts(built: dict) -> None:
    docs = built["emulated"]
    image = load()["container"]["image"]
    for name in ("decode", "prefill"):
        (engine,) = by_kind(docs, "Deployment", name)["spec"]["template"]["spec"]["containers"]
        assert engine["command"] == ["python", "-m", "sidecar.emulator"]
        assert engine["image"] == image
        assert "nvidia.com/gpu" not in str(engine["resources"])
        args = [a.replace("$(POD_IP)", "10.1.2.3") for a in engine["args"]]
        config = config_from_args(args)  # the emulator's own parser: exits on an unknown flag
        port = {p["name"]: p["containerPort"] for p in engine["ports"]}
        assert config.port == (port["engine"] if name == "decode" else port["http"])
        # The kubelet probes the pod's address: an engine on loopback only would be restarted.
        assert engine["livenessProbe"]["httpGet"]["port"] == config.port
        assert config.host == "0.0.0.0,::"  # both families, as the sidecar listens
    # Its shorter drain changed all three numbers (check_termination above holds them together).
    decode = by_kind(docs, "Deployment", "decode")["spec"]["template"]["spec"]
    assert settings_of(decode).drain_timeout_s == 10
    assert decode["terminationGracePeriodSeconds"] == grace_period_s(10, 10)


# One source of truth: the component repeats sidecar/inject/sidecar.yaml.


def component_patches() -> tuple[dict[str, Any], list[dict[str, Any]]]:
    patch = yaml.safe_load((COMPONENT / "sidecar.yaml").read_text())
    json_patch = yaml.safe_load((COMPONENT / "engine-prestop.yaml").read_text())
    return patch, json_patch


def test_the_component_patch_is_the_packaged_definition() -> None:
    packaged = load()
    patch, json_patch = component_patches()
    spec = patch["spec"]["template"]["spec"]
    assert patch["spec"]["template"]["metadata"]["labels"] == packaged["podLabels"]
    assert spec["initContainers"] == [packaged["container"]]
    # The workload's own: a patch could only replace it, lowering a larger one.
    assert "terminationGracePeriodSeconds" not in spec
    assert json_patch == [
        {
            "op": "add",
            "path": "/spec/template/spec/containers/0/lifecycle",
            "value": {"preStop": packaged["enginePreStop"]},
        }
    ]


def test_the_packaged_numbers_satisfy_the_arithmetic() -> None:
    packaged = load()
    env = {e["name"]: e["value"] for e in packaged["container"]["env"]}
    drain = int(env["SIDECAR_DRAIN_TIMEOUT_S"])
    wait = int(packaged["enginePreStop"]["exec"]["command"][1])
    assert wait >= drain
    assert packaged["terminationGracePeriodSeconds"] >= wait + drain + ENGINE_EXIT_S
    assert packaged["terminationGracePeriodSeconds"] == grace_period_s(wait, drain)


def test_the_image_tag_is_the_package_version() -> None:
    assert load()["container"]["image"].endswith(f":{sidecar.__version__}")


def test_the_component_and_the_command_inject_the_same_pod() -> None:
    """The base's decode Deployment as the component leaves it, and the same Deployment with its
    engine still on 8000 after ``python -m sidecar.inject``: equal."""
    by_component = by_kind(documents(kustomize(MANIFESTS / "base")), "Deployment", "decode")
    source = (MANIFESTS / "base" / "decode.yaml").read_text()
    before_move = source.replace("8200", "8000").replace("name: engine", "name: http")
    by_command = yaml.safe_load(inject_text(before_move, defaults())[0])
    assert by_command == by_component


def test_the_images_transformer_changes_the_sidecar_image(tmp_path: Path) -> None:
    (tmp_path / "decode.yaml").write_text((MANIFESTS / "base" / "decode.yaml").read_text())
    (tmp_path / "kustomization.yaml").write_text(
        "resources: [decode.yaml]\n"
        f"components: [{os.path.relpath(COMPONENT, tmp_path)}]\n"
        "images:\n"
        "  - name: ghcr.io/pd-sidecar/pd-sidecar\n"
        "    newName: registry.example/pd-sidecar\n"
        "    newTag: dev\n"
    )
    (decode,) = documents(kustomize(tmp_path))
    spec = decode["spec"]["template"]["spec"]
    assert spec["initContainers"][0]["image"] == "registry.example/pd-sidecar:dev"
    assert spec["containers"][0]["image"].startswith("vllm/")


def test_the_component_leaves_unlabelled_workloads_alone(tmp_path: Path) -> None:
    prefill = (MANIFESTS / "prefill" / "prefill.yaml").read_text()
    (tmp_path / "prefill.yaml").write_text(prefill)
    (tmp_path / "kustomization.yaml").write_text(
        f"resources: [prefill.yaml]\ncomponents: [{os.path.relpath(COMPONENT, tmp_path)}]\n"
    )

    def key(doc: dict[str, Any]) -> tuple[str, str]:
        return doc["kind"], doc["metadata"]["name"]

    built = sorted(documents(kustomize(tmp_path)), key=key)
    assert built == sorted(documents(prefill), key=key)
    assert injected(built) == []


def test_yaml_sources_pass_yamllint() -> None:
    yamllint(MANIFESTS, ROOT / "sidecar" / "inject", ROOT / ".yamllint")


# The validation must be able to fail: a typo and a bad CRD field are caught.


def test_validation_catches_an_unknown_field() -> None:
    text = kustomize(MANIFESTS / "base").replace(
        "restartPolicy: Always", "restartPolicy: Always\n        restartPolicyy: Always"
    )
    with pytest.raises(AssertionError, match="restartPolicyy"):
        validate(text)


def test_validation_checks_crd_kinds_against_their_schema() -> None:
    pool = by_kind(
        documents(kustomize(MANIFESTS / "overlays" / "gateway")), "InferencePool", "pd-llm"
    )
    pool["spec"]["targetPorts"] = [{"number": 0}]
    pool["spec"]["selectr"] = {}
    with pytest.raises(AssertionError) as caught:
        validate(yaml.safe_dump(pool))
    assert "spec.targetPorts.0.number" in str(caught.value)
    assert "selectr" in str(caught.value)
    assert ("inference.networking.k8s.io/v1", "InferencePool") in crd_schemas()


def test_validation_refuses_a_kind_without_any_schema() -> None:
    unknown = {"apiVersion": "example.com/v1", "kind": "Gadget", "metadata": {"name": "g"}}
    with pytest.raises(AssertionError, match="Gadget"):
        validate(yaml.safe_dump(unknown))


def test_vendored_crds_are_named_in_their_readme() -> None:
    readme = (ROOT / "tests" / "crds" / "README.md").read_text()
    for path in (ROOT / "tests" / "crds").glob("*.yaml"):
        assert f"`{path.name}`" in readme, f"{path.name}: name its source and version"
    jsonschema.Draft7Validator.check_schema(
        crd_schemas()[("inference.networking.k8s.io/v1", "InferencePool")]
    )


def test_deploy_md_states_the_numbers_the_yaml_has() -> None:
    text = (ROOT / "docs" / "deploy.md").read_text()
    packaged = load()
    env = {e["name"]: e["value"] for e in packaged["container"]["env"]}
    match = re.search(r"(\d+)\s+=\s+(\d+) \+ (\d+) \+ 5", text)
    assert match, "deploy.md: the grace-period equation with numbers"
    grace, wait, drain = (int(g) for g in match.groups())
    assert grace == packaged["terminationGracePeriodSeconds"]
    assert wait == int(packaged["enginePreStop"]["exec"]["command"][1])
    assert drain == int(env["SIDECAR_DRAIN_TIMEOUT_S"])
    assert f"{ENGINE_EXIT_S} s cover" in text
    for path in [COMPONENT, TLS_COMPONENT, *BUILDS, MANIFESTS / "prefill"]:
        assert f"`{path.relative_to(ROOT)}/`" in text, path


def test_an_overlay_may_give_the_sidecar_data_parallel_ranks(tmp_path: Path) -> None:
    """The component sets no SIDECAR_DECODE_URL (its default is the engine on 8200), so an
    overlay that adds SIDECAR_DECODE_URLS gives a sidecar that starts: the two together would
    be refused (exit status 2)."""
    (tmp_path / "decode.yaml").write_text((MANIFESTS / "base" / "decode.yaml").read_text())
    (tmp_path / "ranks.yaml").write_text(
        "apiVersion: apps/v1\n"
        "kind: Deployment\n"
        "metadata: {name: decode}\n"
        "spec:\n"
        "  template:\n"
        "    spec:\n"
        "      initContainers:\n"
        "        - name: pd-sidecar\n"
        "          env:\n"
        "            - name: SIDECAR_DECODE_URLS\n"
        '              value: "http://127.0.0.1:8200,http://127.0.0.1:8201"\n'
    )
    (tmp_path / "kustomization.yaml").write_text(
        "resources: [decode.yaml]\n"
        f"components: [{os.path.relpath(COMPONENT, tmp_path)}]\n"
        "patches: [{path: ranks.yaml}]\n"
    )
    (decode,) = documents(kustomize(tmp_path))
    settings = settings_of(decode["spec"]["template"]["spec"])
    assert settings.decode_ranks == ("http://127.0.0.1:8200", "http://127.0.0.1:8201")


@pytest.mark.parametrize("path", BUILDS, ids=lambda p: p.name)
def test_every_build_passes_the_check(path: Path) -> None:
    assert check_text(kustomize(path)) == (1, [])


def test_the_check_catches_what_the_component_lets_through(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A decode Deployment whose engine still listens on --port 8000 as port http, with a grace
    period of 120 s, built with the component: kustomize accepts it; the check names the port
    both containers take, the port name both give, and the engine's --port. The component
    leaves the grace period as it was."""
    source = (MANIFESTS / "base" / "decode.yaml").read_text()
    source = source.replace("8200", "8000").replace("name: engine", "name: http")
    source = source.replace(
        "terminationGracePeriodSeconds: 65", "terminationGracePeriodSeconds: 120"
    )
    (tmp_path / "decode.yaml").write_text(source)
    (tmp_path / "kustomization.yaml").write_text(
        f"resources: [decode.yaml]\ncomponents: [{os.path.relpath(COMPONENT, tmp_path)}]\n"
    )
    built = kustomize(tmp_path)
    validate(built)  # the API's schemas see nothing wrong
    (decode,) = documents(built)
    assert decode["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 120
    checked, problems = check_text(built)
    assert checked == 1
    assert problems == [
        "Deployment/decode: containers 'vllm' and 'pd-sidecar' both declare containerPort 8000: "
        "in the pod one of them cannot bind it",
        "Deployment/decode: containers 'vllm' and 'pd-sidecar' both name a port 'http': a "
        "Service's targetPort by that name is ambiguous",
        "Deployment/decode: container 'vllm' listens on --port 8000, a port of the sidecar: move "
        "it to the port the sidecar's decode URL names (8200)",
    ]
    (tmp_path / "built.yaml").write_text(built)
    with pytest.raises(SystemExit) as exit_info:
        inject_main(["--check", "-f", str(tmp_path / "built.yaml")])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 3
    assert "both declare containerPort 8000" in err


@pytest.mark.parametrize(
    ("grace", "says"),
    [
        (None, "terminationGracePeriodSeconds 30 is shorter than the drain needs: 65"),
        (64, "terminationGracePeriodSeconds 64 is shorter than the drain needs: 65"),
        (65, None),
    ],
)
def test_the_check_wants_a_grace_period_that_covers_the_drain(grace, says) -> None:
    """The engine's preStop wait (30) + SIDECAR_DRAIN_TIMEOUT_S (30) + 5; Kubernetes' default,
    30, when the pod sets none."""
    decode = by_kind(documents(kustomize(MANIFESTS / "base")), "Deployment", "decode")
    spec = decode["spec"]["template"]["spec"]
    spec.pop("terminationGracePeriodSeconds")
    if grace is not None:
        spec["terminationGracePeriodSeconds"] = grace
    _, problems = check_text(yaml.safe_dump(decode))
    assert problems == (
        []
        if says is None
        else [
            f"Deployment/decode: {says} (the engine's "
            "preStop wait 30 s + SIDECAR_DRAIN_TIMEOUT_S 30 s + 5 s for the engine to exit)"
        ]
    )


def test_the_check_of_nothing_injected_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "prefill.yaml").write_text((MANIFESTS / "prefill" / "prefill.yaml").read_text())
    with pytest.raises(SystemExit) as exit_info:
        inject_main(["--check", "-f", str(tmp_path / "prefill.yaml")])
    assert exit_info.value.code == 1
    assert "no workload carries the sidecar" in capsys.readouterr().err
