"""Validity of everything in deploy/: Kubernetes objects against their schemas, the KubeRay
RayCluster against what KubeRay requires, the Ray cluster launcher configs against Ray's own
schema, the service configurations against cache_service.config, the Dockerfile and compose
file against the repository, Prometheus config and alert rules against promtool."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from cache_service.config import ServiceConfig, load_config

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"
# The oldest Kubernetes minor the manifests are written for (gRPC probes, appProtocol).
K8S_VERSION = "1.30"
DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def load_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def k8s_objects() -> dict[tuple[str, str], dict[str, Any]]:
    """Every object of deploy/kubernetes, keyed by (kind, name)."""
    objects = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in load_docs(path):
            if doc.get("kind") == "Kustomization":
                continue
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in objects, f"{key} defined twice"
            objects[key] = doc
    return objects


def ray_pin() -> str:
    for line in (ROOT / "requirements/constraints.txt").read_text().splitlines():
        if line.startswith("ray=="):
            return line.split("==", 1)[1].strip()
    raise AssertionError("requirements/constraints.txt pins no ray version")


# -- every file parses ------------------------------------------------------------------------


def test_every_deploy_file_parses() -> None:
    yaml_files = sorted(DEPLOY.rglob("*.yaml")) + sorted(DEPLOY.rglob("*.yml"))
    assert len(yaml_files) >= 10
    for path in yaml_files:
        docs = load_docs(path)
        assert docs, f"{path} is empty"
        assert all(isinstance(d, dict) for d in docs), path


# -- Kubernetes -----------------------------------------------------------------------------


CORE_KINDS = {"Namespace", "ConfigMap", "PersistentVolumeClaim", "Deployment", "Service"}


def test_kubernetes_core_objects_validate_against_their_schemas() -> None:
    objects = k8s_objects()
    core = {key: doc for key, doc in objects.items() if key[0] in CORE_KINDS}
    assert {kind for kind, _ in core} == CORE_KINDS
    for (kind, name), doc in core.items():
        # strict: unknown fields (typos) fail too.
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        assert DNS1035.match(name) or kind in ("ConfigMap",), (kind, name)


def test_schema_validation_can_fail() -> None:
    doc = k8s_objects()[("Deployment", "kvcache-coordinator")]
    broken = yaml.safe_load(yaml.safe_dump(doc))
    broken["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "grpc"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)
    typo = yaml.safe_load(yaml.safe_dump(doc))
    typo["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(typo, K8S_VERSION, strict=True)


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    # The ServiceMonitor needs the Prometheus Operator's CRD: applied separately.
    assert listed == files - {"servicemonitor.yaml"}
    for image in kustomization["images"]:
        assert image["name"] == "kvcache"


def _pod_template_check(template: dict[str, Any], where: str) -> None:
    kubernetes_validate.validate(
        {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": where},
            "template": template,
        },
        K8S_VERSION,
        strict=True,
    )
    assert template["spec"]["containers"], f"{where}: KubeRay needs at least one container"
    security = template["spec"]["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] != 0, where


def test_raycluster_has_what_kuberay_requires() -> None:
    cluster = k8s_objects()[("RayCluster", "kvcache")]
    assert cluster["apiVersion"] == "ray.io/v1"
    name = cluster["metadata"]["name"]
    # KubeRay's webhook: a DNS-1035 label of at most 53 characters.
    assert DNS1035.match(name) and len(name) <= 53
    spec = cluster["spec"]
    assert spec["rayVersion"] == ray_pin(), "rayVersion must match the image's Ray"
    if "authOptions" in spec:
        # KubeRay's webhook: token authentication needs Ray 2.52 or later.
        version = tuple(int(x) for x in spec["rayVersion"].split(".")[:2])
        assert version >= (2, 52) and spec["authOptions"]["mode"] in ("token", "disabled")
    head = spec["headGroupSpec"]
    groups = [("head", head)] + [(g["groupName"], g) for g in spec["workerGroupSpecs"]]
    for group_name, group in groups:
        params = group.get("rayStartParams", {})
        # The CRD types rayStartParams as map[string]string.
        assert all(isinstance(v, str) for v in params.values()), (group_name, params)
        assert "labels" not in params, "KubeRay rejects rayStartParams['labels']"
        if any(params.get(k) for k in ("num-cpus", "num-gpus", "memory", "resources")):
            assert not group.get("resources"), "resources in both rayStartParams and resources"
        _pod_template_check(group["template"], f"{name}-{group_name}")
    names = [g["groupName"] for g in spec["workerGroupSpecs"]]
    assert len(names) == len(set(names))
    gpu_groups = []
    for group in spec["workerGroupSpecs"]:
        for field in ("groupName", "minReplicas", "maxReplicas", "template"):
            assert field in group, f"worker group lacks {field} (required by the CRD)"
        assert 0 <= group["minReplicas"] <= group.get("replicas", 0) <= group["maxReplicas"]
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        if "nvidia.com/gpu" in limits:
            gpu_groups.append(group)
    assert gpu_groups, "no worker group asks for nvidia.com/gpu"


def test_coordinator_wiring() -> None:
    objects = k8s_objects()
    deployment = objects[("Deployment", "kvcache-coordinator")]
    service = objects[("Service", "kvcache-coordinator")]
    pod = deployment["spec"]["template"]
    container = pod["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}

    # The Service selects the coordinator's pods and exposes gRPC and metrics by name.
    selector = service["spec"]["selector"]
    assert selector.items() <= pod["metadata"]["labels"].items()
    assert (
        deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    )
    assert {p["targetPort"] for p in service["spec"]["ports"]} == {"grpc", "metrics"}
    assert set(ports) >= {"grpc", "metrics"}

    # Scrape annotations point at the metrics port.
    for scrape in (pod["metadata"]["annotations"], service["metadata"]["annotations"]):
        assert scrape["prometheus.io/scrape"] == "true"
        assert int(scrape["prometheus.io/port"]) == ports["metrics"]

    # A single writer on a ReadWriteOnce volume.
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    claim = volumes["metadata"]["persistentVolumeClaim"]["claimName"]
    pvc = objects[("PersistentVolumeClaim", claim)]
    assert pvc["spec"]["accessModes"] == ["ReadWriteOnce"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}

    # The configuration is a valid service config whose ports and store match the pod.
    configmap = objects[("ConfigMap", volumes["config"]["configMap"]["name"])]
    (config_name,) = configmap["data"]
    config_path = Path(mounts["config"]) / config_name
    assert str(config_path) in container["args"][0]
    config = _load_text_config(configmap["data"][config_name])
    assert config.server.port == ports["grpc"] and config.metrics.port == ports["metrics"]
    assert config.server.host == config.metrics.host == "0.0.0.0"
    assert config.store_path.startswith(mounts["metadata"] + "/")
    assert config.workers.ray_address == "auto" and config.workers.device == "cuda"

    # Probes ask the gRPC server's health service.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == ports["grpc"]

    # It joins the RayCluster through the head Service KubeRay creates, with the token of
    # the Secret KubeRay generates for it (named after the cluster unless set).
    cluster = objects[("RayCluster", "kvcache")]
    env = {e["name"]: e for e in container["env"]}
    assert env["RAY_HEAD_ADDRESS"]["value"] == f"{cluster['metadata']['name']}-head-svc:6379"
    auth = cluster["spec"]["authOptions"]
    assert auth["mode"] == "token" and env["RAY_AUTH_MODE"]["value"] == "token"
    secret = env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert secret["name"] == auth.get("secretName", cluster["metadata"]["name"])
    assert secret["key"] == "auth_token"

    # One pool per GPU of the GPU worker group.
    gpus = sum(
        g.get("replicas", 0)
        * int(g["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
        for g in cluster["spec"]["workerGroupSpecs"]
    )
    assert config.workers.num_workers == gpus


def test_servicemonitor_selects_the_metrics_port() -> None:
    (monitor,) = load_docs(K8S / "servicemonitor.yaml")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["kind"] == "ServiceMonitor"
    service = k8s_objects()[("Service", "kvcache-coordinator")]
    labels = service["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    port_names = {p["name"] for p in service["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["port"] in port_names
        assert endpoint["path"] == "/metrics"


def _load_text_config(text: str) -> ServiceConfig:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        f.write(text)
        f.flush()
        return load_config(f.name)


# -- Ray cluster launcher ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["cluster-aws.yaml", "cluster-onprem.yaml"])
def test_ray_cluster_launcher_config_validates(name: str) -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = yaml.safe_load((DEPLOY / "ray" / name).read_text())
    # Ray's own preparation (defaults of the provider) and JSON-schema validation, as
    # `ray up` runs them.
    config = prepare_config(yaml.safe_load(yaml.safe_dump(raw)))
    validate_config(config)
    for source in raw["file_mounts"].values():
        if not source.startswith("~"):  # ~: the operator's machine (the Ray token)
            assert (ROOT / source).exists(), f"file_mounts source {source} missing"
    # Every node and the coordinator run with the cluster's Ray token.
    assert raw["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    for command in raw["head_start_ray_commands"] + raw["worker_start_ray_commands"]:
        if "ray start" in command or "start-coordinator" in command:
            assert "RAY_AUTH_MODE=token" in command, command
    commands = " ".join(raw["head_start_ray_commands"])
    script = re.search(r"~/kvcache-deploy/(\S+)", commands).group(1)
    assert (DEPLOY / "ray" / script).is_file()
    if raw["provider"]["type"] != "local":
        types = raw["available_node_types"]
        assert raw["head_node_type"] in types
        assert types[raw["head_node_type"]]["resources"].get("GPU", 0) == 0
        gpu_types = [t for n, t in types.items() if t["resources"].get("GPU", 0) > 0]
        assert gpu_types
        for t in gpu_types:
            assert t["min_workers"] <= t["max_workers"] <= raw["max_workers"]


def test_ray_start_script_and_config() -> None:
    script = DEPLOY / "ray" / "start-coordinator.sh"
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)
    config = load_config(DEPLOY / "ray" / "kvcache.yaml")
    assert config.workers.ray_address == "auto" and config.workers.device == "cuda"
    assert str(config.server.port) in script.read_text()


# -- Docker ---------------------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (DEPLOY / "docker" / "Dockerfile").read_text().replace("\\\n", " ")
    instructions = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, rest = line.partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
    return instructions


def dockerignore_allows(path: str) -> bool:
    """Apply deploy/docker/Dockerfile.dockerignore (last matching rule wins)."""
    import fnmatch

    allowed = True
    for rule in (DEPLOY / "docker" / "Dockerfile.dockerignore").read_text().splitlines():
        rule = rule.strip()
        if not rule or rule.startswith("#"):
            continue
        negate = rule.startswith("!")
        pattern = rule.lstrip("!").rstrip("/")
        if fnmatch.fnmatch(path, pattern) or path.startswith(pattern + "/"):
            allowed = negate
    return allowed


def test_dockerfile_references_existing_files() -> None:
    instructions = dockerfile_instructions()
    keywords = [k for k, _ in instructions]
    froms = [rest for k, rest in instructions if k == "FROM"]
    args = dict(rest.split("=", 1) for k, rest in instructions if k == "ARG" and "=" in rest)
    base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], froms[0])
    assert base.startswith("nvidia/cuda:"), base
    copies = [shlex.split(rest) for k, rest in instructions if k == "COPY"]
    assert copies
    for parts in copies:
        sources = [p for p in parts[:-1] if not p.startswith("--")]
        for source in sources:
            assert (ROOT / source).exists(), f"COPY source {source} does not exist"
            assert dockerignore_allows(source), f"COPY source {source} is excluded"
    # Runs as a non-root user.
    users = [rest for k, rest in instructions if k == "USER"]
    assert users and users[-1] not in ("root", "0")
    assert keywords.index("USER") > max(i for i, k in enumerate(keywords) if k == "RUN")
    # The health check runs a module of the package over gRPC health.
    (health,) = [rest for k, rest in instructions if k == "HEALTHCHECK"]
    module = re.search(r'"-m",\s*"([\w.]+)"', health).group(1)
    assert (ROOT / (module.replace(".", "/") + ".py")).is_file(), module
    assert "50051" in health


def test_dockerignore_keeps_the_context_small() -> None:
    for heavy in (".venv", "tests", "benchmarks/results", ".git"):
        assert not dockerignore_allows(heavy), heavy


def test_compose_file_and_its_mounts() -> None:
    compose_path = DEPLOY / "docker" / "compose.yaml"
    compose = yaml.safe_load(compose_path.read_text())
    services = compose["services"]
    assert set(services) == {"coordinator", "prometheus", "grafana"}
    build = services["coordinator"]["build"]
    context = (compose_path.parent / build["context"]).resolve()
    assert context == ROOT
    assert (context / build["dockerfile"]).is_file()
    for name, service in services.items():
        for mount in service.get("volumes", []):
            source, target = mount.split(":")[:2]
            if source.startswith("."):
                assert (compose_path.parent / source).exists(), (name, source)
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
    coordinator = services["coordinator"]
    config_mount = next(m for m in coordinator["volumes"] if m.startswith("./"))
    source, target = config_mount.split(":")[:2]
    assert coordinator["command"][-1] == target
    config = load_config(compose_path.parent / source)
    assert config.server.host == config.metrics.host == "0.0.0.0"
    # Prometheus scrapes the coordinator's metrics port under its compose service name.
    prometheus = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    job = next(j for j in prometheus["scrape_configs"] if j["job_name"] == "kvcache")
    assert job["static_configs"][0]["targets"] == [f"coordinator:{config.metrics.port}"]
    grpc_port = int(coordinator["ports"][0].rsplit(":", 1)[1])
    assert grpc_port == config.server.port


# -- Prometheus -----------------------------------------------------------------------------


def _promtool(*args: str, cwd: Path) -> str:
    binary = shutil.which("promtool")
    assert binary, "promtool is not on PATH: run scripts/ensure-prometheus.sh"
    proc = subprocess.run(
        [binary, *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


def test_prometheus_config_and_alert_rules() -> None:
    prometheus = DEPLOY / "prometheus"
    _promtool("check", "config", "--syntax-only", "prometheus.yml", cwd=prometheus)
    out = _promtool("check", "rules", "rules/kvcache-alerts.yml", cwd=prometheus)
    assert "SUCCESS" in out
    # Unit tests of the alerts (expected labels, annotations and timing).
    _promtool("test", "rules", "kvcache-alerts.test.yml", cwd=prometheus / "rules")
