"""deploy/kubernetes/ holds manifests a cluster accepts, that start the gateway as it really is.

Offline schema checks (kubernetes-validate ships the Kubernetes JSON schemas; strict mode
refuses unknown fields), then what a schema cannot see: the flags exist, the ports agree, the
probes hit routes that answer what each probe needs, the grace period covers the drain, and the
kustomization applies every manifest (built with `kubectl kustomize` where kubectl is installed).
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Any

import httpx
import kubernetes_validate
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from loragate.cli import app as cli_app
from loragate.engine_flags import check_engine_args
from loragate.gateway.app import create_app
from loragate.settings import Settings
from tests.backend_double import (
    ManagedBackendDouble,
    ProxiedBackend,
    adapter_stats,
    engine_snapshot,
    settings_for,
)
from tools.bench.fake_engine import FakeEngine, start_server

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "deploy" / "kubernetes"
KUSTOMIZATION = MANIFESTS / "kustomization.yaml"
# The oldest Kubernetes release still commonly run, and the newest the package ships.
KUBERNETES_VERSIONS = ("1.30", kubernetes_validate.latest_version())
POD_IP = "http://10.1.2.3:8000"  # kubelet probes address the pod by IP


def manifest_files() -> list[Path]:
    return sorted(p for p in MANIFESTS.glob("*.yaml") if p != KUSTOMIZATION)


def resources() -> list[dict[str, Any]]:
    return [doc for path in manifest_files() for doc in yaml.safe_load_all(path.read_text()) if doc]


def only(kind: str) -> dict[str, Any]:
    found = [doc for doc in resources() if doc["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def pod_spec() -> dict[str, Any]:
    spec: dict[str, Any] = only("Deployment")["spec"]["template"]["spec"]
    return spec


def gateway_container() -> dict[str, Any]:
    containers = pod_spec()["containers"]
    assert len(containers) == 1
    container: dict[str, Any] = containers[0]
    return container


def serve_args() -> tuple[list[str], list[str]]:
    """The container's `gateway serve` arguments: loragate's own, and the engine's after `--`."""
    args: list[str] = gateway_container()["args"]
    assert args[0] == "serve", "the image's ENTRYPOINT is `gateway`; args start with `serve`"
    if "--" in args:
        split = args.index("--")
        return args[1:split], args[split + 1 :]
    return args[1:], []


def arg_value(flag: str) -> str:
    own, _ = serve_args()
    assert flag in own, f"the Deployment does not pass {flag}"
    return own[own.index(flag) + 1]


def env_value(name: str) -> str | None:
    for entry in gateway_container().get("env", []):
        if entry["name"] == name:
            value: str = entry["value"]
            return value
    return None


def container_port(name_or_number: str | int) -> int:
    for port in gateway_container()["ports"]:
        if name_or_number in (port.get("name"), port["containerPort"]):
            number: int = port["containerPort"]
            return number
    raise AssertionError(f"the container has no port {name_or_number!r}")


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the schema check tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


# ----- schemas -------------------------------------------------------------------------------


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: p.name)
def test_every_manifest_validates_offline_against_the_kubernetes_schemas(
    no_network: None, path: Path, version: str
) -> None:
    docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    assert docs, f"{path.name} holds no resource"
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = "/".join(str(part) for part in exc.path)
            pytest.fail(
                f"{path.name} ({doc['kind']}), Kubernetes {version}: {where}: {exc.message}"
            )


def test_strict_validation_refuses_a_misspelled_field(no_network: None) -> None:
    deployment = only("Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[0], strict=True)


def test_the_kustomization_applies_every_manifest_but_the_examples() -> None:
    kustomization = yaml.safe_load(KUSTOMIZATION.read_text())
    listed = kustomization["resources"]
    assert len(listed) == len(set(listed))
    examples = {p.name for p in manifest_files() if p.name.endswith(".example.yaml")}
    applied = {p.name for p in manifest_files()} - examples
    assert set(listed) == applied
    # An example Secret applied by `kubectl apply -k` would guard the admin API with a
    # placeholder key; the README has the user create the real one.
    assert examples == {"secret.example.yaml"}


def test_kustomize_builds_what_the_kustomization_lists() -> None:
    """`kubectl kustomize` (offline) accepts the kustomization and builds valid resources."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    built = subprocess.run(
        [kubectl, "kustomize", str(MANIFESTS)], capture_output=True, text=True, timeout=60
    )
    assert built.returncode == 0, built.stderr
    docs = [doc for doc in yaml.safe_load_all(built.stdout) if doc]
    listed = yaml.safe_load(KUSTOMIZATION.read_text())["resources"]
    expected = [
        doc for name in listed for doc in yaml.safe_load_all((MANIFESTS / name).read_text()) if doc
    ]
    names = sorted((doc["kind"], doc["metadata"]["name"]) for doc in docs)
    assert names == sorted((doc["kind"], doc["metadata"]["name"]) for doc in expected)
    for doc in docs:
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "loragate"
        kubernetes_validate.validate(doc, KUBERNETES_VERSIONS[0], strict=True)


# ----- the command line ----------------------------------------------------------------------


def test_every_flag_the_deployment_passes_is_a_gateway_serve_option() -> None:
    result = CliRunner().invoke(cli_app, ["serve", "--help"], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    own, _ = serve_args()
    flags = [arg.split("=", 1)[0] for arg in own if arg.startswith("--")]
    assert flags
    missing = [
        f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", result.output)
    ]
    assert not missing, f"not options of `gateway serve`: {missing}"


def test_the_engine_flags_after_the_separator_are_not_loragates_own() -> None:
    _, engine = serve_args()
    check_engine_args(engine)  # raises with the option to use instead


def test_every_loragate_env_var_names_a_setting() -> None:
    names = [entry["name"] for entry in gateway_container().get("env", [])]
    settings = [name for name in names if name.startswith("LORAGATE_")]
    assert "LORAGATE_ADMIN_KEY" in settings
    unknown = [
        n for n in settings if n.removeprefix("LORAGATE_").lower() not in Settings.model_fields
    ]
    assert not unknown, f"no such setting: {unknown}"


def test_the_admin_key_comes_from_the_secret() -> None:
    (entry,) = [e for e in gateway_container()["env"] if e["name"] == "LORAGATE_ADMIN_KEY"]
    assert "value" not in entry
    assert entry["valueFrom"]["secretKeyRef"] == {"name": "loragate-keys", "key": "admin-key"}
    secret = only("Secret")
    assert secret["metadata"]["name"] == "loragate-keys"
    assert "REPLACE-ME" in secret["stringData"]["admin-key"]


# ----- ports, volumes, files -----------------------------------------------------------------


def test_the_container_port_is_the_served_port_and_the_service_target() -> None:
    port = int(arg_value("--port"))
    assert container_port("http") == port
    (service_port,) = only("Service")["spec"]["ports"]
    assert container_port(service_port["targetPort"]) == port
    assert service_port["port"] == 8000


def test_the_service_and_the_budget_select_the_deployments_pods() -> None:
    labels = only("Deployment")["spec"]["template"]["metadata"]["labels"]
    for selector in (
        only("Service")["spec"]["selector"],
        only("PodDisruptionBudget")["spec"]["selector"]["matchLabels"],
        only("Deployment")["spec"]["selector"]["matchLabels"],
    ):
        assert selector.items() <= labels.items()


def mounted_volume(path: str) -> tuple[dict[str, Any], str]:
    """The pod volume that holds ``path`` (the deepest mount), and the path inside it."""
    mounts = [
        m
        for m in gateway_container()["volumeMounts"]
        if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")
    ]
    assert mounts, f"nothing is mounted at {path}"
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    (volume,) = [v for v in pod_spec()["volumes"] if v["name"] == mount["name"]]
    return volume, path.removeprefix(mount["mountPath"].rstrip("/") + "/")


def test_the_files_the_gateway_is_given_are_mounted_from_their_sources() -> None:
    cache, _ = mounted_volume(arg_value("--cache-dir"))
    assert "emptyDir" in cache
    models, _ = mounted_volume(arg_value("--model"))
    assert "persistentVolumeClaim" in models

    keys, key_file = mounted_volume(arg_value("--api-key-file"))
    assert keys["secret"]["secretName"] == "loragate-keys"
    assert key_file in [item["path"] for item in keys["secret"]["items"]]

    manifest, manifest_file = mounted_volume(arg_value("--adapters-manifest"))
    configmap = only("ConfigMap")
    assert manifest["configMap"]["name"] == configmap["metadata"]["name"]
    assert manifest_file in configmap["data"]


def test_the_example_adapters_manifest_has_the_manifest_shape() -> None:
    data = yaml.safe_load(only("ConfigMap")["data"]["adapters.yaml"])
    assert set(data) == {"adapters"}
    assert data["adapters"]
    for name, entry in data["adapters"].items():
        assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name), name
        assert isinstance(entry["source"], str)
        assert set(entry) <= {"source", "revision", "follow"}


# ----- probes and shutdown -------------------------------------------------------------------


class BootingBackend(ManagedBackendDouble):
    """The managed backend as the probes see it while its engine boots, then once it serves."""

    engine_serving = False

    def health(self) -> tuple[bool, dict[str, Any]]:
        if not self.engine_serving:
            return False, {"status": "starting", "reason": "engine is starting"}
        return super().health()


async def test_liveness_holds_while_the_engine_boots_and_readiness_waits_for_it(
    tmp_path: Path,
) -> None:
    container = gateway_container()
    liveness = container["livenessProbe"]["httpGet"]
    readiness = container["readinessProbe"]["httpGet"]
    startup = container["startupProbe"]["httpGet"]
    assert startup["path"] == liveness["path"]
    for probe in (liveness, readiness, startup):
        assert container_port(probe["port"]) == int(arg_value("--port"))

    backend = BootingBackend()
    settings = settings_for(tmp_path, host=arg_value("--host"), admin_key="from-the-secret")
    app = create_app(settings, backend=backend)
    transport = httpx.ASGITransport(app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url=POD_IP) as kubelet,
    ):
        booting_live = await kubelet.get(liveness["path"])
        booting_ready = await kubelet.get(readiness["path"])
        backend.engine_serving = True
        served_live = await kubelet.get(liveness["path"])
        served_ready = await kubelet.get(readiness["path"])

    # The kubelet counts 200-399 as success and anything else as failure.
    assert booting_live.status_code == 200, "liveness must not restart a pod whose engine boots"
    assert booting_ready.status_code == 503, "readiness must keep a booting pod out of the Service"
    assert booting_ready.json()["status"] == "starting"
    assert served_live.status_code == 200
    assert served_ready.status_code == 200


def test_a_rollout_waits_long_enough_for_an_engine_boot() -> None:
    deployment = only("Deployment")["spec"]
    assert deployment["progressDeadlineSeconds"] >= 600
    rolling = deployment["strategy"]["rollingUpdate"]
    assert rolling["maxUnavailable"] == 0 or rolling["maxSurge"] == 0
    startup = gateway_container()["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120


def prestop_seconds() -> float:
    pre_stop = gateway_container()["lifecycle"]["preStop"]
    if "sleep" in pre_stop:  # the kubelet's own sleep action (Kubernetes 1.30+)
        return float(pre_stop["sleep"]["seconds"])
    command = pre_stop["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2, command
    return float(command[1])


def setting(name: str) -> float:
    """What the gateway in the pod runs with: the Deployment's env var, else the default."""
    value = env_value(f"LORAGATE_{name.upper()}")
    if value is None:
        default: float = Settings.model_fields[name].default
        return default
    return float(value)


def test_the_grace_period_covers_prestop_drain_and_engine_stop() -> None:
    grace = pod_spec()["terminationGracePeriodSeconds"]
    needed = prestop_seconds() + setting("drain_timeout") + setting("stop_timeout")
    assert prestop_seconds() >= 5, "endpoints need a few seconds to drop the pod"
    assert grace >= needed, f"terminationGracePeriodSeconds {grace} < {needed}"


# ----- the security review -------------------------------------------------------------------

DOCKERFILE = ROOT / "deploy" / "Dockerfile"


def pod_specs() -> list[tuple[str, dict[str, Any]]]:
    """Every pod template the manifests hold, by the name of the resource that holds it."""
    found = []
    for doc in resources():
        template = doc.get("spec", {}).get("template", {})
        if "spec" in template:
            found.append((f"{doc['kind']}/{doc['metadata']['name']}", template["spec"]))
    return found


def effective_security(pod: dict[str, Any], container: dict[str, Any]) -> dict[str, Any]:
    """The container's securityContext as the kubelet applies it: its own fields over the
    pod's (the fields both have)."""
    return {**pod.get("securityContext", {}), **container.get("securityContext", {})}


def test_every_pod_and_container_runs_unprivileged() -> None:
    assert pod_specs(), "no pod template found"
    for where, pod in pod_specs():
        assert "securityContext" in pod, f"{where}: the pod sets no securityContext"
        for container in pod["containers"] + pod.get("initContainers", []):
            name = f"{where}: container {container['name']}"
            assert "securityContext" in container, f"{name} sets no securityContext"
            context = effective_security(pod, container)
            assert context.get("runAsNonRoot") is True, name
            assert isinstance(context.get("runAsUser"), int) and context["runAsUser"] > 0, name
            assert context.get("allowPrivilegeEscalation") is False, name
            assert context.get("readOnlyRootFilesystem") is True, name
            assert "ALL" in context.get("capabilities", {}).get("drop", []), name
            assert context.get("seccompProfile", {}).get("type") == "RuntimeDefault", name
            assert not context.get("privileged"), name


def test_the_image_runs_as_the_user_the_pod_names() -> None:
    text = DOCKERFILE.read_text()
    users = re.findall(r"^USER\s+(\S+)", text, re.MULTILINE)
    assert users, "the image runs as root"
    uid, _, gid = users[-1].partition(":")
    context = pod_spec()["securityContext"]
    # Numeric, so that the kubelet can check runAsNonRoot against the image itself.
    assert uid == str(context["runAsUser"]) and gid == str(context["runAsGroup"])
    assert re.search(rf"useradd\b[^\n]*--uid {uid}\b", text), "the uid has no passwd entry"


def image_home() -> str:
    (home,) = re.findall(r"^ENV\s+HOME=(\S+)", DOCKERFILE.read_text(), re.MULTILINE)
    return home


def sized_volume(path: str) -> dict[str, Any]:
    volume, _ = mounted_volume(path)
    mount = [m for m in gateway_container()["volumeMounts"] if m["name"] == volume["name"]]
    assert not any(m.get("readOnly") for m in mount), f"{path} is mounted read-only"
    if "persistentVolumeClaim" in volume:
        return volume
    assert "emptyDir" in volume, f"{path} is on neither an emptyDir nor a PVC: {volume}"
    assert volume["emptyDir"].get("sizeLimit"), f"{path}'s emptyDir has no sizeLimit"
    return volume


def test_every_path_the_gateway_writes_is_a_sized_writable_volume() -> None:
    """With a read-only root filesystem, each place the gateway, vLLM and the Hugging Face
    hub write must be a volume; sized, so that a download cannot fill the node's disk."""
    hf_home = env_value("HF_HOME")
    assert hf_home, "HF_HOME is unset: hub downloads would land in the image's home"
    for path in [arg_value("--cache-dir"), hf_home, image_home(), "/tmp", "/dev/shm"]:
        sized_volume(path)
    assert mounted_volume(hf_home)[0]["name"] != mounted_volume(image_home())[0]["name"]


def test_the_pod_tolerates_gpu_nodes_and_asks_for_its_gpu() -> None:
    pod = pod_spec()
    tolerations = pod.get("tolerations", [])
    assert any(
        t["key"] == "nvidia.com/gpu" and t.get("operator") == "Exists" for t in tolerations
    ), "no toleration for the nvidia.com/gpu taint"
    resources = gateway_container()["resources"]
    # An extended resource: the request, when given, must equal the limit.
    assert resources["limits"]["nvidia.com/gpu"] >= 1
    assert (
        resources["requests"].get("nvidia.com/gpu", resources["limits"]["nvidia.com/gpu"])
        == (resources["limits"]["nvidia.com/gpu"])
    )
    affinity = pod["affinity"]["nodeAffinity"]
    terms = affinity.get("preferredDuringSchedulingIgnoredDuringExecution", [])
    keys = [e["key"] for t in terms for e in t["preference"]["matchExpressions"]]
    assert any(key.startswith("nvidia.com/gpu.") for key in keys), keys


# ----- monitoring: the ServiceMonitor and the Grafana dashboard ------------------------------

MONITORING = MANIFESTS / "monitoring"
DASHBOARD = MONITORING / "grafana-dashboard.json"
# The names a PromQL expression reads: the gateway's, the engine's (relayed) and process_*.
_METRIC_NAME = re.compile(r"\b(?:loragate_[A-Za-z0-9_]+|vllm:[A-Za-z0-9_:]+|process_[A-Za-z0-9_]+)")


def test_the_service_monitor_scrapes_the_services_http_port_at_metrics() -> None:
    docs = [d for d in yaml.safe_load_all((MONITORING / "servicemonitor.yaml").read_text()) if d]
    assert [(d["apiVersion"], d["kind"]) for d in docs] == [
        ("monitoring.coreos.com/v1", "ServiceMonitor")
    ]
    monitor, service = docs[0], only("Service")
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    port_names = {port["name"] for port in service["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["port"] in port_names and endpoint["path"] == "/metrics"
    kustomization = yaml.safe_load((MONITORING / "kustomization.yaml").read_text())
    assert kustomization["resources"] == ["servicemonitor.yaml"]
    [generator] = kustomization["configMapGenerator"]
    assert generator["files"] == [DASHBOARD.name]
    assert generator["options"]["labels"] == {"grafana_dashboard": "1"}  # Grafana's sidecar


def test_kustomize_builds_the_monitoring_kustomization() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    built = subprocess.run(
        [kubectl, "kustomize", str(MONITORING)], capture_output=True, text=True, timeout=60
    )
    assert built.returncode == 0, built.stderr
    docs = {doc["kind"]: doc for doc in yaml.safe_load_all(built.stdout) if doc}
    assert set(docs) == {"ConfigMap", "ServiceMonitor"}
    kubernetes_validate.validate(docs["ConfigMap"], KUBERNETES_VERSIONS[0], strict=True)
    assert docs["ConfigMap"]["data"][DASHBOARD.name] == DASHBOARD.read_text()


def dashboard_expressions() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    return exprs


def test_the_dashboard_shows_what_an_operator_watches() -> None:
    used = {name for expr in dashboard_expressions() for name in _METRIC_NAME.findall(expr)}
    for name in (
        "loragate_requests_total",  # requests/s and errors
        "loragate_request_duration_seconds_bucket",  # latency p50/p95
        "loragate_completion_tokens_total",  # tokens/s per model
        "loragate_prompt_tokens_total",
        "vllm:kv_cache_usage_perc",
        "loragate_engine_restarts_total",
    ):
        assert name in used, name


async def test_every_metric_the_dashboard_reads_is_in_the_gateways_scrape(
    tmp_path: Path,
) -> None:
    """The names in every panel's query exist on a real scrape of the gateway (with the
    stand-in engine's series relayed) after some traffic: a renamed series fails here."""
    fake = FakeEngine(api_key=None, models=["base"], kv_cache_usage=0.5)
    server = await start_server(fake)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    backend = ProxiedBackend(
        url, ["base"], engine=engine_snapshot(), adapters=adapter_stats(), engine_url=url
    )
    app = create_app(Settings(cache_dir=tmp_path), backend=backend)
    chat = {"model": "base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    async with (
        server,
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1"
        ) as client,
    ):
        assert (await client.post("/v1/chat/completions", json=chat)).status_code == 200
        usage = {"stream": True, "stream_options": {"include_usage": True}}
        streamed = await client.post("/v1/chat/completions", json={**chat, **usage})
        assert streamed.status_code == 200
        scrape = (await client.get("/metrics")).text
    exposed = {
        sample.name
        for family in text_string_to_metric_families(scrape)
        for sample in family.samples
    }
    used = {name for expr in dashboard_expressions() for name in _METRIC_NAME.findall(expr)}
    assert used and not used - exposed, sorted(used - exposed)
