"""Tiny random DeepSeek V4 checkpoints in the original release naming (test helper, and the
documented way to get a DeepSeek V4 checkpoint to try warmserve on without downloading one).

``write_tiny_deepseek_v4(directory, TINY_ALL_KINDS)`` writes ``model.safetensors`` (release
names: ``embed.weight``, ``layers.N.attn.wq_a.weight``, ``layers.N.ffn.experts.E.w1.weight``,
``mtp.0.*`` ...), transformers' ``config.json`` and a word-level tokenizer, and returns the
transformers ``DeepseekV4ForCausalLM`` it was drawn from (the reference). ``release_state_dict``
is the one statement of the transformers -> release naming: the inverse of the ``deepseek_v4``
entry of ``transformers/conversion_mapping.py``; ``DeepseekV4ForCausalLM.from_pretrained`` loads
the written directory back through that mapping (the test checks it).

transformers' initialisation zeroes ``tid2eid``, the attention ``sinks``, the compressor and
indexer ``position_bias``, the hyper-connection ``base`` terms and the router bias, and sets norm
weights and hyper-connection scales to one; :func:`tiny_model` re-randomises all of them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file
from weights_tiny import write_word_tokenizer

#: 16 indexer heads: an indexer score is a sum of ReLUs, exactly 0 when every head's is negative
#: (probability 2^-heads per entry), and two entries tied at 0 across the top-k boundary make the
#: pick depend on ``torch.topk``'s tie order, which depends on the row's length. warmserve breaks
#: such ties as transformers' cached decode does (``custom_ops.index_topk``; tested with
#: ``index_n_heads=4``), but transformers' ``use_cache=False`` forward, the reference of most
#: tests, rescores earlier positions over longer rows and breaks them otherwise.
_COMMON = dict(
    vocab_size=128, hidden_size=64, moe_intermediate_size=32, num_attention_heads=4, head_dim=32, q_lora_rank=32,
    partial_rotary_factor=0.25, num_experts_per_tok=2, n_routed_experts=4, sliding_window=8, o_groups=2,
    o_lora_rank=16, index_n_heads=16, index_head_dim=16, index_topk=2, max_position_embeddings=256,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    bos_token_id=1, eos_token_id=2, initializer_range=0.1, num_nextn_predict_layers=1,
)

#: hc_mult 2 and all three layer kinds (window-only, CSA, HCA); the first MLP is hash-routed.
#: Window 8, CSA rate 4, HCA rate 8, index_topk 2: a 24-token sequence runs past the window and
#: the HCA rate and gives the CSA indexer 6 entries to choose 2 from.
TINY_ALL_KINDS = dict(
    _COMMON, num_hidden_layers=3, hc_mult=2,
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
    mlp_layer_types=["hash_moe", "moe", "moe"],
)

#: 2 layers, hc_mult 4: CSA then HCA, hash-routed then top-k MoE.
TINY_HC4 = dict(
    _COMMON, num_hidden_layers=2, hc_mult=4,
    layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
    mlp_layer_types=["hash_moe", "moe"],
)

#: Tokenizer words: ``w0 .. w{TOKENIZER_WORDS-1}`` are ids 0.., ``[UNK]`` is the next id.
TOKENIZER_WORDS = 127

#: transformers name -> release name, for every key but the merged experts (first match wins;
#: ``{n}`` is the layer index). The inverse of transformers' ``deepseek_v4`` conversion mapping.
_LAYER_RENAMES = (
    ("self_attn.sinks", "attn.attn_sink"),
    ("self_attn.q_a_proj.", "attn.wq_a."),
    ("self_attn.q_a_norm.", "attn.q_norm."),
    ("self_attn.q_b_proj.", "attn.wq_b."),
    ("self_attn.kv_proj.", "attn.wkv."),
    ("self_attn.kv_norm.", "attn.kv_norm."),
    ("self_attn.o_a_proj.", "attn.wo_a."),
    ("self_attn.o_b_proj.", "attn.wo_b."),
    ("self_attn.compressor.indexer.position_bias", "attn.indexer.compressor.ape"),
    ("self_attn.compressor.indexer.kv_proj.", "attn.indexer.compressor.wkv."),
    ("self_attn.compressor.indexer.gate_proj.", "attn.indexer.compressor.wgate."),
    ("self_attn.compressor.indexer.kv_norm.", "attn.indexer.compressor.norm."),
    ("self_attn.compressor.indexer.q_b_proj.", "attn.indexer.wq_b."),
    ("self_attn.compressor.indexer.scorer.weights_proj.", "attn.indexer.weights_proj."),
    ("self_attn.compressor.position_bias", "attn.compressor.ape"),
    ("self_attn.compressor.kv_proj.", "attn.compressor.wkv."),
    ("self_attn.compressor.gate_proj.", "attn.compressor.wgate."),
    ("self_attn.compressor.kv_norm.", "attn.compressor.norm."),
    ("mlp.gate.e_score_correction_bias", "ffn.gate.bias"),
    ("mlp.gate.", "ffn.gate."),
    ("mlp.shared_experts.gate_proj.", "ffn.shared_experts.w1."),
    ("mlp.shared_experts.up_proj.", "ffn.shared_experts.w3."),
    ("mlp.shared_experts.down_proj.", "ffn.shared_experts.w2."),
    ("input_layernorm.", "attn_norm."),
    ("post_attention_layernorm.", "ffn_norm."),
    ("attn_hc.fn", "hc_attn_fn"), ("attn_hc.base", "hc_attn_base"), ("attn_hc.scale", "hc_attn_scale"),
    ("ffn_hc.fn", "hc_ffn_fn"), ("ffn_hc.base", "hc_ffn_base"), ("ffn_hc.scale", "hc_ffn_scale"),
)
_GLOBAL_RENAMES = {
    "model.embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight", "model.norm.weight": "norm.weight",
    "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
    "model.hc_head.hc_scale": "hc_head_scale",
}


def release_state_dict(hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The release-named state dict of a transformers ``DeepseekV4ForCausalLM`` state dict:
    renamed per the tables above, and each ``mlp.experts.gate_up_proj`` [E, 2I, H] split into
    per-expert ``w1`` (rows :I) and ``w3`` (rows I:), ``down_proj`` [E, H, I] into ``w2``
    (transformers merges them with ``MergeModulelist(dim=0)`` + ``Concatenate(dim=1)``). Values
    are the same tensors (contiguous copies where split)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in hf_state.items():
        if key in _GLOBAL_RENAMES:
            out[_GLOBAL_RENAMES[key]] = value
            continue
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", key)
        if m is None:
            raise KeyError(f"no release name for {key!r}")
        layer, rest = m.groups()
        if rest == "mlp.experts.gate_up_proj":
            half = value.shape[1] // 2
            for e in range(value.shape[0]):
                out[f"layers.{layer}.ffn.experts.{e}.w1.weight"] = value[e, :half].contiguous()
                out[f"layers.{layer}.ffn.experts.{e}.w3.weight"] = value[e, half:].contiguous()
            continue
        if rest == "mlp.experts.down_proj":
            for e in range(value.shape[0]):
                out[f"layers.{layer}.ffn.experts.{e}.w2.weight"] = value[e].contiguous()
            continue
        for hf, release in _LAYER_RENAMES:
            if rest.startswith(hf):
                out[f"layers.{layer}.{release}{rest[len(hf):]}"] = value
                break
        else:
            raise KeyError(f"no release name for {key!r}")
    return out


def tiny_config(preset: dict, **overrides):
    """A ``transformers.DeepseekV4Config`` from a preset (``TINY_ALL_KINDS``, ``TINY_HC4``)."""
    from transformers import DeepseekV4Config

    return DeepseekV4Config(**{**preset, **overrides})


def tiny_model(preset: dict, seed: int = 0, **overrides):
    """A random float32 ``DeepseekV4ForCausalLM`` (eval mode, eager attention) with the
    parameters transformers initialises to constants re-randomised: ``tid2eid`` (k distinct
    experts per token), ``sinks``, compressor/indexer ``position_bias``, hyper-connection
    ``base``/``scale`` and ``hc_head`` terms, the router bias and every norm weight."""
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(preset, **overrides)
    model = DeepseekV4ForCausalLM(config).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith("tid2eid"):
                rows = [torch.randperm(config.n_routed_experts, generator=g)[:config.num_experts_per_tok]
                        for _ in range(t.shape[0])]
                t.copy_(torch.stack(rows))
            elif name.endswith(("sinks", "position_bias", "e_score_correction_bias")) or re.search(
                    r"(hc\.base|hc_head\.hc_base)$", name):
                t.copy_(torch.randn(t.shape, generator=g))
            elif re.search(r"(hc\.scale|hc_head\.hc_scale)$", name) or (name.endswith("norm.weight")):
                t.copy_(1.0 + 0.2 * torch.randn(t.shape, generator=g))
    return model


# ---- quantized release formats (written from first principles, independent of the packer) ----

#: e2m1 code -> value (bit 3 sign; magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6).
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FP8_BLOCK, FP4_GROUP = 128, 32
#: transformers parameters the quantized writer stores FP8 (128x128 ue8m0 block scales) / FP4.
FP8_PARAMS = re.compile(r".*\.(self_attn\.(q_a_proj|q_b_proj|kv_proj|o_a_proj|o_b_proj)|"
                        r"self_attn\.compressor\.indexer\.q_b_proj|mlp\.shared_experts\.(gate|up|down)_proj)\.weight")
FP4_PARAMS = re.compile(r".*\.mlp\.experts\.(gate_up_proj|down_proj)")


def _e8m0(exponent: torch.Tensor) -> torch.Tensor:
    """Power-of-two scales ``2^exponent`` as ``float8_e8m0fnu`` (biased byte ``exponent + 127``)."""
    return (exponent + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def e8m0_value(scale: torch.Tensor) -> torch.Tensor:
    """``2^(byte - 127)`` of each ue8m0 scale, float32."""
    return torch.pow(2.0, scale.view(torch.uint8).to(torch.float32) - 127.0)


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes float8_e4m3fn [N, K], scale ue8m0 [ceil(N/128), ceil(K/128)])``: per 128x128 block
    (edge blocks partial) the smallest power of two with ``amax / scale <= 448``."""
    rows, cols = w.shape
    nb_r, nb_c = -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)
    exps = torch.zeros(nb_r, nb_c, dtype=torch.int32)
    codes = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(nb_r):
        for j in range(nb_c):
            block = w[i * FP8_BLOCK:(i + 1) * FP8_BLOCK, j * FP8_BLOCK:(j + 1) * FP8_BLOCK].float()
            amax = float(block.abs().max())
            e = int(torch.ceil(torch.log2(torch.tensor(amax / 448.0)))) if amax > 0 else 0
            exps[i, j] = e
            codes[i * FP8_BLOCK:(i + 1) * FP8_BLOCK, j * FP8_BLOCK:(j + 1) * FP8_BLOCK] = \
                (block / 2.0 ** e).to(torch.float8_e4m3fn)
    return codes, _e8m0(exps)


def dequantize_fp8(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``code * 2^(e - 127)`` of the code's 128x128 block, block by block (float32)."""
    out = codes.float()
    values = e8m0_value(scale)
    for i in range(values.shape[0]):
        for j in range(values.shape[1]):
            out[i * FP8_BLOCK:(i + 1) * FP8_BLOCK, j * FP8_BLOCK:(j + 1) * FP8_BLOCK] *= values[i, j]
    return out


def quantize_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed int8 [..., N, K/2], scale ue8m0 [..., N, ceil(K/32)])``: per 32 values of a row
    the smallest power of two with ``amax / scale <= 6``, each value rounded to the nearest e2m1
    value; two codes a byte, the even column in the low nibble."""
    *lead, rows, cols = w.shape
    groups = -(-cols // FP4_GROUP)
    padded = torch.nn.functional.pad(w.float(), (0, groups * FP4_GROUP - cols)).reshape(*lead, rows, groups, FP4_GROUP)
    amax = padded.abs().amax(-1)
    exps = torch.where(amax > 0, torch.ceil(torch.log2(amax.clamp(min=1e-30) / 6.0)), torch.zeros_like(amax))
    scaled = (padded / torch.pow(2.0, exps)[..., None]).reshape(*lead, rows, groups * FP4_GROUP)[..., :cols]
    table = torch.tensor(E2M1[:8])
    mag = (scaled.abs()[..., None] - table).abs().argmin(-1)  # nearest magnitude (first on ties)
    codes = (mag + 8 * (scaled < 0)).to(torch.uint8)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).view(torch.int8)
    return packed, _e8m0(exps.to(torch.int32))


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``e2m1(code) * 2^(e - 127)`` of the code's group of 32 (float32, ``[..., N, K]``)."""
    u8 = packed.view(torch.uint8).long()
    table = torch.tensor(E2M1)
    values = torch.stack([table[u8 & 15], table[u8 >> 4]], -1).flatten(-2)
    return values * e8m0_value(scale).repeat_interleave(FP4_GROUP, -1)[..., :values.shape[-1]]


def quantize_model(model) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Quantize ``model``'s :data:`FP8_PARAMS` (FP8) and :data:`FP4_PARAMS` (FP4) in place: each
    parameter becomes its dequantized value, so the model is the reference of the quantized
    checkpoint. Returns transformers name -> ``(codes, ue8m0 scale)``."""
    stored = {}
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if FP8_PARAMS.fullmatch(name):
                codes, scale = quantize_fp8(t)
                t.copy_(dequantize_fp8(codes, scale))
            elif FP4_PARAMS.fullmatch(name):
                codes, scale = quantize_fp4(t)
                t.copy_(dequantize_fp4(codes, scale))
            else:
                continue
            stored[name] = (codes, scale)
    return stored


def _save_sharded(state: dict[str, torch.Tensor], directory: Path, shards: int) -> None:
    """``model.safetensors``, or ``shards`` files (names dealt round-robin in sorted order, so a
    weight and its scale usually land in different files) plus ``model.safetensors.index.json``."""
    if shards == 1:
        save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
        return
    names, weight_map = sorted(state), {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: state[n] for n in names[s::shards]}, str(directory / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in names[s::shards]})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


class TinyMTP(torch.nn.Module):
    """One MTP block (the release's ``inference/model.py`` ``MTPBlock``) built from transformers'
    modules, the reference of warmserve's MTP step: ``layer`` a ``DeepseekV4DecoderLayer`` at
    index ``L`` of a config extended by one window-only, top-k MoE layer (the release's
    ``compress_ratios[L]`` is 0; hash routing is for the first layers), ``e_proj`` / ``h_proj``
    (no bias), ``enorm`` / ``hnorm`` / ``norm`` and its own ``hc_head``; ``embed`` and ``head`` are
    the main model's. :meth:`forward` follows ``MTPBlock.forward``."""

    def __init__(self, model, seed: int) -> None:
        from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

        super().__init__()
        c = model.config
        L = c.num_hidden_layers
        ext = type(c)(**{**c.to_dict(), "num_hidden_layers": L + 1, "layer_types": [*c.layer_types, "sliding_attention"],
                         "mlp_layer_types": [*c.mlp_layer_types, "moe"]})
        ext._attn_implementation = c._attn_implementation
        torch.manual_seed(seed + 7)
        self.config, self.layer_index = ext, L
        self.layer = m.DeepseekV4DecoderLayer(ext, L).eval()
        self.e_proj = torch.nn.Linear(c.hidden_size, c.hidden_size, bias=False)
        self.h_proj = torch.nn.Linear(c.hidden_size, c.hidden_size, bias=False)
        self.enorm, self.hnorm, self.norm = (m.DeepseekV4RMSNorm(c.hidden_size, eps=c.rms_norm_eps) for _ in range(3))
        self.hc_head = m.DeepseekV4HyperHead(c)
        self.rotary = m.DeepseekV4RotaryEmbedding(ext)
        g = torch.Generator().manual_seed(seed + 8)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            _rerandomise(self, ext, g)
        self.model = [model]  # not a submodule: embed and head are the main model's

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden`` [B, S, n, H] (the main model's residual streams before its ``hc_head``, or
        this block's output for a further draft), ``input_ids`` [B, S] (the token after each
        position); positions ``0 .. S - 1``. Returns ``(logits [B, S, V], streams [B, S, n, H])``."""
        from transformers.masking_utils import create_sliding_window_causal_mask

        main = self.model[0]
        e = self.enorm(main.model.embed_tokens(input_ids))
        x = self.e_proj(e).unsqueeze(2) + self.h_proj(self.hnorm(hidden))
        pos = torch.arange(input_ids.shape[1])[None]
        mask = create_sliding_window_causal_mask(config=self.config, inputs_embeds=e, attention_mask=None,
                                                 past_key_values=None, position_ids=pos)
        rope = {label: self.rotary(e, position_ids=pos, layer_type=label) for label in ("main", "compress")}
        x = self.layer(x, position_embeddings=rope, position_ids=pos, attention_mask=mask, input_ids=input_ids)
        return main.lm_head(self.norm(self.hc_head(x))).float(), x

    def release_state(self, index: int = 0) -> dict[str, torch.Tensor]:
        """This block's tensors under their release names ``mtp.{index}.*``."""
        L = self.layer_index
        layer = release_state_dict({f"model.layers.{L}.{k}": v for k, v in self.layer.state_dict().items()})
        out = {f"mtp.{index}.{k.removeprefix(f'layers.{L}.')}": v for k, v in layer.items()}
        own = {"e_proj.weight": self.e_proj.weight, "h_proj.weight": self.h_proj.weight,
               "enorm.weight": self.enorm.weight, "hnorm.weight": self.hnorm.weight, "norm.weight": self.norm.weight,
               "hc_head_fn": self.hc_head.hc_fn, "hc_head_base": self.hc_head.hc_base,
               "hc_head_scale": self.hc_head.hc_scale}
        out.update({f"mtp.{index}.{k}": v for k, v in own.items()})
        return {k: v.detach().contiguous() for k, v in out.items()}


def _rerandomise(module, config, g: torch.Generator) -> None:
    """What :func:`tiny_model` re-randomises, for ``module``'s own parameters."""
    for name, t in module.state_dict().items():
        if name.endswith(("sinks", "e_score_correction_bias")) or re.search(r"(hc\.base|hc_head\.hc_base|hc_base)$", name):
            t.copy_(torch.randn(t.shape, generator=g))
        elif re.search(r"(hc\.scale|hc_scale)$", name) or name.endswith("norm.weight"):
            t.copy_(1.0 + 0.2 * torch.randn(t.shape, generator=g))


def mtp_state(model, seed: int, dtype: torch.dtype, quantized: bool, fp4_dtype: torch.dtype = torch.int8
              ) -> dict[str, torch.Tensor]:
    """The release-named ``mtp.i.*`` tensors of ``model.config.num_nextn_predict_layers``
    :class:`TinyMTP` blocks (kept as ``model.mtp_blocks``, the reference); with ``quantized``,
    the block's :data:`FP8_PARAMS` / :data:`FP4_PARAMS` and ``e_proj`` / ``h_proj`` are stored
    FP8 / FP4 with release scales (the reference holds the dequantized values)."""
    blocks = [TinyMTP(model, seed + 10 * i) for i in range(model.config.num_nextn_predict_layers)]
    model.mtp_blocks = blocks  # a list: not registered as submodules, so not in model.state_dict()
    state = {}
    for i, block in enumerate(blocks):
        stored = {}
        if quantized:  # the patterns want a prefix before the module path: "l."
            stored = {k.removeprefix("l."): v for k, v in quantize_model(torch.nn.ModuleDict({"l": block.layer})).items()}
            with torch.no_grad():
                for proj in (block.e_proj, block.h_proj):
                    codes, scale = quantize_fp8(proj.weight)
                    proj.weight.copy_(dequantize_fp8(codes, scale))
                    stored[proj] = (codes, scale)
        own = block.release_state(i)
        state.update({k: v.to(dtype) for k, v in own.items()})
        L = block.layer_index
        for key, (codes, scale) in stored.items():
            if isinstance(key, torch.nn.Linear):
                name = f"mtp.{i}.{'e_proj' if key is block.e_proj else 'h_proj'}"
                state[name + ".weight"], state[name + ".scale"] = codes, scale
                continue
            if FP4_PARAMS.fullmatch("l." + key):
                codes = codes.view(fp4_dtype)
            for rk, v in release_state_dict({f"model.layers.{L}.{key}": codes}).items():
                state[f"mtp.{i}." + rk.removeprefix(f"layers.{L}.")] = v.contiguous()
            for rk, v in release_state_dict({f"model.layers.{L}.{key}": scale}).items():
                state[f"mtp.{i}." + rk.removeprefix(f"layers.{L}.")[: -len(".weight")] + ".scale"] = v.contiguous()
    return state


def write_tiny_deepseek_v4(directory: Path, preset: dict = TINY_ALL_KINDS, *, seed: int = 0,
                           dtype: torch.dtype = torch.float32, mtp: bool = True, naming: str = "release",
                           shards: int = 1, quantized: bool = False, fp4_dtype: torch.dtype = torch.int8,
                           **overrides):
    """Write a tiny DeepSeek V4 checkpoint to ``directory`` (created): weights, ``config.json``
    (transformers' ``to_dict``, ``architectures`` set), ``generation_config.json`` and a word
    tokenizer (``w{i}`` is token ``i``, BOS ``w1``, EOS ``w2``). Returns the float32 transformers
    model (the reference: with ``quantized``, its quantized parameters hold the dequantized
    values, :func:`quantize_model`).

    ``naming``: ``release`` (:func:`release_state_dict`), ``transformers`` (the model's own
    ``state_dict`` names) or ``saved`` (what ``model.save_pretrained`` writes; float32 only, one
    file, no MTP, not quantized). ``shards`` > 1 splits the weights over that many files with a
    ``model.safetensors.index.json``. ``quantized``: :data:`FP8_PARAMS` stored float8_e4m3fn with
    ue8m0 128x128 block scales (``<prefix>.scale`` in release naming, ``<prefix>.weight_scale_inv``
    in transformers naming) and the routed experts FP4 (e2m1 pairs as ``fp4_dtype``: int8 or
    ``torch.float4_e2m1fn_x2``, safetensors ``F4``) with one ue8m0 scale per 32 values of a row
    (``_scale_inv`` after the merged parameter in transformers naming). Other floating tensors are
    cast to ``dtype``. ``mtp``: the config's ``num_nextn_predict_layers`` complete MTP blocks
    (:func:`mtp_state`; release names ``mtp.i.*`` in every naming, as no other naming has any;
    the reference blocks are ``model.mtp_blocks``); without it the config declares none."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if not mtp:
        overrides = {**overrides, "num_nextn_predict_layers": 0}
    model = tiny_model(preset, seed=seed, **overrides)
    stored = quantize_model(model) if quantized else {}
    if naming == "saved":
        if quantized or shards != 1 or dtype != torch.float32:
            raise ValueError("the saved naming is written by save_pretrained: float32, one file, not quantized")
        model.save_pretrained(directory)
        extra = mtp_state(model, seed, dtype, False)
        if extra:  # save_pretrained drops mtp.*: added to its file as a release checkpoint stores them
            from safetensors.torch import load_file
            weights = directory / "model.safetensors"
            save_file({**load_file(str(weights)), **extra}, str(weights), metadata={"format": "pt"})
        write_word_tokenizer(directory, TOKENIZER_WORDS)
        return model
    if naming == "release":
        state = release_state_dict(model.state_dict())
    elif naming == "transformers":
        state = dict(model.state_dict())
    else:
        raise ValueError(f"unknown naming {naming!r}")
    state = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in state.items()}
    for hf_name, (codes, scale) in stored.items():
        if FP4_PARAMS.fullmatch(hf_name):
            codes = codes.view(fp4_dtype)
        if naming == "transformers":
            state[hf_name] = codes
            state[hf_name[:-len(".weight")] + ".weight_scale_inv" if hf_name.endswith(".weight")
                  else hf_name + "_scale_inv"] = scale
            continue
        state.update({k: v.contiguous() for k, v in release_state_dict({hf_name: codes}).items()})
        state.update({k[:-len(".weight")] + ".scale": v.contiguous()
                      for k, v in release_state_dict({hf_name: scale}).items()})
    state.update(mtp_state(model, seed, dtype, quantized, fp4_dtype))
    _save_sharded(state, directory, shards)
    config = model.config.to_dict()
    config["architectures"] = ["DeepseekV4ForCausalLM"]
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    (directory / "generation_config.json").write_text(json.dumps({
        "bos_token_id": model.config.bos_token_id, "eos_token_id": model.config.eos_token_id}))
    write_word_tokenizer(directory, TOKENIZER_WORDS)
    return model


PRESETS = {"all_kinds": TINY_ALL_KINDS, "hc4": TINY_HC4}


def main(argv: list[str] | None = None) -> int:
    """``python tests/deepseek_v4_tiny.py DIR [--preset all_kinds|hc4] [--naming ...] [--quantized]
    [--shards N] [--seed S]``: write a tiny checkpoint to serve (needs ``transformers``)."""
    import argparse

    parser = argparse.ArgumentParser(description="Write a tiny random DeepSeek V4 checkpoint.")
    parser.add_argument("directory", type=Path)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="all_kinds")
    parser.add_argument("--naming", choices=("release", "transformers", "saved"), default="release")
    parser.add_argument("--quantized", action="store_true", help="FP8 block-scaled matrices, FP4 routed experts")
    parser.add_argument("--shards", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    write_tiny_deepseek_v4(args.directory, PRESETS[args.preset], seed=args.seed, naming=args.naming,
                           shards=args.shards, quantized=args.quantized)
    print(f"wrote {args.directory}: warmserve up --model {args.directory}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
