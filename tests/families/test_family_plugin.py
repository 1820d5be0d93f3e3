"""A new model family is added by adding files only: a test-only toy family (a one-layer MLP
"bigram" model with its own config, pack spec and a KV layout of zero pools) is registered from
this test, packed into a sidecar by the weight service and served by the engine end to end.

The reference is first principles: the toy's next token depends on the current token only, so
its greedy continuation is a walk over ``argmax`` of a [V, V] logits table computed here with
numpy straight from the checkpoint file's arrays."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.numpy import load_file
from safetensors.torch import save_file
from weights_tiny import write_word_tokenizer

import model_families
from model_families.family import CacheSpec, Checkpoint, FamilyConfig, FamilyModel, FamilyWeights, ModelFamily
from runner_service.config import EngineConfig
from runner_service.engine import LLMEngine
from runner_service.sampling_params import SamplingParams
from services.errors import InvalidArgument
from weight_service.prepare import prepare

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB, HIDDEN = 24, 16


@dataclass(frozen=True)
class ToyConfig(FamilyConfig):
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int = 1
    max_position_embeddings: int = 64
    eos_token_id: int | None = None
    architecture: str = "ToyBigramForCausalLM"

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return () if self.eos_token_id is None else (self.eos_token_id,)


@dataclass
class ToyWeights(FamilyWeights):
    embed: torch.Tensor    # [V, H]
    up: torch.Tensor       # [1, H, H] (stacked over the one layer)
    head: torch.Tensor     # [V, H]


class ToyModel(FamilyModel):
    """logits = head @ relu(up @ embed[token]): reads no cache at all."""

    def __init__(self, config: ToyConfig, weights: ToyWeights) -> None:
        super().__init__()
        self.config = config
        for name, t in weights.tensors().items():
            self.register_buffer(name, t, persistent=False)

    def forward(self, caches, input_ids, positions, slot_mapping, block_tables, seq_lens, last_index):
        assert caches == ()
        h = F.embedding(input_ids, self.embed)
        h = F.relu(F.linear(h, self.up[0]))
        last = h[torch.arange(input_ids.shape[0]), last_index]
        return F.linear(last, self.head).float()


class ToyFamily(ModelFamily):
    name = "toy-bigram"
    architectures = frozenset({"ToyBigramForCausalLM"})
    pack_version = "1"
    config_class = ToyConfig

    def config_from_hf(self, hf: Mapping, has_tensor: Callable[[str], bool] = lambda _n: False) -> ToyConfig:
        return ToyConfig(vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
                         eos_token_id=hf.get("eos_token_id"))

    def tensor_shapes(self, config: ToyConfig) -> dict[str, tuple[int, ...]]:
        V, H = config.vocab_size, config.hidden_size
        return {"embed": (V, H), "layers.up": (1, H, H), "head": (V, H)}

    def global_tensors(self, ckpt: Checkpoint, weights_dtype: str = "f32") -> dict[str, torch.Tensor]:
        return {"embed": ckpt.tensor("toy.embed"), "head": ckpt.tensor("toy.head")}

    def layer_tensors(self, ckpt: Checkpoint, layer: int, weights_dtype: str = "f32") -> dict[str, torch.Tensor]:
        return {"layers.up": ckpt.tensor(f"toy.layers.{layer}.up")}

    def load_weights(self, config, tensors, dtype, device, weights_dtype="f32") -> ToyWeights:
        return ToyWeights(**{n.removeprefix("layers."): tensors[n].to(device=device, dtype=dtype)
                             for n in self.tensor_shapes(config)})

    def cache_specs(self, config: ToyConfig, block_size: int) -> tuple[CacheSpec, ...]:
        return ()

    def build_model(self, config: ToyConfig, weights: ToyWeights, max_model_len: int) -> ToyModel:
        return ToyModel(config, weights)

    def program_sources(self) -> list[ModuleType]:
        import sys

        return [sys.modules[__name__]]


@pytest.fixture
def toy_family():
    family = ToyFamily()
    model_families.register_family(family)
    yield family
    model_families.unregister_family(family.name)


def _write_checkpoint(directory: Path) -> None:
    g = torch.Generator().manual_seed(7)
    sd = {"toy.embed": torch.randn(VOCAB, HIDDEN, generator=g), "toy.head": torch.randn(VOCAB, HIDDEN, generator=g),
          "toy.layers.0.up": torch.randn(HIDDEN, HIDDEN, generator=g)}
    directory.mkdir(parents=True)
    save_file(sd, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["ToyBigramForCausalLM"], "vocab_size": VOCAB, "hidden_size": HIDDEN, "eos_token_id": 2}))
    write_word_tokenizer(directory, VOCAB)


def _greedy_reference(ckpt: Path, prompt: list[int], n: int, eos: int | None = 2) -> list[int]:
    """The greedy continuation from the checkpoint's raw arrays (argmax over a [V, V] table),
    ending after ``eos`` when given."""
    a = load_file(str(ckpt / "model.safetensors"))
    table = np.maximum(a["toy.embed"] @ a["toy.layers.0.up"].T, 0) @ a["toy.head"].T  # [V, V]
    out, token = [], prompt[-1]
    for _ in range(n):
        token = int(table[token].argmax())
        out.append(token)
        if token == eos:
            break
    return out


def test_a_family_registered_from_a_test_is_packed_and_served_end_to_end(toy_family, tmp_path):
    ckpt = tmp_path / "toy-ckpt"
    _write_checkpoint(ckpt)
    handle = prepare(str(ckpt), dtype="f32", root=tmp_path / "sidecars")
    assert handle.family == "toy-bigram" and handle.state == "BUILT"
    engine = LLMEngine.from_sidecar(handle.path, EngineConfig(max_num_seqs=4, block_size=4, max_model_len=64,
                                                              device="cpu", warmup=True))
    try:
        assert engine.family == "toy-bigram" and engine.kv.tensors == () and engine.kv.nbytes == 0
        prompts = [[5, 9, 11], [3], [17, 4]]
        streams = [engine.add_request(SamplingParams(max_tokens=12, temperature=0), token_ids=p) for p in prompts]
        engine.run_until_done()
        for prompt, stream in zip(prompts, streams, strict=True):
            got = stream.result(timeout=5).token_ids
            assert got == _greedy_reference(ckpt, prompt, 12)
        assert engine.stats()["kv_blocks_used"] == 0  # every block went back
        text = engine.add_request(SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), text="w5 w9")
        engine.run_until_done()
        assert text.result(timeout=5).text.split() == [f"w{t}" for t in _greedy_reference(ckpt, [9], 3, eos=None)]
    finally:
        engine.close()
    # a float-only family: no quantized layout, and `auto` falls back to f32
    with pytest.raises(InvalidArgument, match="toy-bigram family packs weights dtypes f32, bf16, not 'int4'"):
        prepare(str(ckpt), dtype="int4", root=tmp_path / "sidecars")
    assert prepare(str(ckpt), dtype="auto", root=tmp_path / "sidecars").path == handle.path
    # the family is known to the registry only while registered
    model_families.unregister_family("toy-bigram")
    with pytest.raises(InvalidArgument, match="ToyBigramForCausalLM"):
        prepare(str(ckpt), dtype="f32", root=tmp_path / "other")
    model_families.register_family(toy_family)


def test_registry_rejects_clashes_and_names_what_it_knows(toy_family):
    with pytest.raises(InvalidArgument, match="already registered"):
        model_families.register_family(ToyFamily())
    assert model_families.family_for_architecture("ToyBigramForCausalLM") is toy_family
    assert model_families.get_family("llama").name == "llama"
    with pytest.raises(InvalidArgument, match="LlamaForCausalLM"):
        model_families.family_for_architecture("GPT2LMHeadModel")
    with pytest.raises(InvalidArgument, match="known: .*llama"):
        model_families.get_family("gpt2")
