"""`baton planner` on Kubernetes: the planner's loop (planner/loop.py) and its Kubernetes
actuator (planner/kubernetes.py), which scales the per-role Deployments through the API
server's scale subresource.

No cluster runs here, so `FakeApiServer` stands in for one: a real HTTPS server in the test
process (a throw-away self-signed certificate, which the actuator trusts as its CA file, as it
trusts the service account's ca.crt in a pod) that implements GET/PATCH
/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale and GET .../deployments/{name} for two
Deployments, checks the Bearer token and the merge-patch content type, and records every
call. Whether Deployments settle after a patch (status following spec) is the test's to say.
The manifests' side (RBAC, names, network policy) is tests/deploy/test_manifests.py.
"""

from __future__ import annotations

import json
import re
import shutil
import ssl
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from baton.ops.registry import EngineRecord
from baton_cli.main import main
from planner.core import Decision, Split
from planner.kubernetes import (
    RBAC_RULES,
    KubeConfig,
    KubernetesActuator,
    KubernetesError,
)
from planner.loop import PlannerLoop, RegistryLoads, Unsettled

REPO = Path(__file__).resolve().parents[2]
NS = "serving"
TOKEN = "sa-token-1"
PROMPT, COMPLETION = "baton-prompt-engine", "baton-completion-engine"
_PATH = re.compile(r"^/apis/apps/v1/namespaces/([^/]+)/deployments/([^/]+)(/scale)?$")


class FakeApiServer:
    """Two Deployments' scale subresource and rollout status, over HTTPS (see the module
    docstring: it stands in for the cluster this machine lacks)."""

    def __init__(self, cert: Path, key: Path, replicas: dict[str, int]) -> None:
        self.token = TOKEN
        self.ca = cert  # self-signed: its own CA
        self.state = {name: {"spec": n, "status": n, "updated": n, "generation": 1,
                             "observed": 1, "terminating": 0} for name, n in replicas.items()}
        self.settle = True  # a patch's pods are there at once
        self.fail: dict[tuple[str, str], int] = {}  # (method, name) -> HTTP status
        self.hang_s = 0.0  # answer only after this long
        self.calls: list[dict] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                server._handle(self, "GET")

            def do_PATCH(self) -> None:  # noqa: N802
                server._handle(self, "PATCH")

            def log_message(self, *_args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)
        self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)
        self.url = f"https://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def settle_all(self) -> None:
        for d in self.state.values():
            d.update(status=d["spec"], updated=d["spec"], observed=d["generation"],
                     terminating=0)

    def _handle(self, req: BaseHTTPRequestHandler, method: str) -> None:
        length = int(req.headers.get("Content-Length") or 0)
        body = json.loads(req.rfile.read(length)) if length else None
        m = _PATH.match(req.path)
        call = {"method": method, "path": req.path, "auth": req.headers.get("Authorization"),
                "type": req.headers.get("Content-Type"), "body": body,
                "name": m.group(2) if m else None, "scale": bool(m and m.group(3))}
        self.calls.append(call)
        if self.hang_s:
            time.sleep(self.hang_s)
        if call["auth"] != f"Bearer {self.token}":
            return self._status(req, 401, "Unauthorized")
        if not m or m.group(1) != NS or m.group(2) not in self.state:
            return self._status(req, 404, f"deployments.apps {call['name']!r} not found")
        if (method, m.group(2)) in self.fail:
            return self._status(req, self.fail[method, m.group(2)], "forbidden by the test")
        d = self.state[m.group(2)]
        if method == "PATCH":
            if not call["scale"]:
                return self._status(req, 405, "only the scale subresource is patched")
            if call["type"] != "application/merge-patch+json":
                return self._status(req, 415, f"unsupported media type {call['type']}")
            d["spec"] = int(body["spec"]["replicas"])
            d["generation"] += 1
            if self.settle:
                self.settle_all()
        if call["scale"]:
            reply = {"kind": "Scale", "apiVersion": "autoscaling/v1",
                     "metadata": {"name": m.group(2), "namespace": NS},
                     "spec": {"replicas": d["spec"]},
                     "status": {"replicas": d["status"], "selector": "app=x"}}
        else:
            reply = {"kind": "Deployment", "metadata": {"name": m.group(2),
                                                        "generation": d["generation"]},
                     "spec": {"replicas": d["spec"]},
                     "status": {"observedGeneration": d["observed"], "replicas": d["status"],
                                "updatedReplicas": d["updated"], "readyReplicas": d["status"],
                                **({"terminatingReplicas": d["terminating"]}
                                   if d["terminating"] else {})}}
        self._reply(req, 200, reply)

    def _status(self, req, code: int, message: str) -> None:
        self._reply(req, code, {"kind": "Status", "status": "Failure", "message": message,
                                "code": code})

    @staticmethod
    def _reply(req, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        req.send_response(code)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(data)))
        req.end_headers()
        req.wfile.write(data)


@pytest.fixture(scope="module")
def cert(tmp_path_factory) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl makes the fake API server's certificate")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1", "-subj",
                    "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(d / "key.pem"), "-out", str(d / "ca.crt")],
                   check=True, capture_output=True, timeout=30)
    return d / "ca.crt", d / "key.pem"


@pytest.fixture
def api(cert):
    server = FakeApiServer(*cert, {PROMPT: 2, COMPLETION: 6})
    yield server
    server.close()


def _actuator(api: FakeApiServer, tmp_path: Path, timeout_s: float = 5.0) -> KubernetesActuator:
    token = tmp_path / "token"
    token.write_text(api.token + "\n")
    return KubernetesActuator(KubeConfig(server=api.url, namespace=NS, token_file=str(token),
                                         ca_file=str(api.ca), timeout_s=timeout_s))


def _rbac_of(call: dict) -> tuple[str, str]:
    return ("deployments/scale" if call["scale"] else "deployments",
            {"GET": "get", "PATCH": "patch"}[call["method"]])


# --------------------------------------------------------------------------- the actuator
def test_a_change_patches_both_replica_counts_keeping_the_budget(api, tmp_path):
    actuator = _actuator(api, tmp_path)
    assert actuator.current_split() == Split(2, 6)
    api.calls.clear()
    actuator.apply(Split(4, 4))
    assert (api.state[PROMPT]["spec"], api.state[COMPLETION]["spec"]) == (4, 4)
    patches = [(c["name"], c["body"], c["type"]) for c in api.calls if c["method"] == "PATCH"]
    # The shrinking Deployment first: its pods drain and free their accelerators.
    assert patches == [(COMPLETION, {"spec": {"replicas": 4}}, "application/merge-patch+json"),
                       (PROMPT, {"spec": {"replicas": 4}}, "application/merge-patch+json")]
    assert actuator.current_split() == Split(4, 4)
    actuator.apply(Split(1, 7))  # and back the other way
    assert (api.state[PROMPT]["spec"], api.state[COMPLETION]["spec"]) == (1, 7)
    with pytest.raises(KubernetesError, match="budget"):
        actuator.apply(Split(2, 7))
    # Every call is one the planner's Role grants (test_manifests.py checks the Role), and on
    # the two engine Deployments only.
    granted = {(res, verb) for res, verbs in RBAC_RULES for verb in verbs}
    assert {_rbac_of(c) for c in api.calls} <= granted
    assert {c["name"] for c in api.calls} == {PROMPT, COMPLETION}


def test_the_service_account_token_is_sent_as_a_bearer_header_and_reread(api, tmp_path):
    actuator = _actuator(api, tmp_path)
    actuator.current_split()
    assert api.calls and all(c["auth"] == f"Bearer {TOKEN}" for c in api.calls)
    api.token = "sa-token-2"  # the kubelet rotated the projected token
    with pytest.raises(KubernetesError, match="401"):
        actuator.current_split()
    (tmp_path / "token").write_text("sa-token-2\n")
    assert actuator.current_split() == Split(2, 6)


def test_a_rolling_deployment_holds(api, tmp_path):
    actuator = _actuator(api, tmp_path)
    api.settle = False
    actuator.apply(Split(3, 5))
    with pytest.raises(Unsettled, match=f"{PROMPT}: scale 2 of 3 replicas"):
        actuator.current_split()
    api.state[PROMPT].update(status=3, updated=3, observed=api.state[PROMPT]["generation"])
    with pytest.raises(Unsettled, match=f"{COMPLETION}: scale 6 of 5 replicas"):
        actuator.current_split()
    api.settle_all()
    assert actuator.current_split() == Split(3, 5)
    # The scale's status agrees but the controller has not seen the newest spec yet ...
    api.state[PROMPT]["generation"] += 1
    with pytest.raises(Unsettled, match="generation"):
        actuator.current_split()
    api.settle_all()
    # ... or a scaled-down pod still drains (Kubernetes >= 1.33 counts terminating pods).
    api.state[COMPLETION]["terminating"] = 1
    with pytest.raises(Unsettled, match="terminating"):
        actuator.current_split()


def test_a_failed_second_patch_puts_the_first_back(api, tmp_path):
    actuator = _actuator(api, tmp_path)
    api.fail["PATCH", PROMPT] = 403
    with pytest.raises(KubernetesError, match="403 forbidden by the test"):
        actuator.apply(Split(4, 4))
    assert (api.state[PROMPT]["spec"], api.state[COMPLETION]["spec"]) == (2, 6)
    assert [(c["name"], c["body"]["spec"]["replicas"]) for c in api.calls
            if c["method"] == "PATCH"] == [(COMPLETION, 4), (PROMPT, 4), (COMPLETION, 6)]


def test_an_api_call_times_out(api, tmp_path):
    actuator = _actuator(api, tmp_path, timeout_s=0.3)
    api.hang_s = 1.0
    t0 = time.monotonic()
    with pytest.raises(KubernetesError, match="timed out"):
        actuator.current_split()
    assert time.monotonic() - t0 < 0.9
    api.hang_s = 0.0


def test_in_cluster_config_comes_from_the_service_account(tmp_path, monkeypatch):
    for name, text in (("token", TOKEN), ("namespace", NS + "\n"), ("ca.crt", "x")):
        (tmp_path / name).write_text(text)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    cfg = KubeConfig.in_cluster(sa_dir=str(tmp_path))
    assert (cfg.server, cfg.namespace) == ("https://10.96.0.1:443", NS)
    assert (cfg.token_file, cfg.ca_file) == (str(tmp_path / "token"), str(tmp_path / "ca.crt"))
    assert KubeConfig.in_cluster("other", sa_dir=str(tmp_path)).namespace == "other"
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
    with pytest.raises(ValueError, match="KUBERNETES_SERVICE_HOST"):
        KubeConfig.in_cluster(sa_dir=str(tmp_path))


# --------------------------------------------------------------------------- the loop
class ScriptedPlanner:
    """Decides what the test says (planner/core.py's decision is tests/sim/test_planner.py's)."""

    def __init__(self, action: str, target: Split) -> None:
        self.action, self.target = action, target
        self.seen: list[Split] = []
        self.engines: list = []  # the engines' stats each decision was given

    def decide(self, now_s, current, observations, engines=None, outcomes=None) -> Decision:
        self.seen.append(current)
        self.engines.append(engines)
        return Decision(self.action, self.target, "scripted", {self.target.name: 1.0})


class Registry:
    def __init__(self) -> None:
        self.plans: list[tuple[dict, float]] = []

    def publish_plan(self, plan: dict, ttl_s: float) -> None:
        self.plans.append((plan, ttl_s))


def _observe():
    return 1000.0, [(999.0, 100, 10)] * 3, []


def test_the_loop_gives_the_planner_the_engines_load_from_the_registry(api, tmp_path):
    """`baton planner` reads the engines' queues and KV from their registry records (no busy
    time: its egress reaches the registry, not the engines); a registry outage there leaves
    the decision to the requests alone."""
    class Records(Registry):
        def list(self, role):
            return [EngineRecord(role=role, engine_id=f"{role}-0", address="tcp://e:7000",
                                 num_free_blocks=10, num_total_blocks=100, num_running=3,
                                 num_waiting=5 if role == "prompt" else 0)]

    planner, registry = ScriptedPlanner("hold", Split(2, 6)), Records()
    loop = PlannerLoop(planner, _actuator(api, tmp_path), _observe, registry, 2.0,
                       observe_engines=RegistryLoads(registry))
    loop.tick()
    assert [(s.engine_id, s.num_running, s.num_waiting, s.num_free_blocks, s.num_total_blocks,
             "busy_s" in s.extra) for s in planner.engines[0]] == [
        ("prompt-0", 3, 5, 10, 100, False), ("completion-0", 3, 0, 10, 100, False)]

    def down():
        raise ConnectionError("registry down")

    loop.observe_engines = down
    assert loop.tick()["action"] == "hold" and planner.engines[-1] is None


def test_the_loop_publishes_the_decision_and_scales_in_apply_mode(api, tmp_path):
    actuator, registry = _actuator(api, tmp_path), Registry()
    loop = PlannerLoop(ScriptedPlanner("change", Split(5, 3)), actuator, _observe, registry, 2.0)
    record = loop.tick()
    assert record["current"] == "2P:6D" and record["target"] == "5P:3D"
    assert record["recommended"] == {"prompt": 5, "completion": 3}
    assert record["observations"] == 3 and registry.plans == [(record, 6.0)]
    assert (api.state[PROMPT]["spec"], api.state[COMPLETION]["spec"]) == (5, 3)
    # Advise: decided and published, nothing scaled.
    loop.planner = ScriptedPlanner("advise", Split(1, 7))
    loop.tick()
    assert registry.plans[-1][0]["action"] == "advise"
    assert (api.state[PROMPT]["spec"], api.state[COMPLETION]["spec"]) == (5, 3)


def test_the_loop_holds_while_a_deployment_rolls(api, tmp_path):
    actuator, registry = _actuator(api, tmp_path), Registry()
    planner = ScriptedPlanner("change", Split(4, 4))
    observed = []
    loop = PlannerLoop(planner, actuator, lambda: observed.append(1) or _observe(), registry,
                       2.0)
    api.settle = False
    loop.tick()  # patches; the pods are not there yet
    assert loop.tick() is None and len(planner.seen) == 1 and len(observed) == 1
    assert len(registry.plans) == 1  # a hold publishes nothing new: the last plan stands
    api.settle_all()
    planner.action = "hold"
    assert loop.tick()["current"] == "4P:4D"


def test_an_api_error_is_logged_and_the_decision_skipped(api, tmp_path, caplog):
    actuator, registry = _actuator(api, tmp_path), Registry()
    loop = PlannerLoop(ScriptedPlanner("change", Split(4, 4)), actuator, _observe, registry,
                       0.05)
    api.fail["GET", COMPLETION] = 500
    loop.start()
    try:
        deadline = time.monotonic() + 5
        while loop.num_errors < 2:
            assert time.monotonic() < deadline, "no decision was tried"
            time.sleep(0.02)
    finally:
        loop.stop()
    assert "this decision skipped" in caplog.text and "500" in caplog.text
    assert not registry.plans and not loop.decisions
    assert (api.state[PROMPT]["spec"], api.state[COMPLETION]["spec"]) == (2, 6)
    assert not [c for c in api.calls if c["method"] == "PATCH"]
    assert loop.last_tick_s > 0  # the loop goes round: its liveness probe stays green


# --------------------------------------------------------------------------- the command
def test_baton_planner_help_lists_its_flags():
    out = subprocess.run([sys.executable, "-m", "baton_cli", "planner", "--help"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for flag in ("--router-url", "--redis-url", "--planner-profile", "--goodput",
                 "--planner-interval", "--planner-window", "--planner-cooldown", "--planner ",
                 "--planner-min-requests", "--planner-slo-target", "--planner-slo-check",
                 "--prompt-deployment", "--completion-deployment", "--kube-timeout"):
        assert flag in out.stdout, flag


@pytest.mark.parametrize("argv,named", [
    (["--bogus"], "--bogus"),
    (["--planner", "sometimes"], "--planner"),
    (["--planner-interval", "soon"], "--planner-interval"),
])
def test_a_bad_flag_is_refused_with_its_name(argv, named, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["planner", "--redis-url", "redis://127.0.0.1:1/0", *argv])
    assert exc.value.code == 2 and named in capsys.readouterr().err


def test_a_bad_value_or_a_missing_cluster_is_refused_with_the_reason(capsys, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    base = ["planner", "--redis-url", "redis://127.0.0.1:1/0", "--insecure",
            "--planner-profile", str(REPO / "tests/data/profile_test.json")]
    assert main([*base, "--goodput", "ttft"]) == 2
    assert "bad --goodput item 'ttft'" in capsys.readouterr().err
    assert main([*base[:-2], "--goodput", "ttft:2000"]) == 2
    assert "--planner-profile" in capsys.readouterr().err
    assert main([*base, "--goodput", "ttft:2000"]) == 2
    assert "KUBERNETES_SERVICE_HOST" in capsys.readouterr().err


def test_health_and_metrics(api, tmp_path):
    import urllib.error
    import urllib.request

    from baton_cli.planner_main import serve_http

    loop = PlannerLoop(ScriptedPlanner("advise", Split(3, 5)), _actuator(api, tmp_path),
                       _observe, Registry(), 30.0)
    loop.tick()
    server = serve_http("127.0.0.1", 0, loop)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        loop.last_tick_s = time.monotonic()
        with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
            assert resp.status == 200
        loop.last_tick_s = time.monotonic() - 1000
        with pytest.raises(urllib.error.HTTPError, match="503"):
            urllib.request.urlopen(f"{url}/health", timeout=5)
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        assert 'baton_planner_recommended_engines{role="prompt"} 3' in text
        assert 'baton_planner_decisions_total{action="advise"} 1' in text
    finally:
        server.shutdown()
        server.server_close()


# --------------------------------------------------------------------------- the drain
class _BusyWorker:
    """A worker with one pull in flight until the test lets it go."""

    role = "completion"

    def __init__(self) -> None:
        self.pending = False

    def add_request(self, req):
        return []

    def abort_request(self, req_id):
        return []

    def step(self):
        return []

    def tick(self):
        return []

    def has_work(self):
        return False

    def has_pending(self):
        return self.pending

    def fill_stats(self, stats):
        pass

    def fill_record(self, record):
        pass

    def close(self):
        pass


class _RecordingRegistry:
    def __init__(self) -> None:
        self.events: list[tuple[str, bool]] = []

    def publish(self, record) -> None:
        self.events.append(("publish", record.draining))

    def remove(self, role, engine_id) -> None:
        self.events.append(("remove", False))


def test_a_sigterm_publishes_the_engine_as_draining_before_it_finishes_its_work():
    """A pod scaled down gets SIGTERM (EngineService.stop): routers must learn at once that it
    takes nothing new, while what it runs finishes; then it deregisters."""
    from baton.service.engine_service import EngineService, ServiceConfig

    worker, registry = _BusyWorker(), _RecordingRegistry()
    service = EngineService(worker, ServiceConfig("completion-0", heartbeat_s=0.05,
                                                  drain_timeout_s=10), registry=registry)
    thread = threading.Thread(target=service.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 5
        while not registry.events:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert registry.events[0] == ("publish", False)
        worker.pending = True  # in flight when the SIGTERM comes
        service.stop()
        while ("publish", True) not in registry.events:
            assert time.monotonic() < deadline, registry.events
            time.sleep(0.01)
        assert thread.is_alive() and service.stats().draining  # still finishing its work
        worker.pending = False
        thread.join(5)
    finally:
        worker.pending = False
        service.stop()
        thread.join(5)
    assert not thread.is_alive()
    assert registry.events[-1] == ("remove", False)
    assert registry.events[-2] == ("publish", True)  # draining until it is gone
