"""The hardening of the manifests in ``deploy/k8s`` (docs/security.md), on the objects
``test_k8s_manifests.py`` renders:

- every pod runs as the image's own user (the ``USER`` of the Dockerfile), not root, with the
  runtime's default seccomp profile and no service-account token; every container (init
  containers included) on a read-only root filesystem, every capability dropped, no privilege
  escalation; the namespace enforces Pod Security "restricted";
- what a daemon writes is on a volume: ``/tmp`` ($TMPDIR and HOME, where AOTInductor unpacks the
  ``.so`` it loads) an emptyDir, which is never mounted noexec, the stores on their claims, a
  runner's ``$WARMSERVE_HOME/programs`` an emptyDir; the claims are the user's group's (fsGroup);
- the NetworkPolicies, evaluated as the API defines them (a default deny, then unions of rules),
  allow exactly the stack's flows, and every address a container dials is one of them; the
  plaintext health-only ports are reached by no pod but the runners (the stores', for their init
  container's wait); the kubelet's probes come from the node, which policies do not filter.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path

import pytest
from test_k8s_manifests import (
    KUSTOMIZATIONS,
    NAMESPACE,
    daemon_of,
    environment,
    expand,
    health_port,
    named,
    of_kind,
    parsed_args,
    pod_labels,
    pod_spec,
    render,
    service_for,
    warmserve_containers,
    workload_running,
    workloads,
)

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
CLIENT_NAMESPACE_LABEL = {"warmserve.io/client": "true"}
COMPONENTS = ("kernel-cache", "weights", "router", "runner", "openai")


def image_user() -> tuple[int, int]:
    """The ``USER uid:gid`` the image runs as (numeric: the kubelet can check runAsNonRoot)."""
    (user,) = re.findall(r"^USER\s+(\d+):(\d+)\s*$", DOCKERFILE, re.M)
    assert f"--uid {user[0]}" in DOCKERFILE and f"--gid {user[1]}" in DOCKERFILE, "useradd makes that user"
    return int(user[0]), int(user[1])


def image_env(name: str) -> str:
    match = re.search(rf"^\s*(?:ENV\s+)?{name}=(\S+?)\s*\\?$", DOCKERFILE, re.M)
    assert match, f"the Dockerfile sets no {name}"
    return match.group(1)


@pytest.fixture(params=KUSTOMIZATIONS, scope="module")
def objects(request) -> tuple[dict, ...]:
    return render(request.param)


def all_containers(workload: dict) -> list[dict]:
    spec = pod_spec(workload)
    return spec.get("initContainers", []) + spec["containers"]


# --- users, capabilities, seccomp --------------------------------------------------------------


def test_the_image_runs_as_a_fixed_non_root_user():
    uid, gid = image_user()
    assert uid >= 10000 and gid >= 10000  # outside any host's system and login ranges
    assert DOCKERFILE.rstrip().splitlines().index(f"USER {uid}:{gid}") > DOCKERFILE.rstrip().splitlines().index(
        next(line for line in DOCKERFILE.splitlines() if line.startswith("RUN PIP_NO_INDEX=1"))), \
        "USER after the install: the source and the venv stay root's, read-only to the user"


def test_every_pod_runs_as_the_image_user(objects):
    uid, gid = image_user()
    for workload in workloads(objects):
        spec, where = pod_spec(workload), workload["metadata"]["name"]
        pod = spec.get("securityContext", {})
        assert (pod.get("runAsNonRoot"), pod.get("runAsUser"), pod.get("runAsGroup"), pod.get("fsGroup")) == (
            True, uid, gid, gid), where
        assert pod.get("fsGroupChangePolicy") == "OnRootMismatch", f"{where}: a large claim is walked once"
        assert pod.get("seccompProfile") == {"type": "RuntimeDefault"}, where
        assert spec.get("automountServiceAccountToken") is False, f"{where}: no pod here calls the API"
        assert not spec.get("hostNetwork") and not spec.get("hostPID") and not spec.get("hostIPC"), where


def test_every_container_is_locked_down(objects):
    for workload in workloads(objects):
        pod = pod_spec(workload)["securityContext"]
        for container in all_containers(workload):
            sc, where = container.get("securityContext", {}), f"{workload['metadata']['name']}/{container['name']}"
            effective = {**pod, **sc}
            assert effective.get("runAsNonRoot") is True and effective.get("runAsUser", 1) != 0, where
            assert effective.get("seccompProfile") == {"type": "RuntimeDefault"}, where
            assert sc.get("allowPrivilegeEscalation") is False, where
            assert sc.get("readOnlyRootFilesystem") is True, where
            assert sc.get("capabilities", {}).get("drop") == ["ALL"] and not sc["capabilities"].get("add"), where
            assert not sc.get("privileged"), where


def test_the_namespace_enforces_pod_security_restricted(objects):
    labels = named(objects, "Namespace", NAMESPACE)["metadata"]["labels"]
    for mode in ("enforce", "audit", "warn"):
        assert labels.get(f"pod-security.kubernetes.io/{mode}") == "restricted", mode


# --- writable places ---------------------------------------------------------------------------


def _mounts(workload: dict, container: dict) -> dict[str, dict]:
    """mountPath -> the volume mounted there."""
    volumes = {v["name"]: v for v in pod_spec(workload).get("volumes", [])}
    return {m["mountPath"]: volumes[m["name"]] for m in container.get("volumeMounts", [])}


def _on(path: str, mounts: dict[str, dict]) -> dict | None:
    best = max((m for m in mounts if path == m or path.startswith(m.rstrip("/") + "/")), key=len, default=None)
    return mounts.get(best) if best else None


def test_tmp_home_and_state_are_writable_volumes(objects):
    tmpdir, home, state = image_env("TMPDIR"), image_env("HOME"), image_env("WARMSERVE_HOME")
    assert tmpdir == home == "/tmp"
    for workload in workloads(objects):
        for container in warmserve_containers(workload):
            component, where = daemon_of(container), container["name"]
            env = environment(objects, workload, container)
            assert env.get("TMPDIR", tmpdir) == tmpdir and env.get("HOME", home) == home, where
            mounts = _mounts(workload, container)
            # an emptyDir is a plain directory (or tmpfs with medium Memory), never mounted noexec
            assert "emptyDir" in (mounts.get(tmpdir) or {}), f"{where}: $TMPDIR {tmpdir} is not an emptyDir"
            args = parsed_args(objects, workload, container)
            writes = {"kernel-cache": [args.root] if component == "kernel-cache" else [],
                      "weights": [args.root] if component == "weights" else [],
                      # fetched and compiled programs are loaded from $WARMSERVE_HOME/programs
                      "runner": [getattr(args, "sidecar_dir", None), f"{env.get('WARMSERVE_HOME', state)}/programs"],
                      }.get(component, [])
            for path in writes:
                volume = _on(path, mounts)
                assert volume and ("emptyDir" in volume or "persistentVolumeClaim" in volume), f"{where}: {path}"
            for mount in container.get("volumeMounts", []):
                volume = _on(mount["mountPath"], mounts)
                if "secret" in volume or "configMap" in volume:
                    assert mount.get("readOnly") is True, f"{where}: {mount['mountPath']}"


# --- NetworkPolicies ---------------------------------------------------------------------------


class Endpoint:
    """A pod (namespace labels, pod labels) or an address outside the cluster (``pod`` None)."""

    def __init__(self, name: str, namespace: str | None, ns_labels: dict, pod: dict | None, ip: str) -> None:
        self.name, self.namespace, self.ns_labels, self.pod, self.ip = name, namespace, ns_labels, pod, ip


def _matches(selector: dict | None, labels: dict) -> bool:
    """A LabelSelector (matchLabels, matchExpressions In/NotIn/Exists/DoesNotExist); ``{}`` is all."""
    if selector is None:
        return False
    ok = all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok &= {"In": labels.get(key) in values, "NotIn": labels.get(key) not in values,
               "Exists": key in labels, "DoesNotExist": key not in labels}[op]
    return ok


def _peer_matches(peer: dict, ep: Endpoint) -> bool:
    if "ipBlock" in peer:
        block = peer["ipBlock"]
        return ep.pod is None and ipaddress.ip_address(ep.ip) in ipaddress.ip_network(block["cidr"]) and not any(
            ipaddress.ip_address(ep.ip) in ipaddress.ip_network(c) for c in block.get("except", []))
    if ep.pod is None:
        return False
    if "namespaceSelector" in peer:
        in_ns = _matches(peer["namespaceSelector"], ep.ns_labels)
    else:
        in_ns = ep.namespace == NAMESPACE
    return in_ns and _matches(peer.get("podSelector", {}), ep.pod)


def _rule_allows(rule: dict, peers_key: str, ep: Endpoint, port: int, protocol: str) -> bool:
    peers = rule.get(peers_key) or []
    ports = rule.get("ports") or []
    return (not peers or any(_peer_matches(p, ep) for p in peers)) and (
        not ports or any(p.get("port") == port and p.get("protocol", "TCP") == protocol for p in ports))


def _allowed(objects, pod: Endpoint, direction: str, other: Endpoint, port: int, protocol: str) -> bool:
    """Whether the policies of ``pod``'s namespace let this traffic in (or out) of ``pod``."""
    if pod.namespace != NAMESPACE:
        return True  # not ours to police (kube-dns, the clients, the internet)
    policies = [p for p in of_kind(objects, "NetworkPolicy") if _matches(p["spec"]["podSelector"], pod.pod)
                and direction in p["spec"].get("policyTypes", ["Ingress"])]
    if not policies:
        return True
    key, peers = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    return any(_rule_allows(r, peers, other, port, protocol) for p in policies for r in p["spec"].get(key, []))


def _endpoints(objects) -> dict[str, Endpoint]:
    ns_labels = {**named(objects, "Namespace", NAMESPACE)["metadata"].get("labels", {}),
                 "kubernetes.io/metadata.name": NAMESPACE}
    eps = {daemon_of(warmserve_containers(w)[0]): Endpoint(w["metadata"]["name"], NAMESPACE, ns_labels,
                                                            pod_labels(w), "10.244.0.9") for w in workloads(objects)}
    eps["client"] = Endpoint("client", "apps", {"kubernetes.io/metadata.name": "apps", **CLIENT_NAMESPACE_LABEL},
                             {"app": "client"}, "10.244.1.2")
    eps["stranger"] = Endpoint("stranger", "other", {"kubernetes.io/metadata.name": "other"}, {"app": "x"},
                               "10.244.1.3")
    eps["in-namespace-stranger"] = Endpoint("in-namespace-stranger", NAMESPACE, ns_labels, {"app": "debug"},
                                            "10.244.0.10")
    eps["kube-dns"] = Endpoint("kube-dns", "kube-system", {"kubernetes.io/metadata.name": "kube-system"},
                               {"k8s-app": "kube-dns"}, "10.96.0.10")
    eps["internet"] = Endpoint("internet", None, {}, None, "203.0.113.7")
    return eps


def _ports(objects) -> dict[str, list[tuple[int, str]]]:
    """Each destination's ports: the daemons' ``--port``, DNS, HTTPS."""
    ports = {}
    for component in COMPONENTS:
        workload = workload_running(objects, component)
        (container,) = warmserve_containers(workload)
        health = health_port(objects, workload, container)
        ports[component] = [(parsed_args(objects, workload, container).port, "TCP")] + (
            [(health, "TCP")] if health is not None else [])
    ports["kube-dns"] = [(53, "UDP"), (53, "TCP")]
    ports["internet"] = [(443, "TCP")]
    return ports


def allowed_flows(objects) -> set[tuple[str, str, int, str]]:
    eps, ports = _endpoints(objects), _ports(objects)
    return {(src, dst, port, proto) for src, s in eps.items() for dst, d in eps.items()
            if src != dst and NAMESPACE in (s.namespace, d.namespace) for port, proto in ports.get(dst, [])
            if _allowed(objects, s, "Egress", d, port, proto) and _allowed(objects, d, "Ingress", s, port, proto)}


def expected_flows(objects, kustomization: str) -> set[tuple[str, str, int, str]]:
    ports = _ports(objects)
    main = {dst: ports[dst][:1] for dst in COMPONENTS}  # --port; [1:] is the health-only port
    pairs = [("runner", "router", main), ("runner", "kernel-cache", ports), ("runner", "weights", ports),
             ("router", "runner", main), ("openai", "router", main), ("client", "router", main),
             ("client", "openai", main)]
    pairs += [(c, "kube-dns", ports) for c in COMPONENTS]
    if kustomization.endswith("-s3"):
        pairs += [("kernel-cache", "internet", ports), ("weights", "internet", ports)]
    return {(src, dst, port, proto) for src, dst, which in pairs for port, proto in which[dst]}


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_network_policies_allow_exactly_the_stacks_flows(kustomization):
    objects = render(kustomization)
    default_deny = [p for p in of_kind(objects, "NetworkPolicy") if p["spec"]["podSelector"] == {}]
    assert [sorted(p["spec"]["policyTypes"]) for p in default_deny] == [["Egress", "Ingress"]]
    for component in COMPONENTS:  # one policy of its own per component
        assert named(objects, "NetworkPolicy", component) is not None, component
    allowed, expected = allowed_flows(objects), expected_flows(objects, kustomization)
    assert allowed - expected == set(), "flows no one needs"
    assert expected - allowed == set(), "flows the stack needs, refused"


def test_every_dialled_address_is_an_allowed_flow(objects):
    allowed = {(src, dst, port) for src, dst, port, _ in allowed_flows(objects)}
    dials = 0
    for workload in workloads(objects):
        for container in warmserve_containers(workload):
            src, args = daemon_of(container), parsed_args(objects, workload, container)
            for flag in ("router", "kernel_cache", "weights"):
                address = getattr(args, flag, None)
                if address and src not in (flag.replace("_", "-"),):
                    _, backends = service_for(objects, address, container["name"])
                    (dst,) = [daemon_of(c) for w in backends for c in warmserve_containers(w)]
                    assert (src, dst, int(address.rpartition(":")[2])) in allowed, (src, address)
                    dials += 1
        for init in pod_spec(workload).get("initContainers", []):
            src = daemon_of(warmserve_containers(workload)[0])
            script = " ".join(expand(init["command"] + init.get("args", []), {}, init["name"]))
            for address in re.findall(r"services\.healthcheck\s+([\w.-]+:\d+)", script):
                _, backends = service_for(objects, address, init["name"])
                (dst,) = [daemon_of(c) for w in backends for c in warmserve_containers(w)]
                assert (src, dst, int(address.rpartition(":")[2])) in allowed, (init["name"], address)
                dials += 1
    # the router dials each runner by pod IP on the runner's --port
    runner = workload_running(objects, "runner")
    runner_port = parsed_args(objects, runner, warmserve_containers(runner)[0]).port
    assert ("router", "runner", runner_port) in allowed
    assert dials >= 6
