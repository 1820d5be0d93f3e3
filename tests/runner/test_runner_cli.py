"""``warmserve runner serve`` as a real process on a tiny HF checkpoint: it prepares the sidecar
itself, reports ready, serves Generate/ModelInfo/health on loopback, drains on SIGTERM (exit 0);
bad flags exit 2 with a message."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from weights_tiny import write_tiny_checkpoint

from services.proto import generation_pb2 as pb
from services.proto import generation_pb2_grpc


def _serve_cmd(ckpt, sidecars, *extra):
    return [sys.executable, "-m", "warmserve.cli", "runner", "serve", "--model", str(ckpt), "--sidecar-dir",
            str(sidecars), "--port", "0", "--max-model-len", "64", "--kv-cache-bytes", "2000000",
            "--max-num-seqs", "4", "--drain-grace", "2", "--threads", "1", "--compile", "off", *extra]


@pytest.fixture
def tiny_ckpt(tmp_path):
    write_tiny_checkpoint(tmp_path / "ckpt", tokenizer=True, vocab=96)
    return tmp_path / "ckpt"


@contextlib.contextmanager
def _serving(cmd, env=None):
    """Start ``runner serve``, collect its stderr lines, wait for its "ready" log record; yields
    ``(proc, raw_lines, address)`` and kills the process if the test left it running."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    raw: list[str] = []
    ready = threading.Event()

    def read():
        for line in proc.stderr:
            raw.append(line)
            if '"msg": "ready"' in line:
                ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert ready.wait(120), raw[-5:]
        yield proc, raw, json.loads(next(x for x in raw if '"msg": "ready"' in x))["address"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(5)


def _records(raw: list[str]) -> list[dict]:
    out = []
    for line in raw:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def test_runner_serve_prepares_serves_and_drains(tiny_ckpt, tmp_path):
    with _serving(_serve_cmd(tiny_ckpt, tmp_path / "sidecars", "--runner-id", "cli-runner")) as (proc, raw, address):
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            stub = generation_pb2_grpc.GenerationStub(channel)
            msgs = list(stub.Generate(pb.GenerateRequest(
                text="w5 w6 w7", sampling=pb.SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))))
            assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH and msgs[-1].usage.completion_tokens == 5
            assert msgs[-1].usage.prompt_tokens == 3  # 3 words (this tokenizer.json adds no BOS)
            info = stub.ModelInfo(pb.ModelInfoRequest())
            assert info.runner_id == "cli-runner" and info.model == str(tiny_ckpt)
            assert [p.name for p in info.startup.phases] == ["sidecar", "weights", "kv_cache", "prepack", "programs", "warmup"]
            assert "BUILT" in info.startup.phases[0].detail
            assert info.max_model_len == 64 and len(info.sidecar_fingerprint) == 64
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    assert any("startup" in r for r in _records(raw) if r.get("msg") == "ready")


@pytest.mark.parametrize("extra, message", [
    (["--block-size", "0"], "positive integer"),
    (["--max-model-len", "100000"], "max_position_embeddings"),
    (["--compile", "fast"], "invalid choice"),
    (["--weights-dtype", "int3"], "argument --weights-dtype: invalid choice: 'int3'"),
    (["--dtype", "f16"], "argument --dtype: invalid choice: 'f16'"),
    (["--log-level", "loud"], "argument --log-level: invalid choice: 'LOUD'"),
    (["--speculative", "eagle"], "argument --speculative: invalid choice: 'eagle'"),
    (["--num-speculative-tokens", "5"], "expected an integer in [1, 4], got 5"),
    (["--prompt-lookup-max", "33"], "argument --prompt-lookup-max: expected an integer in [1, 32], got 33"),
])
def test_bad_flags_exit_2_with_a_message(tiny_ckpt, tmp_path, extra, message):
    out = subprocess.run(_serve_cmd(tiny_ckpt, tmp_path / "sidecars", *extra), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2
    assert message in out.stderr


@pytest.mark.parametrize("extra, message", [
    (["--speculative", "ngram", "--prompt-lookup-min", "5", "--prompt-lookup-max", "2"],
     "--prompt-lookup-min (5) must be in [1, --prompt-lookup-max (2)]"),
    (["--speculative", "mtp"], "the llama family cannot use --speculative mtp (its methods: ngram)"),
])
def test_speculative_options_that_do_not_go_together_exit_2_before_the_sidecar(tiny_ckpt, tmp_path, extra, message):
    """Refused from the flags and the checkpoint's config.json alone: one line, nothing packed."""
    out = subprocess.run(_serve_cmd(tiny_ckpt, tmp_path / "sidecars", *extra), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == f"warmserve: error: {message}"
    assert "Traceback" not in out.stderr and "preparing the weight sidecar" not in out.stderr
    assert not (tmp_path / "sidecars").exists()


def test_speculative_off_warns_about_the_speculative_flags_it_ignores(caplog):
    from runner_service.options import GIVEN, check_options
    from warmserve.cli import build_parser

    args = build_parser().parse_args(["runner", "serve", "--model", "m", "--num-speculative-tokens", "2",
                                      "--prompt-lookup-min", "2"])
    assert getattr(args, GIVEN) >= {"num_speculative_tokens", "prompt_lookup_min"}
    check_options(vars(args), getattr(args, GIVEN))
    assert "--num-speculative-tokens, --prompt-lookup-min ignored: --speculative is off" in caplog.text
    caplog.clear()
    check_options({**vars(args), "speculative": "ngram"}, getattr(args, GIVEN))
    assert "ignored" not in caplog.text


def test_prefix_caching_is_on_by_default_and_off_with_the_flag():
    from runner_service.daemon import engine_config_from_args
    from warmserve.cli import build_parser

    parser = build_parser()
    on = engine_config_from_args(parser.parse_args(["runner", "serve", "--model", "m"]))
    off = engine_config_from_args(parser.parse_args(["runner", "serve", "--model", "m", "--no-prefix-caching"]))
    assert on.enable_prefix_caching is True and off.enable_prefix_caching is False


def test_sigterm_during_a_background_compile_exits_0_without_aborting(tiny_ckpt, tmp_path):
    """A runner stopped while its programs still compile in the background drains and exits 0;
    the interpreter never tears down under the compile (which aborted it: exit 134)."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))  # a real, slow compile
    cmd = _serve_cmd(tiny_ckpt, tmp_path / "sidecars", "--compile", "aoti", "--kernel-cache-dir", str(tmp_path / "kc"))
    with _serving(cmd, env) as (proc, raw, address):
        with grpc.insecure_channel(address) as channel:
            info = generation_pb2_grpc.GenerationStub(channel).ModelInfo(pb.ModelInfoRequest())
        assert info.program_state == "pending", info.program_detail  # serving eager, compiling
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    text = "".join(raw)
    assert "terminate called" not in text and "stopped with the background compile still running" in text
