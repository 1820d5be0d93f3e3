"""compose.yaml, run without Docker: every service's command is started on loopback as compose
would run it, with host names mapped to 127.0.0.1, each service's port mapped to a free local
port (two runners both listen on 50061 in their own containers), volume mount points mapped to
temporary directories, and the services' own healthchecks awaited in ``depends_on`` order.
Then a request goes through the router, and the same one through the OpenAI door with the
official ``openai`` client. The replay leaves out the credential flags (cli_flags.CREDENTIAL_FLAGS:
auth files, tokens, TLS, signing keys, the health port: its checks then ask the service's port);
the credentials are checked here by their wiring, and run by ``make compose-test`` in Docker. One-shot services (the volume-owner step, which gives the volumes to the
image's user) have no loopback meaning: the temporary directories are this test's own, and are
left out."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import openai
import pytest
import yaml
from cli_flags import CREDENTIAL_FLAGS, flag_value, parse_command_line

from services.generation_client import GenerationClient, chat_request, sampling_params
from services.ports import free_port

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CONTAINER_STATE = "/var/lib/warmserve"


def _load() -> dict:
    return yaml.safe_load((REPO / "compose.yaml").read_text())


def _daemons(compose: dict) -> dict[str, dict]:
    """The long-running services (each has a healthcheck); the rest run once and exit."""
    return {name: svc for name, svc in compose["services"].items() if "healthcheck" in svc}


def _without_credentials(argv: list[str]) -> list[str]:
    """``argv`` without the flags of :data:`cli_flags.CREDENTIAL_FLAGS` and their values."""
    out, skip = [], False
    for word in argv:
        if skip:
            skip = False
        elif word in CREDENTIAL_FLAGS:
            skip = True
        else:
            out.append(word)
    return out


def _started_after(compose: dict, name: str) -> set[str]:
    """The services ``name`` waits for, directly or through others: healthy, or (one-shots)
    completed successfully; ``service_started`` does not wait for anything to finish."""
    waits = {"service_healthy", "service_completed_successfully"}
    found: set[str] = set()
    todo = [name]
    while todo:
        for dep, cond in compose["services"][todo.pop()].get("depends_on", {}).items():
            if cond.get("condition") in waits and dep not in found:
                found.add(dep)
                todo.append(dep)
    return found


def _image_user() -> str:
    """``uid:gid`` of the Dockerfile's ``USER``."""
    (user,) = re.findall(r"^USER\s+(\d+:\d+)\s*$", (REPO / "Dockerfile").read_text(), re.M)
    return user


def _interpolate(arg: str) -> str:
    """Compose's interpolation of one word: ``${NAME:-default}`` is ``$NAME`` when set and not empty, else ``default``."""
    return re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: os.environ.get(m[1]) or m[2], arg)


def _container_port(command: list[str]) -> str:
    return command[command.index("--port") + 1]


class ComposeOnLoopback:
    """Translates compose services into local processes (see the module docstring)."""

    def __init__(self, compose: dict, tmp: Path) -> None:
        self.services = _daemons(compose)
        self.ports = {name: free_port("127.0.0.1") for name in self.services}
        self.mounts: dict[str, str] = {}
        for svc in self.services.values():
            for vol in svc.get("volumes", []):
                name, target = vol.split(":")[:2]
                if name.startswith("."):  # a read-only bind of credentials (left out: see above)
                    continue
                self.mounts[target] = str(tmp / name)
                (tmp / name).mkdir(exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs = tmp / "logs"
        self.logs.mkdir()
        self.rootfs = tmp / "rootfs"

    def _arg(self, service: str, arg: str) -> str:
        arg = _interpolate(arg)
        if arg == "python":
            return sys.executable
        if arg == "0.0.0.0":
            return "127.0.0.1"
        for target, local in self.mounts.items():
            if arg == target or arg.startswith(target + "/"):
                return local + arg[len(target):]
        if arg.startswith(CONTAINER_STATE):  # container-private state (no volume)
            return str(self.rootfs) + arg
        host, sep, port = arg.rpartition(":")
        if sep and port.isdigit():
            if host in self.services and port == _container_port(self.services[host]["command"]):
                return f"127.0.0.1:{self.ports[host]}"
            own = self.services[service]["command"]
            if host == "127.0.0.1" and port in (_container_port(own), flag_value(own, "--health-port")):
                return f"127.0.0.1:{self.ports[service]}"  # a healthcheck of the service itself
        if service and arg == _container_port(self.services[service]["command"]):
            return str(self.ports[service])
        return arg

    def command(self, name: str) -> list[str]:
        argv = [self._arg(name, a) for a in _without_credentials(self.services[name]["command"])]
        if argv[3:5] == ["runner", "serve"]:  # not a compile test: no background compile on 2 cores
            argv += ["--compile", "off"]
        return argv

    def healthcheck(self, name: str) -> list[str]:
        test = self.services[name]["healthcheck"]["test"]
        assert test[0] == "CMD"
        return [self._arg(name, a) for a in _without_credentials(test[1:])]

    def env(self, name: str) -> dict[str, str]:
        env = dict(os.environ)
        for k, v in self.services[name].get("environment", {}).items():
            env[k] = self._arg(name, str(v))
        return env

    def order(self) -> list[str]:
        done: list[str] = []
        while len(done) < len(self.services):
            for name, svc in self.services.items():
                deps = [d for d in svc.get("depends_on", {}) if d in self.services]  # one-shots left out
                if name not in done and all(d in done for d in deps):
                    done.append(name)
        return done

    def wait_healthy(self, name: str, timeout_s: float = 300) -> None:
        end = time.monotonic() + timeout_s
        while subprocess.run(self.healthcheck(name), cwd=REPO, capture_output=True).returncode != 0:
            proc = self.procs[name]
            assert proc.poll() is None, f"{name} exited: {(self.logs / name).read_text()[-3000:]}"
            assert time.monotonic() < end, f"{name} not healthy"
            time.sleep(0.3)

    def up(self) -> None:
        for name in self.order():
            for dep, cond in self.services[name].get("depends_on", {}).items():
                if cond.get("condition") == "service_healthy" and dep in self.services:
                    self.wait_healthy(dep)
            with open(self.logs / name, "wb") as log:
                self.procs[name] = subprocess.Popen(self.command(name), cwd=REPO, env=self.env(name),
                                                    stdout=log, stderr=log)

    def down(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_compose_file_shape() -> None:
    compose = _load()
    services = _daemons(compose)
    # docker-compose 1.29 rejects a top-level `name:` (the project name is `-p`); Compose v2 reads both
    assert set(compose) == {"services", "volumes", "secrets"} | {k for k in compose if k.startswith("x-")}
    assert set(services) == {"kernel-cache", "weights", "runner-0", "runner-1", "router", "openai"}
    assert set(compose["services"]) == set(services) | {"volume-owner"}
    assert set(compose["volumes"]) == {"kernel-cache", "sidecars"}
    for name, svc in compose["services"].items():
        assert svc["build"] == {"context": ".", "args": {"BASE_IMAGE": "${WARMSERVE_BASE_IMAGE:-python:3.11-slim}"}}
        assert svc["image"] == "warmserve:latest", name
    for name, svc in services.items():
        assert "--host" in svc["command"], name
        # a crashed process is restarted (deploy/compose/compose_test.py kills one and watches)
        assert svc["restart"] == "unless-stopped", name
        assert svc["command"][svc["command"].index("--host") + 1] == "0.0.0.0", name
        probe = "openai_service.healthcheck" if name == "openai" else "services.healthcheck"  # HTTP / gRPC
        assert svc["healthcheck"]["test"][1:4] == ["python", "-m", probe], name
        assert all(p.startswith("127.0.0.1:") for p in svc.get("ports", [])), name  # published on loopback only
    assert services["router"]["ports"] == ["127.0.0.1:${WARMSERVE_ROUTER_PORT:-50050}:50050"]
    assert services["openai"]["ports"] == ["127.0.0.1:${WARMSERVE_OPENAI_PORT:-50053}:50053"]
    assert services["openai"]["command"][3:7] == ["openai", "serve", "--router", "router:50050"]
    for runner in ("runner-0", "runner-1"):
        assert "sidecars:/var/lib/warmserve/sidecars" in services[runner]["volumes"]
    assert "sidecars:/var/lib/warmserve/sidecars" in services["weights"]["volumes"]
    assert "kernel-cache:/var/lib/warmserve/kernel-cache" in services["kernel-cache"]["volumes"]


def test_every_compose_command_is_real_options_with_valid_values() -> None:
    """Each service's command uses only options of its command, spelled in full, with values the
    real parser accepts; a runner's flags are declared runner options (or the server's)."""
    import argparse

    from runner_service.options import RUNNER_OPTIONS
    from services.bootstrap import add_server_args
    from services.signing import add_signing_args

    server = argparse.ArgumentParser()
    add_server_args(server, default_port=0)
    add_signing_args(server)
    declared = {o.flag for o in RUNNER_OPTIONS} | set(server._option_string_actions)
    for name, svc in _daemons(_load()).items():
        command = svc["command"]
        assert command[:3] == ["python", "-m", "warmserve.cli"], name
        args = parse_command_line([_interpolate(w) for w in command[3:]])
        assert args.host == "0.0.0.0", name
        if command[3:5] == ["runner", "serve"]:
            assert {w for w in command if w.startswith("--")} <= declared, name


def test_compose_takes_each_services_own_credentials_from_secrets() -> None:
    """Every credential flag names a compose secret (/run/secrets/NAME) the service lists, whose
    file is one ``make compose-secrets`` writes under the git-ignored deploy/compose/secrets/; no
    service gets another's key or token; servers require client certificates (the door: HTTPS and
    its API key); healthchecks ask the plaintext --health-port; nothing reaches the image."""
    import sys

    sys.path.insert(0, str(REPO / "deploy" / "compose"))
    import make_secrets

    compose = _load()
    made = set(make_secrets.expected_files(make_secrets.fleet("compose")))
    files = {}
    for secret, spec in compose["secrets"].items():
        rel = spec["file"].removeprefix("./deploy/compose/secrets/")
        assert spec["file"].startswith("./deploy/compose/secrets/") and rel in made, secret
        files[secret] = rel
    owners: dict[str, set[str]] = {}
    for name, svc in _daemons(compose).items():
        command, wanted = svc["command"], set()
        for flag in ("--auth-file", "--token-file", "--tls-cert", "--tls-key", "--tls-ca", "--signing-key",
                     "--api-key-file", "--router-tls-ca"):
            path = flag_value(command, flag)
            if path is not None:
                assert path.startswith("/run/secrets/"), (name, flag)
                wanted.add(path.removeprefix("/run/secrets/"))
        assert wanted <= set(svc["secrets"]) and set(svc["secrets"]) - wanted <= {"ca"}, name
        for secret in svc["secrets"]:
            owners.setdefault(secret, set()).add(name)
        is_door = command[3:5] == ["openai", "serve"]
        assert (flag_value(command, "--tls-ca") is not None) != is_door, f"{name}: mTLS (the door: HTTPS + key)"
        # every hop inside the stack is mTLS: the door dials the router verifying it against the CA
        assert (flag_value(command, "--router-tls-ca") is not None) == is_door, name
        assert flag_value(command, "--tls-cert") and flag_value(command, "--tls-key"), name
        if not is_door:
            assert svc["healthcheck"]["test"][-1] == f"127.0.0.1:{flag_value(command, '--health-port')}", name
            assert flag_value(command, "--auth-file"), name
        if command[3:5] == ["runner", "serve"]:
            assert f"./deploy/compose/secrets/trusted:{flag_value(command, '--trusted-keys')}:ro" in svc["volumes"]
            runner_id = flag_value(command, "--runner-id")
            for flag in ("--token-file", "--tls-key", "--signing-key"):  # per runner: its own
                assert runner_id in files[flag_value(command, flag).removeprefix("/run/secrets/")], (name, flag)
    for secret, users in owners.items():
        if files[secret].endswith((".key", ".token")):
            assert len(users) == 1, f"{secret} is given to {sorted(users)}"
    assert "/deploy/compose/secrets/" in (REPO / ".gitignore").read_text().split()
    assert "deploy" in (REPO / ".dockerignore").read_text().split()


def test_compose_services_are_hardened() -> None:
    """Every daemon: the image's user, a read-only root, no capabilities, no-new-privileges; its
    writable places are its volumes and tmpfs mounts that allow exec (AOTI dlopens the .so it
    unpacks under $TMPDIR; a runner loads its programs from $WARMSERVE_HOME/programs). The one
    root step, volume-owner, holds only CHOWN and DAC_READ_SEARCH, gives every named volume to the
    image's user, runs once, and the daemons on those volumes start after it succeeded."""
    compose = _load()
    user = _image_user()
    daemons = _daemons(compose)
    for name, svc in compose["services"].items():
        assert svc["read_only"] is True and svc["cap_drop"] == ["ALL"], name
        assert svc["security_opt"] == ["no-new-privileges:true"], name
        assert not svc.get("privileged") and not svc.get("network_mode") and not svc.get("pid"), name
    for name, svc in daemons.items():
        assert svc["user"] == user and "cap_add" not in svc, name
        env = svc["environment"]
        assert env["TMPDIR"] == env["HOME"] == "/tmp" and env["WARMSERVE_HOME"] == CONTAINER_STATE, name
        tmpfs = {t.split(":")[0]: t.split(":")[1].split(",") for t in svc["tmpfs"]}
        writable = [*tmpfs, *(v.split(":")[1] for v in svc.get("volumes", []) if not v.endswith(":ro"))]
        assert "exec" in tmpfs["/tmp"] and "noexec" not in tmpfs["/tmp"], name
        if "runner" in svc["command"]:
            programs = f"{CONTAINER_STATE}/programs"
            assert "exec" in tmpfs[programs] and f"uid={user.split(':')[0]}" in tmpfs[programs], name
            sidecars = svc["command"][svc["command"].index("--sidecar-dir") + 1]
            assert sidecars in writable, name
        if "--root" in svc["command"]:
            assert svc["command"][svc["command"].index("--root") + 1] in writable, name
        for vol in svc.get("volumes", []):
            if vol.startswith("./"):  # credentials: read-only binds from the git-ignored secrets dir
                assert vol.startswith("./deploy/compose/secrets/") and vol.endswith(":ro"), f"{name}: {vol}"
                continue
            assert vol.split(":")[0] in compose["volumes"], f"{name}: {vol} (only named volumes)"
            assert "volume-owner" in _started_after(compose, name), f"{name} may start before its volumes are its own"
    owner = compose["services"]["volume-owner"]
    assert owner["user"] == "0:0" and sorted(owner["cap_add"]) == ["CHOWN", "DAC_READ_SEARCH"]
    assert owner["restart"] == "no" and "healthcheck" not in owner
    assert sorted(v.split(":")[0] for v in owner["volumes"]) == sorted(compose["volumes"])
    targets = [v.split(":")[1] for v in owner["volumes"]]
    assert owner["command"][0] == "find" and owner["command"][1:1 + len(targets)] == targets
    assert owner["command"][-5:] == ["chown", "-h", user, "{}", "+"]


def test_dockerfile_builds_from_the_wheelhouse() -> None:
    """The base is a build argument (python:3.11-slim by default); every Python package comes
    from the wheelhouse in the build context, no index is named; the image gets every package
    pyproject.toml ships (the source is copied package by package, the wheelhouse left out)."""
    dockerfile = (REPO / "Dockerfile").read_text()
    lines = [line.strip() for line in dockerfile.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert lines[0] == "ARG BASE_IMAGE=python:3.11-slim"
    assert [line for line in lines if line.startswith("FROM")] == [
        "FROM ${BASE_IMAGE} AS base", "FROM base AS deps", "FROM base"]
    assert "make install" in dockerfile and "--no-index" in dockerfile
    assert "http" not in "\n".join(lines) and "--index-url" not in dockerfile
    include = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.removesuffix("*") for p in include}
    copied = {line.split()[1].rstrip("/") for line in lines if line.startswith("COPY ") and "--from" not in line}
    assert packages <= copied, packages - copied
    assert "." not in copied and ".wheelhouse/" not in {line.split()[1] for line in lines[lines.index("FROM base"):]
                                                        if line.startswith("COPY ")}
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".git", ".venv*", "**/node_modules"} <= set(ignored) and ".wheelhouse" not in ignored


def test_compose_services_run_on_loopback_and_serve_a_request(tmp_path: Path) -> None:
    stack = ComposeOnLoopback(_load(), tmp_path)
    try:
        stack.up()
        for name in stack.order():
            stack.wait_healthy(name)
        router = f"127.0.0.1:{stack.ports['router']}"
        runner0 = f"127.0.0.1:{stack.ports['runner-0']}"
        request = chat_request([("user", "What is the capital of France?")], sampling_params(max_tokens=16))
        end = time.monotonic() + 30
        with GenerationClient(router) as client:
            while True:  # static runners are admitted by the router's first health checks
                try:
                    routed = client.complete(request, timeout_s=120)
                    break
                except Exception:
                    assert time.monotonic() < end
                    time.sleep(0.3)
        with GenerationClient(runner0) as client:
            direct = client.complete(request, timeout_s=120)
        assert routed.runner_id in ("runner-0", "runner-1")
        assert routed.text.strip() and routed.text == direct.text
        assert routed.completion_tokens == direct.completion_tokens > 0
        # The OpenAI door (healthy once the router had a READY runner) gives the same answer.
        door = f"http://127.0.0.1:{stack.ports['openai']}/v1"
        with openai.OpenAI(base_url=door, api_key="unused", max_retries=0) as client:
            assert [m.id for m in client.models.list().data] == ["smollm2-135m-instruct"]
            answer = client.chat.completions.create(model="smollm2-135m-instruct", max_tokens=16, messages=[
                {"role": "user", "content": "What is the capital of France?"}])
        assert answer.choices[0].message.content == routed.text
        assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (routed.prompt_tokens,
                                                                              routed.completion_tokens)
    finally:
        stack.down()
