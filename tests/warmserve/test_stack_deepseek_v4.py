"""``warmserve up --model DIR`` on a tiny DeepSeek V4 checkpoint (release naming, FP8/FP4,
sharded): the stack packs it, serves it through the router and reports its family and layer
kinds; the greedy text equals transformers'."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from runner_service.tokenizer import Tokenizer
from services.generation_client import GenerationClient, text_request
from services.proto import generation_pb2
from warmserve.stack import LocalStack
from warmserve.stack_config import StackConfig

pytestmark = pytest.mark.slow

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from deepseek_v4_tiny import TINY_ALL_KINDS, write_tiny_deepseek_v4  # noqa: E402


def test_up_serves_a_deepseek_v4_checkpoint(tmp_path):
    reference = write_tiny_deepseek_v4(tmp_path / "dsv4", TINY_ALL_KINDS, quantized=True, shards=2)
    cfg = StackConfig(runners=1, model=str(tmp_path / "dsv4"), base_port=0, home=tmp_path / "home", compile="off",
                      dtype="f32", max_num_seqs=4, stop_grace_s=15, startup_timeout_s=240)
    stack = LocalStack(cfg, progress=None)
    stack.start()
    try:
        info = stack.startup_report(0)
        assert info.family == "deepseek_v4"
        assert list(info.layer_types) == list(reference.config.layer_types)
        text = "w5 w17 w9 w44 w3 w60 w61 w12 w30"
        request = text_request(text, generation_pb2.SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
        with GenerationClient(stack.router_address, security=stack.credentials()) as client:
            result = client.complete(request)
        ids = Tokenizer.from_dir(tmp_path / "dsv4").encode(text)
        prompt = len(ids)
        with torch.no_grad():
            for _ in range(40):
                ids.append(int(reference(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
        assert result.token_ids == ids[prompt:]
        assert result.prompt_tokens == prompt
    finally:
        stack.stop()
