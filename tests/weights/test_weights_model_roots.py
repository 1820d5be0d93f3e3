"""Limits of the Weights service (issue 23): it serves the bundled model and checkpoints under
its ``--model-root`` directories only, refusing anything else with one sentence that does not
say whether the path exists; Prepare and Fetch take stream slots and Prepare runs on a bounded
pool; a stack passes its model's directory as a root."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from weights_tiny import write_tiny_checkpoint

import weight_service.servicer as servicer_module
from services.bootstrap import ServerConfig
from services.proto import weights_pb2, weights_pb2_grpc
from warmserve.stack_config import PortPlan, StackCommands, StackConfig
from weight_service.model_roots import ModelRoots, NotServed, root_for
from weight_service.servicer import build_server
from weight_service.sources import BUNDLED_SMOLLM2


@pytest.fixture
def roots(tmp_path) -> tuple[Path, Path]:
    """``(served, outside)``: a model root holding checkpoint ``ckpt``, and a directory beside it
    holding another checkpoint ``ckpt`` that the server must not serve."""
    served, outside = tmp_path / "models", tmp_path / "elsewhere"
    for base in (served, outside):
        write_tiny_checkpoint(base / "ckpt", shards=1, tied=True, tokenizer=False)
    return served, outside


@pytest.fixture
def server(tmp_path, roots):
    srv = build_server(ServerConfig(service="weights", port=0, max_streams=2), tmp_path / "sidecars",
                       model_roots=[roots[0]], prepare_workers=1)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def _refused(server, reason: str) -> float:
    return server.registry.get_sample_value("warmserve_refused_total", {"reason": reason}) or 0.0


def _prepare_error(address: str, source: str) -> grpc.RpcError:
    with grpc.insecure_channel(address) as ch, pytest.raises(grpc.RpcError) as err:
        list(weights_pb2_grpc.WeightsStub(ch).Prepare(weights_pb2.PrepareRequest(source=source), timeout=30))
    return err.value


def test_a_readable_checkpoint_outside_the_roots_is_not_served(server, roots, tmp_path):
    served, outside = roots
    err = _prepare_error(server.address, str(outside / "ckpt"))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert not (tmp_path / "sidecars").exists() or list((tmp_path / "sidecars").glob("*ckpt*")) == []
    with grpc.insecure_channel(server.address) as ch, pytest.raises(grpc.RpcError) as fetch:
        list(weights_pb2_grpc.WeightsStub(ch).Fetch(weights_pb2.WeightsFetchRequest(source=str(outside / "ckpt")),
                                                     timeout=30))
    assert fetch.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert _refused(server, "model_root") == 2
    with grpc.insecure_channel(server.address) as ch:  # under the root, the same checkpoint is served
        events = list(weights_pb2_grpc.WeightsStub(ch).Prepare(
            weights_pb2.PrepareRequest(source=str(served / "ckpt")), timeout=60))
    assert events[-1].handle.state == weights_pb2.SIDECAR_STATE_BUILT


def test_a_refusal_does_not_say_whether_the_path_exists(server, roots, tmp_path):
    _served, outside = roots
    (tmp_path / "notes.txt").write_text("x")
    details = set()
    for path in (outside / "ckpt", outside / "no-such-ckpt", tmp_path / "notes.txt", Path("/etc/passwd"),
                 Path("/no/such/dir/model.gguf")):
        err = _prepare_error(server.address, str(path))
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED
        details.add(err.details().replace(repr(str(path)), "SOURCE"))
    assert details == {f"model source SOURCE is not served here: this weight service serves {BUNDLED_SMOLLM2} "
                       "and checkpoints under its --model-root directories only"}


def test_symlinks_and_dotdot_are_resolved_before_the_check(server, roots):
    served, outside = roots
    (served / "link").symlink_to(outside / "ckpt")
    for source in (served / "link", f"{served}/../elsewhere/ckpt", f"{served}/ckpt/../../elsewhere/ckpt"):
        assert _prepare_error(server.address, str(source)).code() == grpc.StatusCode.PERMISSION_DENIED
    (outside / "inward").symlink_to(served / "ckpt")  # a link from outside into a root is that root's
    ModelRoots([served]).check(str(outside / "inward"))


def test_the_bundled_model_is_always_allowed_and_nothing_else_by_default(tmp_path):
    none = ModelRoots()
    none.check(BUNDLED_SMOLLM2)
    none.check(" SmolLM2-135M-Instruct ")
    for source in (str(tmp_path), "relative/dir", "~/model.gguf", "a\x00b"):
        with pytest.raises(NotServed):
            none.check(source)
    assert ModelRoots(["", "  "]).roots == ()


def test_prepare_and_fetch_take_slots_and_prepare_runs_on_a_bounded_pool(server, roots, monkeypatch):
    served, _outside = roots
    release, running = threading.Event(), []
    real = servicer_module.prepare

    def slow_prepare(source, **kwargs):
        running.append(source)
        release.wait(30)
        return real(source, **kwargs)

    monkeypatch.setattr(servicer_module, "prepare", slow_prepare)
    channel = grpc.insecure_channel(server.address)
    stub = weights_pb2_grpc.WeightsStub(channel)
    request = weights_pb2.PrepareRequest(source=str(served / "ckpt"))
    first, second = stub.Prepare(request, timeout=60), stub.Prepare(request, timeout=60)
    try:
        first_events = iter(first)
        deadline = time.monotonic() + 10
        while not running and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)
        assert running == [str(served / "ckpt")]  # one worker: the second Prepare waits for it
        with pytest.raises(grpc.RpcError) as err:  # both stream slots are held
            list(stub.Fetch(weights_pb2.WeightsFetchRequest(fingerprint="0" * 64), timeout=10))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "maximum of 2 concurrent streams" in err.value.details()
        assert _refused(server, "stream_slots") == 1
        assert stub.List(weights_pb2.WeightsListRequest(), timeout=2).sidecars == []
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        release.set()
    assert list(first_events)[-1].HasField("handle") and list(second)[-1].HasField("handle")
    assert len(running) == 2
    channel.close()


def test_the_stack_gives_its_weight_service_the_models_directory(tmp_path):
    assert root_for(BUNDLED_SMOLLM2) is None
    assert root_for("/models/llama") == "/models/llama"
    assert root_for("/models/gguf/m.Q4_1.GGUF") == "/models/gguf"
    assert root_for("rel/m.gguf") == "rel"
    for model, root in ((BUNDLED_SMOLLM2, None), (str(tmp_path / "ckpt"), str(tmp_path / "ckpt"))):
        config = StackConfig(model=model, base_port=0, home=tmp_path)
        argv = StackCommands(config, tmp_path, PortPlan(config)).service("weights")
        assert (argv[argv.index("--model-root") + 1] if "--model-root" in argv else None) == root
