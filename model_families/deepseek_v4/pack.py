"""The DeepSeek V4 sidecar layout: the one statement of it (:func:`tensor_shapes`) and the rule
that fills it from a checkpoint in any of its three namings.

Stacked by layer kind, as serving systems built for this model stack it (symbols as in
:mod:`model_families.deepseek_v4.config`: L layers, H hidden, V vocab, nh heads, hd head_dim,
qr q_lora_rank, g o_groups, r o_lora_rank, E experts, k experts per token, I
moe_intermediate_size, n hc_mult, M = (2+n)·n, m / m' CSA / HCA rates, ih / id indexer heads /
head width; L_csa, L_hca, L_hash the layers of each kind). Every matrix is ``[out, in]``.

=============================  ==========================  ===========================================
name                           shape                       from (release names, layer ``N``)
=============================  ==========================  ===========================================
``embed``                      [V, H]                      ``embed.weight``
``head``                       [V, H]                      ``head.weight`` (untied)
``final_norm``                 [H]                         ``norm.weight``
``hc_head_fn``                 [n, n·H]                    ``hc_head_fn``
``hc_head_base``               [n]                         ``hc_head_base``
``hc_head_scale``              [1]                         ``hc_head_scale``
``layers.attn_norm``           [L, H]                      ``layers.N.attn_norm.weight``
``layers.ffn_norm``            [L, H]                      ``layers.N.ffn_norm.weight``
``layers.hc_attn_fn``          [L, M, n·H]                 ``layers.N.hc_attn_fn``
``layers.hc_attn_base``        [L, M]                      ``layers.N.hc_attn_base``
``layers.hc_attn_scale``       [L, 3]                      ``layers.N.hc_attn_scale``
``layers.hc_ffn_fn``           [L, M, n·H]                 ``layers.N.hc_ffn_fn``
``layers.hc_ffn_base``         [L, M]                      ``layers.N.hc_ffn_base``
``layers.hc_ffn_scale``        [L, 3]                      ``layers.N.hc_ffn_scale``
``layers.wq_a``                [L, qr, H]                  ``layers.N.attn.wq_a.weight``
``layers.q_norm``              [L, qr]                     ``layers.N.attn.q_norm.weight``
``layers.wq_b``                [L, nh·hd, qr]              ``layers.N.attn.wq_b.weight``
``layers.wkv``                 [L, hd, H]                  ``layers.N.attn.wkv.weight``
``layers.kv_norm``             [L, hd]                     ``layers.N.attn.kv_norm.weight``
``layers.wo_a``                [L, g·r, nh·hd/g]           ``layers.N.attn.wo_a.weight``
``layers.wo_b``                [L, H, g·r]                 ``layers.N.attn.wo_b.weight``
``layers.attn_sink``           [L, nh]                     ``layers.N.attn.attn_sink``
``layers.gate``                [L, E, H]                   ``layers.N.ffn.gate.weight``
``layers.gate_bias``           [L, E]                      ``layers.N.ffn.gate.bias`` (zeros in hash
                                                           layers, which have none)
``layers.shared_gate_up``      [L, 2I, H]                  ``ffn.shared_experts.w1`` rows, then ``w3``
``layers.shared_down``         [L, H, I]                   ``ffn.shared_experts.w2``
``layers.experts_gate_up``     [L, E, 2I, H]               ``ffn.experts.e.w1`` rows, then ``w3``
``layers.experts_down``        [L, E, H, I]                ``ffn.experts.e.w2``
``hash.tid2eid``               [L_hash, V, k] int32        ``layers.N.ffn.gate.tid2eid``
``csa.wkv_gate``               [L_csa, 4·hd, H]            ``attn.compressor.wkv`` rows, then ``wgate``
``csa.ape``                    [L_csa, m, 2·hd]            ``attn.compressor.ape``
``csa.norm``                   [L_csa, hd]                 ``attn.compressor.norm.weight``
``csa.idx_wkv_gate``           [L_csa, 4·id, H]            ``attn.indexer.compressor.wkv``, ``wgate``
``csa.idx_ape``                [L_csa, m, 2·id]            ``attn.indexer.compressor.ape``
``csa.idx_norm``               [L_csa, id]                 ``attn.indexer.compressor.norm.weight``
``csa.idx_wq_b``               [L_csa, ih·id, qr]          ``attn.indexer.wq_b.weight``
``csa.idx_weights``            [L_csa, ih, H]              ``attn.indexer.weights_proj.weight``
``hca.wkv_gate``               [L_hca, 2·hd, H]            ``attn.compressor.wkv`` rows, then ``wgate``
``hca.ape``                    [L_hca, m', hd]             ``attn.compressor.ape``
``hca.norm``                   [L_hca, hd]                 ``attn.compressor.norm.weight``
=============================  ==========================  ===========================================

Group ``layers.*`` is indexed by layer; ``hash.*``, ``csa.*``, ``hca.*`` by the layer's rank
among the layers of its kind (:meth:`DeepseekV4Config.layers_of`, :attr:`hash_layers`):
:func:`stack_index`, which the packer asks for each stacked tensor's slice
(:meth:`model_families.family.ModelFamily.stack_index`). Every tensor is in the sidecar's float
dtype except ``hash.tid2eid`` (int32). ``layers.gate_bias`` is zero in hash-routed layers.

Reading: :func:`global_tensors` / :func:`layer_tensors` read the checkpoint in any of its three
namings (release, transformers' module names, transformers' ``save_pretrained`` output) through
:class:`~model_families.deepseek_v4.checkpoint_names.ReleaseView`, which also dequantizes the
release's FP8 (128x128 ue8m0 block scales) and FP4 (e2m1, one ue8m0 scale per 32 values of a
row) tensors to float32 (:mod:`model_families.deepseek_v4.quantized`, sources there). A tensor
the layout needs and the checkpoint lacks raises ``InvalidArgument`` naming it.

MTP (``mtp.*``): kept for the MTP work, outside the layout above. Which tensors the release's
MTP block holds is not stated by any source at hand (transformers drops ``mtp.`` on load:
``_keys_to_ignore_on_load_unexpected``), so their shapes are not derived from the config:
:func:`extra_specs` lists every checkpoint tensor whose name starts with ``mtp.`` (companion
scales of quantized ones excepted) under its own name, at its dequantized shape, in the
sidecar's float dtype, and :func:`extra_tensors` yields their values. The packer adds these
checkpoint-dependent names to the header, to the names fingerprint and to the metadata
(``warmserve.extra_tensors``), so the validator knows them without the checkpoint
(:meth:`model_families.family.ModelFamily.extra_specs`). The runner's ``load_weights`` must
ignore ``mtp.*``.

Layout facts (:func:`layout_facts`): ``layer_types``, ``compress_rates``, ``sliding_window``,
``mlp_layer_types``, ``hc_mult`` and ``index_topk`` enter the sidecar fingerprint and are checked
when a sidecar is validated (:meth:`model_families.family.ModelFamily.layout_facts`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from model_families.deepseek_v4.checkpoint_names import ReleaseView, scale_names
from model_families.deepseek_v4.config import CSA, HCA, DeepseekV4Config
from model_families.deepseek_v4.quantized import is_quantized
from model_families.family import FLOAT_WEIGHTS, Checkpoint, TensorSpec, float_specs
from services.errors import InvalidArgument

#: Tensors kept in float32 in every layout and at every compute dtype (names ending so: norms,
#: attention sinks, compressor position biases, the router bias, every hyper-connection term), as
#: transformers keeps them (``DeepseekV4PreTrainedModel._keep_in_fp32_modules_strict``) and the
#: release stores them; the same suffixes pick the runner's float32 weights.
FLOAT32_SUFFIXES = ("norm", "sink", "ape", "gate_bias", "_fn", "_base", "_scale")
#: Changes whenever the layout above changes (enters the sidecar fingerprint).
PACK_VERSION = "1"
#: The weights dtypes this layout has a form for.
WEIGHTS_DTYPES = ("f32", "bf16")
#: Prefixes of the tensors whose first dim is a stack (layer, or rank among a kind's layers).
STACKED_PREFIXES = ("layers.", "hash.", "csa.", "hca.")
#: Prefix of the checkpoint-dependent MTP tensors kept verbatim (:func:`extra_specs`).
EXTRA_PREFIXES = ("mtp.",)


def tensor_shapes(c: DeepseekV4Config) -> dict[str, tuple[int, ...]]:
    """The float layout: sidecar tensor name -> full shape for ``c`` (the table in the module
    docstring; ``hash.tid2eid`` is int32 in every layout, see :func:`tensor_specs`)."""
    L, H, V, n, M = c.num_hidden_layers, c.hidden_size, c.vocab_size, c.hc_mult, c.hc_mix_size
    nh, hd, qr, g, r = c.num_attention_heads, c.head_dim, c.q_lora_rank, c.o_groups, c.o_lora_rank
    E, k, inter = c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size
    ih, idim, m, m2 = c.index_n_heads, c.index_head_dim, c.csa_compress_rate, c.hca_compress_rate
    n_csa, n_hca, n_hash = len(c.layers_of(CSA)), len(c.layers_of(HCA)), len(c.hash_layers)
    shapes: dict[str, tuple[int, ...]] = {
        "embed": (V, H), "head": (V, H), "final_norm": (H,),
        "hc_head_fn": (n, n * H), "hc_head_base": (n,), "hc_head_scale": (1,),
        "layers.attn_norm": (L, H), "layers.ffn_norm": (L, H),
        "layers.hc_attn_fn": (L, M, n * H), "layers.hc_attn_base": (L, M), "layers.hc_attn_scale": (L, 3),
        "layers.hc_ffn_fn": (L, M, n * H), "layers.hc_ffn_base": (L, M), "layers.hc_ffn_scale": (L, 3),
        "layers.wq_a": (L, qr, H), "layers.q_norm": (L, qr), "layers.wq_b": (L, nh * hd, qr),
        "layers.wkv": (L, hd, H), "layers.kv_norm": (L, hd),
        "layers.wo_a": (L, g * r, nh * hd // g), "layers.wo_b": (L, H, g * r), "layers.attn_sink": (L, nh),
        "layers.gate": (L, E, H), "layers.gate_bias": (L, E),
        "layers.shared_gate_up": (L, 2 * inter, H), "layers.shared_down": (L, H, inter),
        "layers.experts_gate_up": (L, E, 2 * inter, H), "layers.experts_down": (L, E, H, inter),
    }
    if n_hash:
        shapes["hash.tid2eid"] = (n_hash, V, k)
    if n_csa:
        shapes.update({
            "csa.wkv_gate": (n_csa, 4 * hd, H), "csa.ape": (n_csa, m, 2 * hd), "csa.norm": (n_csa, hd),
            "csa.idx_wkv_gate": (n_csa, 4 * idim, H), "csa.idx_ape": (n_csa, m, 2 * idim),
            "csa.idx_norm": (n_csa, idim), "csa.idx_wq_b": (n_csa, ih * idim, qr), "csa.idx_weights": (n_csa, ih, H),
        })
    if n_hca:
        shapes.update({"hca.wkv_gate": (n_hca, 2 * hd, H), "hca.ape": (n_hca, m2, hd), "hca.norm": (n_hca, hd)})
    return shapes


def tensor_specs(c: DeepseekV4Config, weights_dtype: str) -> dict[str, TensorSpec]:
    """Sidecar tensor name -> shape and dtype in a ``weights_dtype`` (``f32`` / ``bf16``)
    sidecar: float tensors in that dtype but the :data:`FLOAT32_SUFFIXES` ones (float32 in every
    layout), ``hash.tid2eid`` int32. Raises
    ``InvalidArgument`` for another weights dtype."""
    if weights_dtype not in WEIGHTS_DTYPES:
        raise InvalidArgument(f"the deepseek_v4 layout has no {weights_dtype!r} form (it has "
                              f"{', '.join(WEIGHTS_DTYPES)})")
    specs = float_specs(tensor_shapes(c), weights_dtype)
    for name in [n for n in specs if n.endswith(FLOAT32_SUFFIXES)]:
        specs[name] = TensorSpec(specs[name].shape, torch.float32)
    if "hash.tid2eid" in specs:
        specs["hash.tid2eid"] = TensorSpec(specs["hash.tid2eid"].shape, torch.int32)
    return specs


def stack_index(c: DeepseekV4Config, name: str, layer: int) -> int:
    """The slice of stacked tensor ``name`` that layer ``layer`` fills: ``layer`` for
    ``layers.*``, the layer's rank among the hash-routed layers for ``hash.*``, among the CSA /
    HCA layers for ``csa.*`` / ``hca.*``. ``InvalidArgument`` when ``layer`` is not of that kind
    or ``name`` is not stacked."""
    group = name.split(".", 1)[0]
    if group == "layers":
        return layer
    members = {"hash": c.hash_layers, "csa": c.layers_of(CSA), "hca": c.layers_of(HCA)}.get(group)
    if members is None:
        raise InvalidArgument(f"{name} is not a stacked deepseek_v4 tensor")
    if layer not in members:
        raise InvalidArgument(f"layer {layer} has no slice of {name} (its layers: {list(members)})")
    return members.index(layer)


def layout_facts(c: DeepseekV4Config) -> dict[str, Any]:
    """The config facts the layout and the model's use of it rest on (which layer has which
    slice, window and rates): part of the sidecar fingerprint and checked on validation."""
    return {
        "layer_types": list(c.layer_types), "mlp_layer_types": list(c.mlp_layer_types),
        "compress_rates": {k: c.compress_rates[k] for k in sorted(c.compress_rates)},
        "sliding_window": c.sliding_window, "hc_mult": c.hc_mult, "index_topk": c.index_topk,
    }


def _view(ckpt: Checkpoint) -> ReleaseView:
    return ckpt if isinstance(ckpt, ReleaseView) else ReleaseView(ckpt)


def global_tensors(ckpt: Checkpoint, weights_dtype: str = "f32") -> dict[str, torch.Tensor]:
    """``embed``, ``head``, ``final_norm`` and the ``hc_head_*`` terms (float32; the packer casts)."""
    v = _view(ckpt)
    return {"embed": v.tensor("embed.weight"), "head": v.tensor("head.weight"), "final_norm": v.tensor("norm.weight"),
            "hc_head_fn": v.tensor("hc_head_fn"), "hc_head_base": v.tensor("hc_head_base"),
            "hc_head_scale": v.tensor("hc_head_scale")}


def layer_tensors(ckpt: Checkpoint, layer: int, weights_dtype: str = "f32") -> dict[str, torch.Tensor]:
    """Layer ``layer``'s slice of every ``layers.*`` tensor, and of the ``hash.*`` / ``csa.*`` /
    ``hca.*`` tensors when the layer is of that kind (slices placed by :func:`stack_index`);
    fused as the module docstring's table says."""
    v = _view(ckpt)
    c: DeepseekV4Config = ckpt.config
    p = f"layers.{layer}."
    t = lambda name: v.tensor(p + name)  # noqa: E731
    cat = lambda *names: torch.cat([t(n) for n in names])  # noqa: E731
    experts_gate_up, experts_down = v.experts(layer, c.n_routed_experts)
    hashed = layer in c.hash_layers
    out = {
        "layers.attn_norm": t("attn_norm.weight"), "layers.ffn_norm": t("ffn_norm.weight"),
        "layers.hc_attn_fn": t("hc_attn_fn"), "layers.hc_attn_base": t("hc_attn_base"),
        "layers.hc_attn_scale": t("hc_attn_scale"),
        "layers.hc_ffn_fn": t("hc_ffn_fn"), "layers.hc_ffn_base": t("hc_ffn_base"), "layers.hc_ffn_scale": t("hc_ffn_scale"),
        "layers.wq_a": t("attn.wq_a.weight"), "layers.q_norm": t("attn.q_norm.weight"), "layers.wq_b": t("attn.wq_b.weight"),
        "layers.wkv": t("attn.wkv.weight"), "layers.kv_norm": t("attn.kv_norm.weight"),
        "layers.wo_a": t("attn.wo_a.weight"), "layers.wo_b": t("attn.wo_b.weight"), "layers.attn_sink": t("attn.attn_sink"),
        "layers.gate": t("ffn.gate.weight"),
        "layers.gate_bias": torch.zeros(c.n_routed_experts) if hashed else t("ffn.gate.bias"),
        "layers.shared_gate_up": cat("ffn.shared_experts.w1.weight", "ffn.shared_experts.w3.weight"),
        "layers.shared_down": t("ffn.shared_experts.w2.weight"),
        "layers.experts_gate_up": experts_gate_up, "layers.experts_down": experts_down,
    }
    if hashed:
        tid2eid = t("ffn.gate.tid2eid")
        if tid2eid.is_floating_point() or (tid2eid.numel() and not (
                0 <= int(tid2eid.min()) and int(tid2eid.max()) < c.n_routed_experts)):
            raise InvalidArgument(f"{p}ffn.gate.tid2eid must hold expert indices in [0, {c.n_routed_experts})")
        out["hash.tid2eid"] = tid2eid.to(torch.int32)
    kind = c.layer_types[layer]
    if kind == CSA:
        out.update({
            "csa.wkv_gate": cat("attn.compressor.wkv.weight", "attn.compressor.wgate.weight"),
            "csa.ape": t("attn.compressor.ape"), "csa.norm": t("attn.compressor.norm.weight"),
            "csa.idx_wkv_gate": cat("attn.indexer.compressor.wkv.weight", "attn.indexer.compressor.wgate.weight"),
            "csa.idx_ape": t("attn.indexer.compressor.ape"), "csa.idx_norm": t("attn.indexer.compressor.norm.weight"),
            "csa.idx_wq_b": t("attn.indexer.wq_b.weight"), "csa.idx_weights": t("attn.indexer.weights_proj.weight"),
        })
    elif kind == HCA:
        out.update({"hca.wkv_gate": cat("attn.compressor.wkv.weight", "attn.compressor.wgate.weight"),
                    "hca.ape": t("attn.compressor.ape"), "hca.norm": t("attn.compressor.norm.weight")})
    return out


def _mtp_names(v: ReleaseView) -> list[str]:
    """The checkpoint's ``mtp.*`` tensors to keep: all but the companion scales of quantized
    ones (sorted)."""
    names = sorted(n for n in v.names() if n.startswith(EXTRA_PREFIXES))
    present = set(names)
    scales = set()
    for n in names:
        if any(s in present for s in scale_names(n)):
            scales.update(s for s in scale_names(n) if s in present and is_quantized(v.ckpt.tensor(n)))
    return [n for n in names if n not in scales]


def extra_specs(ckpt: Checkpoint, weights_dtype: str = "f32") -> dict[str, TensorSpec]:
    """The checkpoint's ``mtp.*`` tensors (see the module docstring): name -> dequantized shape
    in the sidecar's float dtype (int32 for integer ones). Empty when the reader cannot list
    its names."""
    v, dtype = _view(ckpt), FLOAT_WEIGHTS[weights_dtype]
    specs = {}
    for name in _mtp_names(v):
        t = v.read(name)
        specs[name] = TensorSpec(tuple(t.shape), dtype if t.is_floating_point() else torch.int32)
    return specs


def extra_tensors(ckpt: Checkpoint, weights_dtype: str = "f32") -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, value)`` of each tensor of :func:`extra_specs`, one at a time (float32 or int32;
    the packer casts floats)."""
    v = _view(ckpt)
    for name in _mtp_names(v):
        t = v.read(name)
        yield name, (t if t.is_floating_point() else t.to(torch.int32))
