"""The Kubernetes manifests under deploy/kubernetes/, offline: every object validates against
the pinned Kubernetes versions' schemas in strict mode (kubernetes-validate; unknown fields
fail), every file belongs to a kustomization, and the objects agree with each other: a
worker group's size is its WORLD_SIZE and tp x pp, its scheduler names every rank in rank
order through the headless Service, ports agree across commands, containers, Services,
probes and network policies, the frontend names every scheduler, and every pod mounts the
model cache where the image keeps it. The commands parse with pagestream's own CLI."""

from __future__ import annotations

import copy
import re
from collections import Counter
from pathlib import Path

import pytest
import yaml
from kubernetes_validate import utils as kv

from pagestream.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
ROOT = REPO / "deploy" / "kubernetes"
LAYOUTS = {"tp2": ROOT, "dp2": ROOT / "dp2"}
# The oldest release the manifests claim (grpc probes GA since 1.27, the
# apps.kubernetes.io/pod-index label since 1.28) and the newest the package ships.
K8S_VERSIONS = ("1.30", "1.37")
KUSTOMIZATION = "kustomization.yaml"
IMAGE = "pagestream:latest"
POD_INDEX = "metadata.labels['apps.kubernetes.io/pod-index']"
ROUTER_POLICIES = ("cache_aware", "least_loaded", "round_robin")


# ---- loading -------------------------------------------------------------------------------
def manifest_files() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.yaml") if p.name != KUSTOMIZATION)


def documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def kustomization_files(directory: Path) -> list[Path]:
    """The manifest files a kustomization directory takes in, following its bases."""
    spec = yaml.safe_load((directory / KUSTOMIZATION).read_text())
    assert spec["kind"] == "Kustomization", directory
    files = []
    for entry in spec["resources"]:
        path = (directory / entry).resolve()
        assert path.exists(), f"{directory / KUSTOMIZATION}: {entry} does not exist"
        files += kustomization_files(path) if path.is_dir() else [path]
    return files


def layout(name: str) -> list[dict]:
    objects = [doc for path in kustomization_files(LAYOUTS[name]) for doc in documents(path)]
    keys = Counter((o["kind"], o["metadata"]["name"]) for o in objects)
    assert [k for k, n in keys.items() if n > 1] == [], f"{name}: objects defined twice"
    return objects


def of_kind(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def component(objects: list[dict], kind: str, name: str) -> dict[str, dict]:
    return {
        key: o
        for key, o in of_kind(objects, kind).items()
        if o["metadata"]["labels"]["app.kubernetes.io/component"] == name
    }


def container(workload: dict) -> dict:
    containers = workload["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, workload["metadata"]["name"]
    return containers[0]


def env(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


def env_value(c: dict, name: str) -> str:
    return env(c)[name]["value"]


def flag_values(argv: list[str], *names: str) -> list[str]:
    """Every value given to one of the flags `names` (space-separated form), in order."""
    return [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg in names]


def flag(argv: list[str], *names: str, default: str | None = None) -> str | None:
    values = flag_values(argv, *names)
    assert len(values) <= 1, f"{names} given twice in {argv}"
    return values[0] if values else default


def world_size(argv: list[str]) -> int:
    tp = flag(argv, "-tp", "--tensor-parallel-size", default="1")
    pp = flag(argv, "-pp", "--pipeline-parallel-size", default="1")
    return int(tp) * int(pp)


def container_ports(c: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in c["ports"]}


def probe_port(probe: dict) -> int:
    handler = probe.get("grpc") or probe.get("httpGet") or probe.get("tcpSocket")
    return handler["port"]


def probe_budget_s(probe: dict) -> int:
    return probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)


def selects(selector: dict[str, str], workload: dict) -> bool:
    labels = workload["spec"]["template"]["metadata"]["labels"]
    return all(labels.get(k) == v for k, v in selector.items())


def service_of(objects: list[dict], workload: dict) -> dict:
    """The one Service whose selector picks the workload's pods."""
    found = [
        s for s in of_kind(objects, "Service").values() if selects(s["spec"]["selector"], workload)
    ]
    assert len(found) == 1, f"{workload['metadata']['name']}: Services {found}"
    return found[0]


def service_target(service: dict, c: dict, port: int) -> int:
    """The container port a Service port forwards to (a named targetPort resolved)."""
    entry = next(p for p in service["spec"]["ports"] if p["port"] == port)
    target = entry.get("targetPort", port)
    return container_ports(c)[target] if isinstance(target, str) else target


def cache_path_of_image() -> str:
    match = re.search(r"PAGESTREAM_CACHE=(\S+)", (REPO / "Dockerfile").read_text())
    assert match, "the Dockerfile no longer sets PAGESTREAM_CACHE"
    return match.group(1)


# ---- schema validation ---------------------------------------------------------------------
def test_the_pinned_versions_have_schemas():
    shipped = {kv.major_minor(v) for v in kv.all_versions()}
    assert set(K8S_VERSIONS) <= shipped


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(ROOT)))
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_manifest_validates_strictly(path, version):
    docs = documents(path)
    assert docs, f"{path} holds no objects"
    for doc in docs:
        assert kv.validate(doc, version, strict=True) == version, kv.kn(doc)


def test_strict_validation_catches_mistakes():
    """The check above can fail: an unknown field, a wrong type, a missing required field."""
    statefulset = of_kind(layout("tp2"), "StatefulSet")["worker"]
    assert kv.validate(statefulset, K8S_VERSIONS[0], strict=True)
    typo = copy.deepcopy(statefulset)
    typo["spec"]["template"]["spec"]["container"] = typo["spec"]["template"]["spec"]["containers"]
    wrong_type = copy.deepcopy(statefulset)
    wrong_type["spec"]["replicas"] = "two"
    no_image_port = copy.deepcopy(statefulset)
    del container(no_image_port)["ports"][0]["containerPort"]
    for broken in (typo, wrong_type, no_image_port):
        with pytest.raises(kv.ValidationError):
            kv.validate(broken, K8S_VERSIONS[0], strict=True)


def test_every_manifest_belongs_to_a_kustomization():
    taken = {p for directory in LAYOUTS.values() for p in kustomization_files(directory)}
    assert taken == {p.resolve() for p in manifest_files()}


# ---- the objects agree with each other ----------------------------------------------------
@pytest.mark.parametrize("name", LAYOUTS)
def test_worker_groups(name):
    objects = layout(name)
    groups = component(objects, "StatefulSet", "worker")
    assert len(groups) == {"tp2": 1, "dp2": 2}[name]
    for group_name, group in groups.items():
        spec, c = group["spec"], container(group)
        argv = c["command"]
        assert argv[:2] == ["pagestream", "worker"]
        size = world_size(argv)
        assert spec["replicas"] == size == int(env_value(c, "WORLD_SIZE")) == 2
        assert spec["podManagementPolicy"] == "Parallel"
        assert (
            spec["selector"]["matchLabels"].items()
            <= spec["template"]["metadata"]["labels"].items()
        )
        # The headless Service the ranks are named through; rank 0 is the rendezvous.
        headless = of_kind(objects, "Service")[spec["serviceName"]]
        assert headless["spec"]["clusterIP"] == "None"
        assert headless["spec"]["publishNotReadyAddresses"] is True
        assert selects(headless["spec"]["selector"], group)
        assert service_of(objects, group) is headless
        assert env(c)["RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == POD_INDEX
        assert env_value(c, "LOCAL_RANK") == "0"
        assert env_value(c, "MASTER_ADDR") == f"{group_name}-0.{spec['serviceName']}"
        master_port = int(env_value(c, "MASTER_PORT"))
        assert master_port == container_ports(c)["rendezvous"]
        assert service_target(headless, c, master_port) == master_port
        assert env_value(c, "GLOO_SOCKET_IFNAME") == env_value(c, "NCCL_SOCKET_IFNAME") == "eth0"
        # One port, everywhere: the command, the container, the Service and the probes.
        port = int(flag(argv, "--port"))
        assert flag(argv, "--host") == "0.0.0.0"
        assert container_ports(c)["grpc"] == port
        assert service_target(headless, c, port) == port
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert "grpc" in c[probe] and probe_port(c[probe]) == port, probe
        assert c["readinessProbe"]["grpc"]["service"] == "pagestream.internal.v1.Worker"
        assert probe_budget_s(c["startupProbe"]) >= 600  # loading the model
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        volumes = {v["name"]: v for v in spec["template"]["spec"]["volumes"]}
        shm = next(m["name"] for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm")
        assert volumes[shm]["emptyDir"]["medium"] == "Memory"


@pytest.mark.parametrize("name", LAYOUTS)
def test_each_group_has_one_scheduler_naming_its_ranks_in_order(name):
    objects = layout(name)
    groups = component(objects, "StatefulSet", "worker")
    schedulers = component(objects, "Deployment", "scheduler")
    assert len(schedulers) == len(groups)
    driven = []
    for scheduler in schedulers.values():
        spec, c = scheduler["spec"], container(scheduler)
        argv = c["command"]
        assert argv[:2] == ["pagestream", "scheduler"]
        assert spec["replicas"] == 1 and spec["strategy"]["type"] == "Recreate"
        group_label = spec["template"]["metadata"]["labels"]["pagestream.io/group"]
        group = groups[group_label]
        driven.append(group_label)
        worker = container(group)
        worker_port = int(flag(worker["command"], "--port"))
        headless = group["spec"]["serviceName"]
        ranks = range(group["spec"]["replicas"])
        expected = [f"{group_label}-{rank}.{headless}:{worker_port}" for rank in ranks]
        assert flag_values(argv, "--worker") == expected
        assert world_size(argv) == world_size(worker["command"])
        # Its port: command, container, Service, probes.
        port = int(flag(argv, "--port"))
        assert flag(argv, "--host") == "0.0.0.0"
        assert container_ports(c)["grpc"] == port
        assert service_target(service_of(objects, scheduler), c, port) == port
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert "grpc" in c[probe] and probe_port(c[probe]) == port, probe
        assert c["readinessProbe"]["grpc"]["service"] == "pagestream.internal.v1.EngineCore"
        # Not restarted while its group (re)starts: it reconnects by itself.
        assert probe_budget_s(c["livenessProbe"]) >= probe_budget_s(worker["startupProbe"])
    assert sorted(driven) == sorted(groups)


@pytest.mark.parametrize("name", LAYOUTS)
def test_the_frontend_names_every_scheduler(name):
    objects = layout(name)
    (frontend,) = component(objects, "Deployment", "frontend").values()
    c = container(frontend)
    argv = c["command"]
    assert argv[:2] == ["pagestream", "frontend"]
    schedulers = component(objects, "Deployment", "scheduler").values()
    addresses = []
    for scheduler in schedulers:
        service = service_of(objects, scheduler)
        addresses.append(f"{service['metadata']['name']}:{service['spec']['ports'][0]['port']}")
    assert sorted(flag_values(argv, "--scheduler")) == sorted(addresses)
    if name == "dp2":
        assert flag_values(argv, "--scheduler") == ["scheduler-0:50062", "scheduler-1:50062"]
        assert flag(argv, "--router-policy") == "cache_aware"
    assert flag(argv, "--router-policy", default="cache_aware") in ROUTER_POLICIES
    grpc_port, http_port = int(flag(argv, "--grpc-port")), int(flag(argv, "--port"))
    assert flag(argv, "--host") == "0.0.0.0"
    assert container_ports(c) == {"grpc": grpc_port, "http": http_port}
    service = service_of(objects, frontend)
    assert service_target(service, c, grpc_port) == grpc_port
    assert service_target(service, c, http_port) == http_port
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["startupProbe"]["httpGet"]["path"] == "/health"
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert probe_port(c[probe]) == http_port, probe


@pytest.mark.parametrize("name", LAYOUTS)
def test_every_pod_runs_the_image_on_the_model_cache(name):
    objects = layout(name)
    claims = of_kind(objects, "PersistentVolumeClaim")
    (claim,) = claims
    assert "ReadWriteMany" in claims[claim]["spec"]["accessModes"]
    config = of_kind(objects, "ConfigMap")
    workloads = [
        *of_kind(objects, "StatefulSet").values(),
        *of_kind(objects, "Deployment").values(),
    ]
    assert len(workloads) == {"tp2": 3, "dp2": 5}[name]
    for workload in workloads:
        c = container(workload)
        assert c["image"] == IMAGE
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        mounted = volumes[mounts[cache_path_of_image()]]
        assert mounted["persistentVolumeClaim"]["claimName"] == claim
        # Every role loads the same model: $(MODEL) from the one ConfigMap.
        assert c["command"][2] == "$(MODEL)"
        ref = env(c)["MODEL"]["valueFrom"]["configMapKeyRef"]
        assert ref["key"] in config[ref["name"]]["data"]
    assert (
        "ReadWriteMany" in of_kind(objects, "PersistentVolumeClaim")[claim]["spec"]["accessModes"]
    )


@pytest.mark.parametrize("name", LAYOUTS)
def test_network_policies_admit_the_ports_in_use(name):
    objects = layout(name)
    policies = of_kind(objects, "NetworkPolicy")
    for role, peer in (("worker", "scheduler"), ("scheduler", "frontend")):
        policy = policies[f"pagestream-{role}"]
        kind = "StatefulSet" if role == "worker" else "Deployment"
        for workload in component(objects, kind, role).values():
            assert selects(policy["spec"]["podSelector"]["matchLabels"], workload)
            port = int(flag(container(workload)["command"], "--port"))
            rule = next(
                r
                for r in policy["spec"]["ingress"]
                if r["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == peer
            )
            assert [p["port"] for p in rule["ports"]] == [port]
    # The ranks of a group reach each other on any port (rendezvous, gloo, NCCL).
    ranks = policies["pagestream-worker"]["spec"]["ingress"]
    assert any(
        r["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "worker"
        and "ports" not in r
        for r in ranks
    )


def strict_parser():
    """pagestream's parser, with no abbreviated flags (--dist-timeou would pass otherwise)."""
    parser = build_parser()
    for action in parser._subparsers._group_actions:
        for sub in action.choices.values():
            sub.allow_abbrev = False
    return parser


def _commands() -> list[tuple[str, list[str]]]:
    out = []
    for name in LAYOUTS:
        for o in layout(name):
            if o["kind"] in ("StatefulSet", "Deployment"):
                out.append((f"{name}/{o['metadata']['name']}", container(o)["command"]))
    return out


@pytest.mark.parametrize(("where", "argv"), _commands(), ids=[w for w, _ in _commands()])
def test_commands_parse_with_the_pagestream_cli(where, argv):
    """Every flag of every command is one the role takes (the real parser, not a copy)."""
    assert argv[0] == "pagestream"
    args = [arg.replace("$(MODEL)", "/models/m") for arg in argv[1:]]
    try:
        ns = strict_parser().parse_args(args)
    except SystemExit as exc:
        pytest.fail(f"{where}: pagestream rejects {' '.join(argv)} (exit {exc.code})")
    assert ns.command == argv[1] and ns.model == "/models/m"


@pytest.mark.parametrize("name", LAYOUTS)
def test_the_frontend_requires_the_api_key(name, monkeypatch):
    """The key comes from a Secret that must exist (not optional: the pod waits for it), and
    the command, listening on 0.0.0.0, is one the frontend refuses to start without it."""
    from pagestream.start_checks import check_start

    (frontend,) = component(layout(name), "Deployment", "frontend").values()
    c = container(frontend)
    ref = env(c)["PAGESTREAM_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert ref["name"] == "pagestream-api-key" and ref["key"] == "api-key"
    assert ref.get("optional", False) is False
    argv = [arg.replace("$(MODEL)", "/models/m") for arg in c["command"][1:]]
    assert "--allow-unauthenticated" not in argv and "--api-key" not in argv
    monkeypatch.delenv("PAGESTREAM_API_KEY", raising=False)
    with pytest.raises(ValueError, match="no API key"):
        check_start(strict_parser().parse_args(argv))
    monkeypatch.setenv("PAGESTREAM_API_KEY", "from the secret")
    check_start(strict_parser().parse_args(argv))
