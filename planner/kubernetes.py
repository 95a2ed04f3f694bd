"""The planner's actuator on Kubernetes: the per-role Deployments' replica counts.

The manifests (deploy/k8s) keep one Deployment per role (baton-prompt-engine,
baton-completion-engine), not one Deployment whose pods read their role at run time: a pod's
role is its Deployment's, so a role change is "prompt +k, completion -k" on the two replica
counts (the budget kept), and the in-place change of S41 stays for `baton up` and bare-metal
fleets. Kubernetes starts the new pods; the old ones get SIGTERM and drain
(baton/service/engine_service.py: published as draining, running requests finish within
--drain-timeout, what is left is aborted and migrates at the router) within the pods'
terminationGracePeriodSeconds.

It speaks to the API server with the standard library only (urllib + ssl), in-cluster: the
service account's token and CA (/var/run/secrets/kubernetes.io/serviceaccount/) and
$KUBERNETES_SERVICE_HOST/$KUBERNETES_SERVICE_PORT. The calls, every one with a timeout, are
exactly what deploy/k8s/planner.yaml's Role allows on the two Deployments (by resourceNames):
  GET   /apis/apps/v1/namespaces/{ns}/deployments/{name}         (get deployments: rollout)
  GET   /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale   (get deployments/scale)
  PATCH /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale   (patch deployments/scale,
        a merge patch {"spec": {"replicas": N}})
While a Deployment is still rolling (its controller has not seen the newest spec, its pods
are not its spec's count, or some still terminate) `current_split` raises `Unsettled` and the
planner holds, as the launcher's planner holds while an engine drains. An API error raises
`KubernetesError`; the loop logs it and skips that decision (the fleet serves on as it is).
"""

from __future__ import annotations

import json
import logging
import os
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass

from planner.core import Split
from planner.loop import Unsettled

logger = logging.getLogger(__name__)

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
PROMPT_DEPLOYMENT = "baton-prompt-engine"
COMPLETION_DEPLOYMENT = "baton-completion-engine"
# The API calls this actuator makes, as RBAC rules (resource, verbs): planner.yaml's Role must
# grant exactly these on the two Deployments (tests/deploy/test_manifests.py checks it).
RBAC_RULES = (("deployments", ("get",)), ("deployments/scale", ("get", "patch")))


class KubernetesError(Exception):
    """An API call failed (status, network, a body that is not what the API returns)."""


@dataclass
class KubeConfig:
    server: str  # https://host:port
    namespace: str
    token_file: str  # re-read on every call: the kubelet rotates a projected token
    ca_file: str = ""  # "" = the system's trust store
    timeout_s: float = 5.0

    @classmethod
    def in_cluster(cls, namespace: str = "", sa_dir: str = SERVICE_ACCOUNT_DIR,
                   timeout_s: float = 5.0) -> KubeConfig:
        """The pod's own: $KUBERNETES_SERVICE_HOST/PORT, the service account's token and CA,
        and its namespace unless one is given. ValueError names what is missing."""
        host = os.environ.get("KUBERNETES_SERVICE_HOST", "")
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise ValueError("not in a Kubernetes pod: $KUBERNETES_SERVICE_HOST is not set")
        token_file = os.path.join(sa_dir, "token")
        if not os.path.exists(token_file):
            raise ValueError(f"no service account token at {token_file} (automountServiceAccount"
                             "Token: false?)")
        if not namespace:
            with open(os.path.join(sa_dir, "namespace")) as f:
                namespace = f.read().strip()
        host = f"[{host}]" if ":" in host else host  # an IPv6 address
        return cls(server=f"https://{host}:{port}", namespace=namespace, token_file=token_file,
                   ca_file=os.path.join(sa_dir, "ca.crt"), timeout_s=timeout_s)


class KubernetesActuator:
    """The split is (prompt, completion) Deployments' spec.replicas; a change patches both."""

    def __init__(self, config: KubeConfig, prompt_deployment: str = PROMPT_DEPLOYMENT,
                 completion_deployment: str = COMPLETION_DEPLOYMENT) -> None:
        if prompt_deployment == completion_deployment:
            raise ValueError("the prompt and completion Deployments must differ")
        self.config = config
        self.deployments = (prompt_deployment, completion_deployment)
        self._ssl = ssl.create_default_context(cafile=config.ca_file or None)

    # ------------------------------------------------------------------ the API
    def _path(self, name: str, sub: str = "") -> str:
        return (f"/apis/apps/v1/namespaces/{self.config.namespace}/deployments/{name}"
                + (f"/{sub}" if sub else ""))

    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        with open(self.config.token_file) as f:
            token = f.read().strip()
        headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/merge-patch+json"
        request = urllib.request.Request(self.config.server + path, data=data, headers=headers,
                                         method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.config.timeout_s,
                                        context=self._ssl) as resp:
                reply = json.load(resp)
        except urllib.error.HTTPError as exc:
            detail = exc.read(2048).decode(errors="replace")
            try:
                detail = json.loads(detail).get("message", detail)
            except (ValueError, AttributeError):
                pass
            raise KubernetesError(f"{method} {path}: {exc.code} {detail}") from exc
        except (OSError, ValueError) as exc:  # refused, timed out, TLS, not JSON
            raise KubernetesError(f"{method} {path}: {exc}") from exc
        if not isinstance(reply, dict):
            raise KubernetesError(f"{method} {path}: not an object: {reply!r:.200}")
        return reply

    def scale(self, name: str) -> tuple[int, int]:
        """(spec.replicas, status.replicas) of the Deployment's scale subresource."""
        body = self._call("GET", self._path(name, "scale"))
        return _int(body, "spec", "replicas"), _int(body, "status", "replicas")

    def set_replicas(self, name: str, replicas: int) -> None:
        body = self._call("PATCH", self._path(name, "scale"), {"spec": {"replicas": replicas}})
        if _int(body, "spec", "replicas") != replicas:
            raise KubernetesError(f"{name}: asked for {replicas} replicas, the API server "
                                  f"answered {body.get('spec')}")

    def rolling(self, name: str) -> str:
        """Why the Deployment is not settled ("" when it is)."""
        body = self._call("GET", self._path(name))
        spec, status = body.get("spec") or {}, body.get("status") or {}
        want = int(spec.get("replicas", 1))
        generation = int((body.get("metadata") or {}).get("generation", 0))
        if int(status.get("observedGeneration", 0)) < generation:
            return f"{name}: its controller has not seen generation {generation} yet"
        have = int(status.get("replicas", 0))
        if have != want:
            return f"{name}: {have} of {want} replicas"
        updated = int(status.get("updatedReplicas", have))
        if updated != want:
            return f"{name}: {updated} of {want} replicas updated"
        terminating = int(status.get("terminatingReplicas") or 0)  # Kubernetes >= 1.33
        if terminating:
            return f"{name}: {terminating} replicas still terminating (draining)"
        return ""

    # ------------------------------------------------------------------ the actuator
    def current_split(self) -> Split:
        counts = []
        for name in self.deployments:
            want, have = self.scale(name)
            if have != want:
                raise Unsettled(f"{name}: scale {have} of {want} replicas")
            why = self.rolling(name)
            if why:
                raise Unsettled(why)
            counts.append(want)
        return Split(*counts)

    def apply(self, target: Split) -> None:
        """Both counts, the budget kept: the shrinking Deployment first (its pods drain and
        free their accelerators for the growing one's), then the growing one; a failed second
        patch puts the first back, so a half-made change never shrinks the budget."""
        prompt, completion = self.deployments
        before = {prompt: self.scale(prompt)[0], completion: self.scale(completion)[0]}
        after = {prompt: target.num_prompt, completion: target.num_completion}
        if sum(after.values()) != sum(before.values()):
            raise KubernetesError(f"{target.name} does not keep the budget of "
                                  f"{sum(before.values())} engines ({before})")
        order = sorted(self.deployments, key=lambda n: after[n] - before[n])  # shrink first
        done = []
        for name in order:
            if after[name] == before[name]:
                continue
            try:
                self.set_replicas(name, after[name])
            except KubernetesError:
                for undo in done:
                    try:
                        self.set_replicas(undo, before[undo])
                    except KubernetesError as exc:
                        logger.error("planner: could not put %s back to %d replicas: %s",
                                     undo, before[undo], exc)
                raise
            done.append(name)
            logger.info("planner: %s %d -> %d replicas", name, before[name], after[name])


def _int(body: dict, section: str, key: str) -> int:
    value = (body.get(section) or {}).get(key, 0)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise KubernetesError(f"{section}.{key} is {value!r}, not a replica count")
    return value
