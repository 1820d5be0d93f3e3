"""Tiny Llama-family models for runner tests (test helper).

:func:`hf_reference` builds a randomly initialised transformers model (the independent
reference) and :func:`weights_from_hf` stacks its parameters into the sidecar layout the runner
consumes, so the runner's forward can be compared with transformers' on the same numbers.
"""

from __future__ import annotations

import random

import torch

from model_families.llama.config import LlamaConfig
from model_families.llama.model import LlamaWeights
from runner_service.config import EngineConfig


def tiny_args(*, vocab=128, hidden=64, inter=96, layers=2, heads=4, kv_heads=2, head_dim=16, max_pos=512,
              tied=True, bias=False, rope_scaling=None, architecture="LlamaForCausalLM", eos=(1,)) -> LlamaConfig:
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-5,
                       rope_theta=10000.0, rope_scaling=rope_scaling, max_position_embeddings=max_pos,
                       tie_word_embeddings=tied, attention_bias=bias, bos_token_id=None, eos_token_id=list(eos),
                       architecture=architecture)


def hf_reference(args: LlamaConfig, seed: int = 0):
    """A transformers ``LlamaForCausalLM`` (or ``Qwen2ForCausalLM`` when ``attention_bias``) with
    ``args``' shape and random weights, float32, eval mode."""
    import transformers

    rope = {"rope_type": args.rope_type, "rope_theta": args.rope_theta, **(args.rope_scaling or {})}
    common = dict(vocab_size=args.vocab_size, hidden_size=args.hidden_size,
                  intermediate_size=args.intermediate_size, num_hidden_layers=args.num_hidden_layers,
                  num_attention_heads=args.num_attention_heads, num_key_value_heads=args.num_key_value_heads,
                  rms_norm_eps=args.rms_norm_eps, max_position_embeddings=args.max_position_embeddings,
                  tie_word_embeddings=args.tie_word_embeddings, rope_parameters=rope)
    torch.manual_seed(seed)
    if args.attention_bias:
        cfg = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(head_dim=args.head_dim, **common)
        model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # larger than default init so that differences would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    return model.eval()


def weights_from_hf(model, args: LlamaConfig) -> LlamaWeights:
    """Stack a transformers Llama/Qwen2 state dict into the sidecar layout."""
    sd = model.state_dict()
    L = args.num_hidden_layers

    def stack(fmt):
        return torch.stack([sd[fmt.format(i)] for i in range(L)])

    p = "model.layers.{}."
    tensors = {
        "embed_tokens": sd["model.embed_tokens.weight"],
        "final_norm": sd["model.norm.weight"],
        "layers.input_norm": stack(p + "input_layernorm.weight"),
        "layers.post_attn_norm": stack(p + "post_attention_layernorm.weight"),
        "layers.qkv_proj": torch.stack([torch.cat([sd[f"model.layers.{i}.self_attn.{x}_proj.weight"]
                                                   for x in "qkv"]) for i in range(L)]),
        "layers.o_proj": stack(p + "self_attn.o_proj.weight"),
        "layers.gate_up_proj": torch.stack([torch.cat([sd[f"model.layers.{i}.mlp.gate_proj.weight"],
                                                       sd[f"model.layers.{i}.mlp.up_proj.weight"]])
                                            for i in range(L)]),
        "layers.down_proj": stack(p + "mlp.down_proj.weight"),
    }
    if not args.tie_word_embeddings:
        tensors["lm_head"] = sd["lm_head.weight"]
    if args.attention_bias:
        tensors["layers.qkv_bias"] = torch.stack([torch.cat([sd[f"model.layers.{i}.self_attn.{x}_proj.bias"]
                                                             for x in "qkv"]) for i in range(L)])
    return LlamaWeights.from_tensors(tensors, args, torch.float32, torch.device("cpu"))


def tiny_config(**kw) -> EngineConfig:
    """An engine config small enough for unit tests (no warm-up, small KV cache by default)."""
    base = dict(max_num_seqs=8, block_size=4, max_model_len=256, kv_cache_bytes=None, warmup=False)
    base.update(kw)
    return EngineConfig(**base)


def kv_bytes(args: LlamaConfig, blocks: int, block_size: int = 4) -> int:
    """Bytes of a float32 KV cache with ``blocks`` blocks (including the scratch block)."""
    return blocks * 2 * args.num_hidden_layers * block_size * args.num_key_value_heads * args.head_dim * 4


class ScriptedDrafter:
    """Drafts the next tokens of a known output (``outputs``: prompt ids -> the plain run's
    token ids), a ``wrong`` fraction of the draft tokens (seeded) replaced by another id of a
    ``vocab``-token vocabulary: long drafts, partial acceptance, and drafts that run into a stop
    token or the length limit, which prompt lookup on a random model rarely makes. Set it as
    ``engine.drafter``."""

    def __init__(self, k: int, outputs: dict[tuple[int, ...], list[int]], vocab: int, wrong: float = 0.2) -> None:
        self.k, self.outputs, self.vocab, self.rng, self.wrong = k, outputs, vocab, random.Random(0), wrong

    def propose(self, seqs) -> None:
        for seq in seqs:
            if seq.is_finished:
                continue
            ref = self.outputs[tuple(seq.token_ids[:seq.num_prompt_tokens])]
            done = seq.num_completion_tokens
            room = min(self.k, seq.max_total_tokens - seq.num_tokens - 1)
            drafts = list(ref[done:done + max(room, 0)])
            for j in range(len(drafts)):
                if self.rng.random() < self.wrong:
                    drafts[j] = (drafts[j] + 1) % self.vocab
            seq.draft_token_ids = drafts


def random_prompt(n: int, seed: int, vocab: int) -> list[int]:
    """``n`` token ids drawn from ``[2, vocab)`` by a generator seeded ``seed`` (0 and 1 left out:
    the tiny models' special ids)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n,), generator=g).tolist()


def run_requests(engine, requests) -> list:
    """Add every ``(token_ids, SamplingParams)`` of ``requests``, step ``engine`` until done, and
    return each request's whole output (``RequestStream.result``), in order."""
    streams = [engine.add_request(p, token_ids=ids) for ids, p in requests]
    engine.run_until_done()
    return [s.result(timeout=0) for s in streams]
