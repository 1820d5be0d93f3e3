"""The Kubernetes manifests in ``deploy/k8s``: every kustomization is rendered with ``kubectl
kustomize`` and each object it yields is validated against the Kubernetes API's schemas
(``kubernetes-validate``, strict: an unknown field fails), then the links between the objects
are checked against each other and against warmserve's own code:

- each container's command line, after Kubernetes' ``$(VAR)`` expansion from its environment
  (ConfigMaps included), parses with warmserve's own argument parser, binds every interface,
  and each address it dials (``--router``, ``--kernel-cache``, ``--weights``, the init
  container's health checks) is a Service port in front of the right daemon;
- each Service selects a pod template, and its ``targetPort``, every probe's port, and the
  container's declared ``containerPort`` are the ``--port`` of that container's command;
- gRPC probes ask ``grpc.health.v1`` about service names the servers really register (taken
  from the servers built by the code, not re-typed), the HTTP probe asks a route the OpenAI
  door really serves;
- referenced ConfigMaps, Secrets and PersistentVolumeClaims exist, or are optional and named in
  ``deploy/k8s/README.md`` (created by hand); the kernel cache and the weight service keep their
  ``--root`` on their claims; the autoscaler and the disruption budget cover the runners;
- every pod runs as the image's user, hardened (Pod Security "restricted"), writing only to its
  volumes, and the NetworkPolicies allow exactly the stack's flows (``test_k8s_security.py``).

The renderer is ``kubectl`` on ``PATH`` (or ``$KUBECTL``); without one the tests fail and name
``make kubectl``, which installs it.
"""

from __future__ import annotations

import contextlib
import functools
import io
import math
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from cli_flags import flag_value, parse_command_line

from services.generation_client import GENERATION_SERVICE

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
README = K8S / "README.md"
#: Every kustomization under deploy/k8s (a test checks that none is left out).
KUSTOMIZATIONS = ("base", "overlays/small-cpu", "overlays/small-cpu-s3")
#: Kubernetes versions whose schemas every object must satisfy: the oldest in which every
#: feature used is GA (gRPC probes: 1.27) and the newest that kubernetes-validate ships.
SCHEMA_VERSIONS = ("1.27.0", "1.37.0")
NAMESPACE = "warmserve"
MAKE_TARGET = "make kubectl"
#: ``python -m warmserve.cli``: how every warmserve container starts.
WARMSERVE_COMMAND = ["python", "-m", "warmserve.cli"]
#: The daemons (their ``warmserve`` subcommands) and the component label of their pods.
DAEMONS = {
    ("cache", "serve"): "kernel-cache",
    ("weights", "serve"): "weights",
    ("router", "serve"): "router",
    ("runner", "serve"): "runner",
    ("openai", "serve"): "openai",
}
COMPONENT_LABEL = "app.kubernetes.io/component"
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet")
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


# --- rendering -----------------------------------------------------------------------------------


def kubectl_binary(path_env: str | None = None) -> str:
    """The ``kubectl`` to render with: ``$KUBECTL``, else the one on ``PATH`` (``path_env``
    when given). None: the test fails (it does not skip) and says how to install one."""
    binary = os.environ.get("KUBECTL") or shutil.which("kubectl", path=path_env)
    if not binary or not shutil.which(binary):
        pytest.fail(f"no kubectl to render deploy/k8s with (`kubectl kustomize`); run `{MAKE_TARGET}` "
                    "(Debian's kubernetes-client), or point $KUBECTL at one", pytrace=False)
    return binary


@functools.cache
def render(kustomization: str) -> tuple[dict, ...]:
    """The objects ``kubectl kustomize deploy/k8s/<kustomization>`` yields."""
    proc = subprocess.run([kubectl_binary(), "kustomize", str(K8S / kustomization)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"kubectl kustomize {kustomization} failed:\n{proc.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(proc.stdout) if doc is not None)


@pytest.fixture(params=KUSTOMIZATIONS, scope="module")
def objects(request) -> tuple[dict, ...]:
    return render(request.param)


@pytest.fixture(scope="module")
def registered(tmp_path_factory) -> dict[str, set[str]]:
    """Component -> the service names its server registers with ``grpc.health.v1`` (``""``,
    the whole server, included), from servers built the way their daemons build them."""
    from kernel_cache_service.servicer import build_server as kernel_cache_server
    from kernel_cache_service.store import KernelStore
    from kserve_service.door import router_server
    from router_service.config import RouterConfig
    from services.bootstrap import ServerConfig
    from weight_service.servicer import build_server as weights_server

    tmp = tmp_path_factory.mktemp("servers")
    names = {
        "kernel-cache": kernel_cache_server(KernelStore(tmp / "kc"), ServerConfig(service="kernel-cache")).service_names,
        "weights": weights_server(ServerConfig(service="weights"), tmp / "sidecars").service_names,
        "router": router_server(RouterConfig(), ServerConfig(service="router")).server.service_names,
        # runner_service.daemon registers exactly this one (a real runner needs a model)
        "runner": [GENERATION_SERVICE],
    }
    return {component: {"", *services} for component, services in names.items()}


# --- helpers over rendered objects ---------------------------------------------------------------


def of_kind(objects, kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def named(objects, kind: str, name: str) -> dict | None:
    return next((o for o in of_kind(objects, kind) if o["metadata"]["name"] == name), None)


def workloads(objects) -> list[dict]:
    return [o for o in objects if o["kind"] in WORKLOAD_KINDS]


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def pod_labels(workload: dict) -> dict:
    return workload["spec"]["template"]["metadata"].get("labels", {})


def selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def warmserve_containers(workload: dict) -> list[dict]:
    return [c for c in pod_spec(workload)["containers"] if c.get("command") == WARMSERVE_COMMAND]


def daemon_of(container: dict) -> str:
    """The component a ``warmserve`` container runs (by its subcommand)."""
    sub = tuple(container["args"][:2])
    assert sub in DAEMONS, f"container {container['name']} runs an unknown command {sub}"
    return DAEMONS[sub]


def workload_running(objects, component: str) -> dict:
    found = [w for w in workloads(objects) for c in warmserve_containers(w) if daemon_of(c) == component]
    assert len(found) == 1, f"expected one workload running {component}, found {len(found)}"
    return found[0]


def cpu(quantity) -> float:
    text = str(quantity)
    return int(text[:-1]) / 1000 if text.endswith("m") else float(text)


_BYTES = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def byte_count(quantity) -> int:
    number, suffix = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(quantity)).groups()
    return int(float(number) * _BYTES[suffix])


def environment(objects, workload: dict, container: dict) -> dict[str, str]:
    """The container's environment as the kubelet builds it: ``envFrom`` sources, then ``env``
    (downward API values stand in for the pod's own)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        kind, ref = ("ConfigMap", source["configMapRef"]) if "configMapRef" in source else ("Secret", source["secretRef"])
        obj = named(objects, kind, ref["name"])
        if obj is None:
            assert ref.get("optional"), f"{container['name']}: envFrom {kind} {ref['name']} does not exist"
            continue
        env.update({k: str(v) for k, v in obj.get("data", {}).items()})
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
            continue
        source = var["valueFrom"]
        if "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            cm = named(objects, "ConfigMap", ref["name"])
            assert cm is not None and ref["key"] in cm.get("data", {}), f"{var['name']}: no ConfigMap key {ref}"
            env[var["name"]] = cm["data"][ref["key"]]
        elif "fieldRef" in source:
            env[var["name"]] = {"metadata.name": f"{workload['metadata']['name']}-7d9f-x2x4z",
                                "metadata.namespace": NAMESPACE, "status.podIP": "10.244.0.7"}[
                source["fieldRef"]["fieldPath"]]
        elif "resourceFieldRef" in source:
            ref = source["resourceFieldRef"]
            target = next(c for c in pod_spec(workload)["containers"] if c["name"] == ref.get("containerName", container["name"]))
            bucket, resource = ref["resource"].split(".")
            assert resource == "cpu", ref
            value = cpu(target["resources"][bucket]["cpu"]) / cpu(ref.get("divisor", "1"))
            env[var["name"]] = str(math.ceil(value))
        else:
            pytest.fail(f"{var['name']}: unhandled valueFrom {source}")
    return env


def expand(words: list[str], env: dict[str, str], where: str) -> list[str]:
    """Kubernetes' ``$(VAR)`` expansion of a command line; an unresolved reference fails."""
    def sub(match: re.Match) -> str:
        assert match.group(1) in env, f"{where}: $({match.group(1)}) is not in the container's environment"
        return env[match.group(1)]

    return [_VAR.sub(sub, word) for word in words]


def container_argv(objects, workload: dict, container: dict) -> list[str]:
    """The container's ``warmserve`` arguments after Kubernetes' ``$(VAR)`` expansion."""
    return expand(container["args"], environment(objects, workload, container),
                  f"{workload['metadata']['name']}/{container['name']}")


def health_port(objects, workload: dict, container: dict) -> int | None:
    """The container's ``--health-port`` (plaintext ``grpc.health.v1`` only), or ``None``."""
    value = flag_value(container_argv(objects, workload, container), "--health-port")
    return int(value) if value is not None else None


def parsed_args(objects, workload: dict, container: dict):
    """The container's ``warmserve`` arguments, expanded and parsed by warmserve's own parser: every
    flag a real option of its command, spelled in full, with a value that parser accepts."""
    where = f"{workload['metadata']['name']}/{container['name']}"
    argv = container_argv(objects, workload, container)
    if "--store" in argv and not cli_has_store(tuple(argv[:2])):  # until the S3 store lands (see below)
        i = argv.index("--store")
        argv = argv[:i] + argv[i + 2:]
    try:
        return parse_command_line(argv)
    except AssertionError as e:
        pytest.fail(f"{where}: warmserve does not accept its command line {shlex.join(argv)}: {e}")


@functools.cache
def cli_has_store(command: tuple[str, str]) -> bool:
    """Whether ``warmserve cache serve`` / ``weights serve`` takes ``--store`` (the S3 store
    backend) yet."""
    from warmserve.cli import build_parser

    with contextlib.redirect_stderr(io.StringIO()):
        try:
            build_parser().parse_args([*command, "--root", "/tmp/store", "--store", "s3://bucket/prefix"])
        except SystemExit:
            return False
    return True


def declared_port(container: dict, port) -> int:
    """A probe's or Service's port (a number or a port name) as one the container declares."""
    ports = container.get("ports", [])
    if isinstance(port, str):
        match = [p["containerPort"] for p in ports if p.get("name") == port]
        assert match, f"{container['name']} declares no port named {port!r}"
        return match[0]
    assert port in [p["containerPort"] for p in ports], f"{container['name']} does not declare port {port}"
    return port


def service_for(objects, address: str, where: str) -> tuple[dict, list[dict]]:
    """The Service an in-cluster ``NAME:PORT`` address reaches, and the workloads behind it."""
    host, _, port = address.rpartition(":")
    service = named(objects, "Service", host)
    assert service is not None, f"{where}: {address} names no Service"
    assert int(port) in [p["port"] for p in service["spec"]["ports"]], f"{where}: Service {host} has no port {port}"
    backends = [w for w in workloads(objects) if selects(service["spec"]["selector"], pod_labels(w))]
    assert backends, f"{where}: Service {host} selects no pods"
    return service, backends


def uses_secret_volume(workload: dict, secret: str) -> str | None:
    """Where the pod mounts the Secret ``secret`` (its mount path), or ``None``."""
    spec = pod_spec(workload)
    volumes = {v["name"] for v in spec.get("volumes", []) if v.get("secret", {}).get("secretName") == secret}
    return next((m["mountPath"] for c in spec["containers"] for m in c.get("volumeMounts", []) if m["name"] in volumes),
                None)


# --- rendering and schemas ----------------------------------------------------------------------


def test_every_kustomization_is_tested():
    found = sorted(str(p.parent.relative_to(K8S)) for p in K8S.rglob("kustomization.yaml"))
    assert found == sorted(KUSTOMIZATIONS)


def test_a_missing_renderer_fails_naming_the_make_target(monkeypatch, tmp_path):
    monkeypatch.delenv("KUBECTL", raising=False)
    with pytest.raises(pytest.fail.Exception, match=re.escape(MAKE_TARGET)):
        kubectl_binary(path_env=str(tmp_path))


@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
def test_objects_validate_against_the_kubernetes_schemas(objects, version):
    errors = []
    for obj in objects:
        assert {"apiVersion", "kind", "metadata"} <= obj.keys() and obj["metadata"].get("name"), obj
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{obj['kind']}/{obj['metadata']['name']}: {e.message} at {'/'.join(map(str, e.path))}")
        except kubernetes_validate.SchemaNotFoundError as e:
            errors.append(e.message)
    assert not errors, "\n".join(errors)


def test_everything_is_in_the_namespace(objects):
    assert named(objects, "Namespace", NAMESPACE) is not None
    for obj in objects:
        if obj["kind"] != "Namespace":
            assert obj["metadata"].get("namespace") == NAMESPACE, f"{obj['kind']}/{obj['metadata']['name']}"


def test_the_stack_is_complete(objects):
    for component in DAEMONS.values():
        workload = workload_running(objects, component)
        assert pod_labels(workload)[COMPONENT_LABEL] == component == workload["metadata"]["name"]
        assert workload["spec"]["selector"]["matchLabels"] == pod_labels(workload)
    for kind in ("HorizontalPodAutoscaler", "PodDisruptionBudget", "ConfigMap"):
        assert of_kind(objects, kind), kind


# --- command lines, ports, probes ----------------------------------------------------------------


def test_command_lines_parse_and_bind_every_interface(objects):
    for workload in workloads(objects):
        for container in warmserve_containers(workload):
            args = parsed_args(objects, workload, container)
            assert args.host == "0.0.0.0", f"{container['name']} binds {args.host}: unreachable from other pods"


def test_command_lines_parse_with_the_s3_store():
    objects = render("overlays/small-cpu-s3")
    for component in ("kernel-cache", "weights"):
        workload = workload_running(objects, component)
        container = warmserve_containers(workload)[0]
        argv = expand(container["args"], environment(objects, workload, container), component)
        assert argv[argv.index("--store") + 1].startswith("s3://"), argv
        assert {"name": "warmserve-aws", "optional": True} in [s.get("secretRef") for s in container["envFrom"]]
    missing = [" ".join(command) for command in (("cache", "serve"), ("weights", "serve")) if not cli_has_store(command)]
    if missing:
        pytest.skip(f"`warmserve {' / '.join(missing)}` has no --store yet (the S3 store backend): the other "
                    "tests parse this overlay's command lines without it")
    test_command_lines_parse_and_bind_every_interface(objects)


def test_ports_are_the_ports_the_commands_listen_on(objects):
    for workload in workloads(objects):
        for container in warmserve_containers(workload):
            args = parsed_args(objects, workload, container)
            health = health_port(objects, workload, container)
            declared = [p["containerPort"] for p in container["ports"]]
            listens = [args.port] + ([health] if health is not None else [])
            assert declared == listens, f"{container['name']} declares {declared}, listens on {listens}"


def test_probes_point_at_the_served_port_and_registered_services(objects, registered):
    from openai_service.app import create_app
    from openai_service.config import OpenAIConfig

    http_routes = {route.path for route in create_app(OpenAIConfig()).routes}
    for workload in workloads(objects):
        for container in warmserve_containers(workload):
            component, args = daemon_of(container), parsed_args(objects, workload, container)
            # gRPC probes ask the plaintext health port: the kubelet presents no client certificate
            health = health_port(objects, workload, container)
            probes = {k: container.get(k) for k in ("startupProbe", "readinessProbe", "livenessProbe")}
            assert all(probes.values()), f"{container['name']} lacks a probe: {probes}"
            for kind, probe in probes.items():
                where = f"{container['name']} {kind}"
                if "grpc" in probe:
                    assert declared_port(container, probe["grpc"]["port"]) == (health or args.port), where
                    assert probe["grpc"].get("service", "") in registered[component], \
                        f"{where}: {probe['grpc'].get('service')!r} is not registered by {component}"
                elif "httpGet" in probe:
                    assert component == "openai", f"{where}: {component} serves gRPC, not HTTP"
                    assert declared_port(container, probe["httpGet"]["port"]) == args.port, where
                    assert probe["httpGet"]["path"] in http_routes, where
                    tls = flag_value(container_argv(objects, workload, container), "--tls-cert") is not None
                    assert probe["httpGet"].get("scheme", "HTTP") == ("HTTPS" if tls else "HTTP"), where
                else:
                    assert declared_port(container, probe["tcpSocket"]["port"]) == args.port, where
                if component != "openai":
                    assert "grpc" in probe, f"{where}: use the gRPC health service"


def test_runner_start_up_allows_a_cold_compile(objects):
    runner = warmserve_containers(workload_running(objects, "runner"))[0]
    startup = runner["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600


def test_services_select_pods_on_their_ports(objects):
    for service in of_kind(objects, "Service"):
        name = service["metadata"]["name"]
        backends = [w for w in workloads(objects) if selects(service["spec"].get("selector", {}), pod_labels(w))]
        assert len(backends) == 1, f"Service {name} selects {len(backends)} workloads"
        (container,) = warmserve_containers(backends[0])
        args = parsed_args(objects, backends[0], container)
        health = health_port(objects, backends[0], container)
        assert name == daemon_of(container), f"Service {name} is in front of {daemon_of(container)}"
        assert args.port in [p["port"] for p in service["spec"]["ports"]], f"Service {name} lacks --port"
        for port in service["spec"]["ports"]:
            target = declared_port(container, port.get("targetPort", port["port"]))
            assert target == port["port"] in (args.port, health), f"Service {name}: {port} vs --port {args.port}"


def test_dialled_addresses_reach_the_right_daemons(objects, registered):
    expected = {"router": "router", "kernel_cache": "kernel-cache", "weights": "weights"}
    dialled = 0
    for workload in workloads(objects):
        for container in warmserve_containers(workload):
            args = parsed_args(objects, workload, container)
            for flag, component in expected.items():
                address = getattr(args, flag, None)
                if address is None or daemon_of(container) == component:
                    continue
                _, backends = service_for(objects, address, container["name"])
                assert [daemon_of(c) for w in backends for c in warmserve_containers(w)] == [component], address
                dialled += 1
        for init in pod_spec(workload).get("initContainers", []):
            script = " ".join(init["command"] + init.get("args", []))
            checks = re.findall(r"services\.healthcheck\s+([\w.-]+:\d+)\s+--service\s+([\w.]+)", script)
            assert checks, f"{init['name']}: no health check"
            for address, service_name in checks:
                _, backends = service_for(objects, address, init["name"])
                (container,) = [c for w in backends for c in warmserve_containers(w)]
                assert service_name in registered[daemon_of(container)], (address, service_name)
    assert dialled == 4  # the runner's three, the OpenAI door's router


# --- configuration, secrets, storage -------------------------------------------------------------


def test_referenced_configmaps_secrets_and_claims_exist(objects):
    readme = README.read_text()
    for workload in workloads(objects):
        spec = pod_spec(workload)
        refs = []  # (kind, name, optional)
        for container in spec["containers"] + spec.get("initContainers", []):
            for source in container.get("envFrom", []):
                for key, kind in (("configMapRef", "ConfigMap"), ("secretRef", "Secret")):
                    if key in source:
                        refs.append((kind, source[key]["name"], source[key].get("optional", False)))
            for var in container.get("env", []):
                for key, kind in (("configMapKeyRef", "ConfigMap"), ("secretKeyRef", "Secret")):
                    ref = var.get("valueFrom", {}).get(key)
                    if ref:
                        refs.append((kind, ref["name"], ref.get("optional", False)))
            volumes = {v["name"] for v in spec.get("volumes", [])}
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes, f"{container['name']} mounts an undeclared volume {mount['name']}"
        for volume in spec.get("volumes", []):
            if "configMap" in volume:
                refs.append(("ConfigMap", volume["configMap"]["name"], volume["configMap"].get("optional", False)))
            if "secret" in volume:
                refs.append(("Secret", volume["secret"]["secretName"], volume["secret"].get("optional", False)))
            if "persistentVolumeClaim" in volume:
                refs.append(("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"], False))
        for kind, name, optional in refs:
            if named(objects, kind, name) is None:
                # required Secrets are the credentials deploy/compose/make_secrets.py makes (README)
                assert optional or (kind == "Secret" and name in credential_secrets()), \
                    f"{workload['metadata']['name']}: {kind} {name} does not exist"
                assert name in readme, f"{kind} {name} is created by hand: deploy/k8s/README.md must say how"


@functools.cache
def credential_secrets() -> dict[str, set[str]]:
    """The Secrets ``make_secrets.py --k8s-manifests`` makes: name -> its keys."""
    import sys
    import tempfile

    sys.path.insert(0, str(ROOT / "deploy" / "compose"))
    import make_secrets

    with tempfile.TemporaryDirectory() as tmp:
        make_secrets.prepare(Path(tmp) / "s", "k8s", log=lambda _m: None)
        return {d["metadata"]["name"]: set(d["data"]) for d in make_secrets.k8s_secrets(Path(tmp) / "s")}


#: The credential flags of issue 23 each daemon takes (files, from its component's Secret).
CREDENTIALS = {
    "kernel-cache": ("--auth-file", "--tls-cert", "--tls-key", "--tls-ca"),
    "weights": ("--auth-file", "--tls-cert", "--tls-key", "--tls-ca", "--signing-key"),
    "router": ("--auth-file", "--token-file", "--tls-cert", "--tls-key", "--tls-ca"),
    "runner": ("--auth-file", "--token-file", "--tls-cert", "--tls-key", "--tls-ca", "--signing-key", "--trusted-keys"),
    "openai": ("--api-key-file", "--token-file", "--tls-cert", "--tls-key", "--router-tls-ca"),
}


def test_credentials_come_from_the_components_own_required_secret(objects):
    secrets = credential_secrets()
    for workload in workloads(objects):
        for container in warmserve_containers(workload):
            component, argv = daemon_of(container), container_argv(objects, workload, container)
            own = f"warmserve-{component}"
            volumes = {v["name"]: v for v in pod_spec(workload)["volumes"]}
            mounts = {m["mountPath"]: (volumes[m["name"]], m) for m in container["volumeMounts"]}
            for flag in CREDENTIALS[component]:
                path = flag_value(argv, flag)
                assert path, f"{component}: no {flag}"
                directory, _, key = path.rpartition("/") if flag != "--trusted-keys" else (path, "", "")
                volume, mount = mounts.get(directory, ({}, {}))
                secret = volume.get("secret", {})
                assert secret.get("secretName") == own and not secret.get("optional"), (component, flag, path)
                assert mount.get("readOnly") is True, (component, flag)
                wanted = {i["key"] for i in secret["items"]} if "items" in secret else {key}
                assert wanted <= secrets[own], (component, flag, wanted)
                if flag == "--trusted-keys":  # the public keys alone, one per publisher
                    assert all(i["key"].endswith(".pub") for i in secret["items"]), component
                    assert len(secret["items"]) == len({k for k in secrets[own] if k.endswith(".pub")})
            # a server given a CA requires client certificates (mTLS); the door serves HTTPS to
            # holders of its API key, so the kubelet's HTTPS probe needs no certificate
            assert (flag_value(argv, "--tls-ca") is not None) == (component != "openai"), component
            assert (flag_value(argv, "--health-port") is not None) == (component != "openai"), component


def test_the_router_verifies_runners_dialled_by_ip_by_name(objects):
    import sys

    sys.path.insert(0, str(ROOT / "deploy" / "compose"))
    import make_secrets

    router = workload_running(objects, "router")
    (container,) = warmserve_containers(router)
    name = flag_value(container_argv(objects, router, container), "--tls-server-name")
    assert name in make_secrets.fleet("k8s")["certs"]["runner"], "the runners' certificate carries it"


@pytest.mark.parametrize("component, claim", [("kernel-cache", "kernel-cache"), ("weights", "weights")])
def test_stores_live_on_their_volume_claims(objects, component, claim):
    pvc = named(objects, "PersistentVolumeClaim", claim)
    assert pvc is not None
    workload = workload_running(objects, component)
    (container,) = warmserve_containers(workload)
    args = parsed_args(objects, workload, container)
    volumes = {v["name"] for v in pod_spec(workload)["volumes"]
               if v.get("persistentVolumeClaim", {}).get("claimName") == claim}
    mounts = [m["mountPath"] for m in container["volumeMounts"] if m["name"] in volumes]
    assert any(args.root == m or args.root.startswith(m.rstrip("/") + "/") for m in mounts), (args.root, mounts)
    assert workload["spec"]["replicas"] == 1 and workload["spec"]["strategy"]["type"] == "Recreate"
    if component == "kernel-cache":
        assert 0 < args.max_bytes < byte_count(pvc["spec"]["resources"]["requests"]["storage"])


def test_runner_sidecar_dir_is_a_volume(objects):
    workload = workload_running(objects, "runner")
    (container,) = warmserve_containers(workload)
    args = parsed_args(objects, workload, container)
    assert args.sidecar_dir in [m["mountPath"] for m in container["volumeMounts"]]


# --- scaling, disruption, resources, images ------------------------------------------------------


def test_the_autoscaler_scales_the_runners(objects):
    runner = workload_running(objects, "runner")
    (hpa,) = of_kind(objects, "HorizontalPodAutoscaler")
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"], ref["name"]) == (runner["apiVersion"], runner["kind"],
                                                            runner["metadata"]["name"])
    assert 2 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    assert "replicas" not in runner["spec"], "the autoscaler owns the runners' replica count"
    (container,) = warmserve_containers(runner)
    assert container["resources"]["requests"]["cpu"], "CPU utilisation needs a CPU request"


def test_the_disruption_budget_covers_only_the_runners(objects):
    (pdb,) = of_kind(objects, "PodDisruptionBudget")
    selector = pdb["spec"]["selector"]["matchLabels"]
    selected = [w for w in workloads(objects) if selects(selector, pod_labels(w))]
    assert selected == [workload_running(objects, "runner")]
    assert pdb["spec"]["maxUnavailable"] == 1


def test_one_router(objects):
    router = workload_running(objects, "router")
    assert router["spec"]["replicas"] == 1 and router["spec"]["strategy"]["type"] == "Recreate"


def test_small_cpu_sizes():
    objects = render("overlays/small-cpu")
    (hpa,) = of_kind(objects, "HorizontalPodAutoscaler")
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 4)
    assert workload_running(objects, "router")["spec"]["replicas"] == 1
    assert workload_running(objects, "openai")["spec"]["replicas"] == 1
    runner = workload_running(objects, "runner")
    (container,) = warmserve_containers(runner)
    args = parsed_args(objects, runner, container)
    assert args.threads == 2 and args.max_num_seqs == 8 and args.compile == "aoti"
    assert args.kv_cache_bytes < byte_count(container["resources"]["limits"]["memory"]) / 2


def test_every_container_has_requests_within_limits(objects):
    for workload in workloads(objects):
        spec = pod_spec(workload)
        for container in spec["containers"] + spec.get("initContainers", []):
            resources = container["resources"]
            for resource, parse in (("cpu", cpu), ("memory", byte_count)):
                request, limit = resources["requests"][resource], resources["limits"][resource]
                assert parse(request) <= parse(limit), f"{container['name']} {resource}: {request} > {limit}"


def _images(kustomization: Path) -> list[dict]:
    """The ``images:`` in effect for a kustomization: its own, else its bases'."""
    spec = yaml.safe_load((kustomization / "kustomization.yaml").read_text())
    if spec.get("images"):
        return spec["images"]
    for base in spec.get("bases", []) + spec.get("resources", []):
        if (kustomization / base / "kustomization.yaml").is_file():
            return _images((kustomization / base).resolve())
    return []


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_images_come_from_the_kustomization(kustomization):
    (image,) = [i for i in _images(K8S / kustomization) if i["name"] == "warmserve"]
    expected = f"{image.get('newName', 'warmserve')}:{image.get('newTag', 'latest')}"
    for workload in workloads(render(kustomization)):
        spec = pod_spec(workload)
        for container in spec["containers"] + spec.get("initContainers", []):
            assert container["image"] == expected, container["name"]
            assert container["imagePullPolicy"] == "IfNotPresent", "a loaded image (kind load) is not pulled"
