"""The runner honours the sidecar's generation_config.json: it stops on every EOS id listed
there (as well as config.json's), a request's unset max_tokens / temperature / top_k / top_p
take the file's defaults while set ones (0 included) win, and ModelInfo reports both. Tiny
random safetensors checkpoints, packed by the weight service, served over gRPC on loopback."""

from __future__ import annotations

import json
import logging

import grpc
import pytest
from weights_tiny import write_tiny_checkpoint, write_tiny_gguf

from runner_service.config import EngineConfig
from runner_service.engine import LLMEngine
from runner_service.generation_config import GenerationConfig
from runner_service.sampling_params import SamplingDefaults, SamplingParams
from runner_service.sequence import FinishReason
from runner_service.servicer import GenerationServicer
from services.bootstrap import ServerConfig, ServiceServer
from services.proto import generation_pb2 as pb
from services.proto import generation_pb2_grpc
from weight_service.prepare import prepare

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = [5, 9, 11]
CONFIG_EOS = (2, 3)  # write_tiny_checkpoint's config.json eos_token_id
CFG = EngineConfig(max_num_seqs=4, block_size=4, max_model_len=128, warmup=False)
# Sampling defaults of the "chat" checkpoint; a high temperature so that sampling visibly
# differs from greedy on this tiny random model.
DEFAULTS = {"do_sample": True, "max_new_tokens": 3, "temperature": 4.0, "top_k": 20, "top_p": 0.95}


def _run(engine: LLMEngine, params: SamplingParams) -> tuple[list[int], FinishReason]:
    stream = engine.add_request(params, token_ids=PROMPT)
    engine.run_until_done()
    out = stream.result(timeout=0)
    return out.token_ids, out.finish_reason


def _sidecar(tmp_path, name: str, generation_config: dict | None):
    ckpt = tmp_path / name
    write_tiny_checkpoint(ckpt, tokenizer=True)
    if generation_config is not None:
        (ckpt / "generation_config.json").write_text(json.dumps(generation_config))
    return prepare(str(ckpt), root=tmp_path / "sc").path


@pytest.fixture(scope="module")
def greedy(tmp_path_factory):
    """The tiny model's own greedy continuation of PROMPT (no generation config; EOS ignored)."""
    path = _sidecar(tmp_path_factory.mktemp("plain"), "ckpt", None)
    engine = LLMEngine.from_sidecar(path, CFG)
    tokens, reason = _run(engine, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert reason is FinishReason.LENGTH and len(tokens) == 8
    return tokens


def test_an_extra_eos_in_generation_config_stops_generation_there(tmp_path, greedy):
    # The extra EOS: the first greedy token at index >= 2 that config.json does not list.
    index = next(i for i, t in enumerate(greedy) if i >= 2 and t not in CONFIG_EOS and t not in greedy[:i])
    extra = greedy[index]
    assert not set(greedy[:index]) & set(CONFIG_EOS)  # nothing would stop it earlier

    plain = LLMEngine.from_sidecar(_sidecar(tmp_path, "plain", None), CFG)
    assert _run(plain, SamplingParams(max_tokens=8, temperature=0)) == (greedy, FinishReason.LENGTH)

    # Several released instruct models list their end-of-turn id only in generation_config.json.
    chat = LLMEngine.from_sidecar(_sidecar(tmp_path, "chat", {"eos_token_id": [2, extra]}), CFG)
    assert chat.eos_token_ids == (*CONFIG_EOS, extra)
    assert _run(chat, SamplingParams(max_tokens=8, temperature=0)) == (greedy[: index + 1], FinishReason.STOP)
    assert _run(chat, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)) == (greedy, FinishReason.LENGTH)


@pytest.fixture(scope="module")
def served(tmp_path_factory, greedy):
    """Two runners over gRPC: ``chat`` (generation_config.json with DEFAULTS and an extra EOS 50)
    and ``plain`` (none)."""
    tmp = tmp_path_factory.mktemp("served")
    engines = {"chat": LLMEngine.from_sidecar(_sidecar(tmp, "chat", {"eos_token_id": 50, **DEFAULTS}), CFG),
               "plain": LLMEngine.from_sidecar(_sidecar(tmp, "plain", None), CFG)}
    servers, channels, stubs = [], [], {}
    try:
        for name, engine in engines.items():
            engine.start()
            server = ServiceServer(ServerConfig(service="runner"), [
                (generation_pb2_grpc.add_GenerationServicer_to_server, GenerationServicer(engine, name),
                 "warmserve.v1.Generation")])
            server.start()
            servers.append(server)
            channels.append(grpc.insecure_channel(server.address))
            stubs[name] = generation_pb2_grpc.GenerationStub(channels[-1])
        yield stubs, engines
    finally:
        for channel in channels:
            channel.close()
        for server in servers:
            server.stop()
        for engine in engines.values():
            engine.close()


def _generate(stub, **sampling) -> tuple[list[int], int]:
    msgs = list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT),
                                                 sampling=pb.SamplingParams(ignore_eos=True, **sampling))))
    assert msgs[-1].usage.completion_tokens == sum(len(m.token_ids) for m in msgs)
    return [t for m in msgs for t in m.token_ids], msgs[-1].finish_reason


def test_unset_sampling_fields_take_the_generation_config_defaults_and_set_ones_win(served, greedy):
    stubs, _ = served
    chat = stubs["chat"]
    # max_new_tokens 3 when max_tokens is unset (or 0); an explicit max_tokens overrides it.
    assert len(_generate(chat, seed=1)[0]) == 3
    assert len(_generate(chat, seed=1, max_tokens=0)[0]) == 3
    assert _generate(chat, temperature=0, max_tokens=6) == (greedy[:6], pb.FINISH_REASON_LENGTH)
    # Unset temperature/top_k/top_p sample with the file's values: the same tokens as the same
    # weights asked for them explicitly, and not the greedy ones. (The reference goes through the
    # "plain" runner's gRPC door too: its engine loop is running, so the test thread must not
    # step that engine itself.)
    sampled, _ = _generate(chat, seed=1, max_tokens=8)
    reference, _ = _generate(stubs["plain"], seed=1, max_tokens=8, temperature=4.0, top_k=20, top_p=0.95)
    assert sampled == reference and sampled != greedy
    # Set to 0, a field is 0, not "unset": temperature 0 is greedy whatever the default (and the
    # seed); top_k 1 keeps only the most likely token, whatever the default temperature.
    assert _generate(chat, seed=1, max_tokens=8, temperature=0.0)[0] == greedy
    assert _generate(chat, seed=1, max_tokens=8, top_k=1)[0] == greedy
    # Without a generation config the runner's defaults apply: 64 tokens, greedy.
    tokens, reason = _generate(stubs["plain"])
    assert len(tokens) == CFG.default_max_tokens == 64 and tokens[:8] == greedy and reason == pb.FINISH_REASON_LENGTH


def test_model_info_reports_eos_ids_and_sampling_defaults(served):
    stubs, _ = served
    info = stubs["chat"].ModelInfo(pb.ModelInfoRequest())
    assert list(info.eos_token_ids) == [*CONFIG_EOS, 50]
    d = info.default_sampling
    assert all(d.HasField(f) for f in ("max_tokens", "temperature", "top_k", "top_p"))
    assert (d.max_tokens, d.top_k) == (3, 20)
    assert (d.temperature, d.top_p) == (pytest.approx(4.0), pytest.approx(0.95))
    info = stubs["plain"].ModelInfo(pb.ModelInfoRequest())
    assert list(info.eos_token_ids) == list(CONFIG_EOS)
    d = info.default_sampling
    assert (d.max_tokens, d.temperature, d.top_k, d.top_p) == (64, 0.0, 0, 1.0)


def test_a_gguf_end_of_turn_id_stops_generation_and_its_sampling_keys_are_the_defaults(tmp_path):
    def extra(w):
        w.add_eot_token_id(7)
        w.add_sampling_temp(0.6)
        w.add_sampling_top_p(0.9)

    write_tiny_gguf(tmp_path / "chat.gguf", metadata=extra)
    engine = LLMEngine.from_sidecar(prepare(str(tmp_path / "chat.gguf"), dtype="f32", root=tmp_path / "sc").path, CFG)
    assert engine.args.eos_token_ids == (2,)  # config.json has the EOS only
    assert engine.eos_token_ids == (2, 7) and engine.scheduler.eos_token_ids == {2, 7}
    assert engine.sampling_defaults == SamplingDefaults(max_tokens=64, temperature=0.6, top_k=0, top_p=0.9)


def test_unset_differs_from_zero_on_the_wire():
    unset, zero = pb.SamplingParams(), pb.SamplingParams(temperature=0.0, top_k=0, top_p=0.0, max_tokens=0)
    again = pb.SamplingParams.FromString(zero.SerializeToString())
    assert not any(unset.HasField(f) for f in ("max_tokens", "temperature", "top_k", "top_p"))
    assert all(again.HasField(f) for f in ("max_tokens", "temperature", "top_k", "top_p"))


def test_bad_values_in_generation_config_are_ignored_with_a_warning(caplog):
    data = {"eos_token_id": [2, 96, -1, True, "7", 9], "max_new_tokens": 0, "temperature": -1,
            "top_k": 2.5, "top_p": 1.5}
    with caplog.at_level(logging.WARNING, logger="runner_service.generation_config"):
        cfg = GenerationConfig.from_dict(data, vocab_size=96)
    assert cfg == GenerationConfig(eos_token_ids=(2, 9))
    assert len(caplog.records) == 8  # four bad EOS ids, four bad sampling values
    assert cfg.sampling_defaults(64) == SamplingDefaults(max_tokens=64, temperature=0.0, top_k=0, top_p=1.0)
    # Nulls are absent, an int EOS is one id; a good value is kept (floats as floats).
    assert GenerationConfig.from_dict({"eos_token_id": 5, "temperature": 1, "top_p": None}) == GenerationConfig(
        eos_token_ids=(5,), temperature=1.0)


def test_an_unreadable_generation_config_in_the_sidecar_is_ignored(tmp_path, caplog):
    (tmp_path / "generation_config.json").write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="runner_service.generation_config"):
        assert GenerationConfig.from_dir(tmp_path) == GenerationConfig()
    assert "generation_config.json" in caplog.text
    assert GenerationConfig.from_dir(tmp_path / "absent") == GenerationConfig()
