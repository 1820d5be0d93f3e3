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

MTP (multi-token prediction, ``num_nextn_predict_layers`` = N_mtp blocks): the release's
``inference/model.py`` ``MTPBlock`` (a ``Block`` at layer id ``L + i``, so window-only attention,
the release's ``compress_ratios[L + i]`` being 0, and a top-k routed MoE, hash routing being for
the first layers only) adds ``e_proj`` / ``h_proj`` [H, H], ``enorm`` / ``hnorm`` / ``norm`` [H]
and its own ``hc_head_{fn,base,scale}`` to a block's tensors; it shares ``embed`` and ``head``.
Its tensors are ``mtp.i.*`` under the release's per-layer names in every naming (transformers has
no module for them and leaves ``mtp.*`` as stored: ``_keys_to_ignore_on_load_unexpected``). They
are stacked over the blocks like ``layers.*``, in the same fused forms:

=============================  ==========================  ===========================================
``mtp.e_proj``, ``mtp.h_proj``  [N_mtp, H, H]              ``mtp.i.e_proj.weight``, ``h_proj.weight``
``mtp.enorm``, ``mtp.hnorm``,   [N_mtp, H]                 ``mtp.i.enorm.weight``, ... ``norm.weight``
``mtp.norm``
``mtp.hc_head_fn`` / ``_base``  [N_mtp, n, n·H] / [N_mtp,  ``mtp.i.hc_head_fn`` / ``_base`` / ``_scale``
/ ``_scale``                    n] / [N_mtp, 1]
``mtp.<x>`` for every           ``[N_mtp, ...]`` of        ``mtp.i.`` + the release name of ``x``
``layers.<x>`` above            ``layers.<x>``'s slice
=============================  ==========================  ===========================================

A checkpoint whose config declares MTP blocks but lacks one of their tensors, or holds
``mtp.i.*`` for an ``i`` the config does not declare, is refused when packed
(``InvalidArgument`` naming the tensor or the block; set ``num_nextn_predict_layers`` to 0 to pack
a checkpoint without its MTP block).

Layout facts (:func:`layout_facts`): ``layer_types``, ``compress_rates``, ``sliding_window``,
``mlp_layer_types``, ``hc_mult`` and ``index_topk`` enter the sidecar fingerprint and are checked
when a sidecar is validated (:meth:`model_families.family.ModelFamily.layout_facts`).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from model_families.deepseek_v4.checkpoint_names import ReleaseView
from model_families.deepseek_v4.config import CSA, HCA, DeepseekV4Config
from model_families.family import Checkpoint, TensorSpec, float_specs
from services.errors import InvalidArgument

#: Tensors kept in float32 in every layout and at every compute dtype (names ending so: norms,
#: attention sinks, compressor position biases, the router bias, every hyper-connection term), as
#: transformers keeps them (``DeepseekV4PreTrainedModel._keep_in_fp32_modules_strict``) and the
#: release stores them; the same suffixes pick the runner's float32 weights.
FLOAT32_SUFFIXES = ("norm", "sink", "ape", "gate_bias", "_fn", "_base", "_scale")
#: Changes whenever the layout above changes (enters the sidecar fingerprint). 2: ``mtp.*`` stacked.
PACK_VERSION = "2"
#: The weights dtypes this layout has a form for.
WEIGHTS_DTYPES = ("f32", "bf16")
#: Prefixes of the tensors whose first dim is a stack (layer, or rank among a kind's layers).
STACKED_PREFIXES = ("layers.", "hash.", "csa.", "hca.")
#: Prefix of the MTP blocks' tensors (stacked over the blocks, see the module docstring).
MTP_PREFIX = "mtp."
#: The MTP blocks' own tensors besides a block's (sidecar suffix -> release suffix).
_MTP_BLOCK = re.compile(r"mtp\.(\d+)\.")
MTP_OWN = {"e_proj": "e_proj.weight", "h_proj": "h_proj.weight", "enorm": "enorm.weight", "hnorm": "hnorm.weight",
           "norm": "norm.weight", "hc_head_fn": "hc_head_fn", "hc_head_base": "hc_head_base",
           "hc_head_scale": "hc_head_scale"}


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
    n_mtp = c.num_nextn_predict_layers
    if n_mtp:
        shapes.update({MTP_PREFIX + name.removeprefix("layers."): (n_mtp, *shape[1:])
                       for name, shape in list(shapes.items()) if name.startswith("layers.")})
        shapes.update({"mtp.e_proj": (n_mtp, H, H), "mtp.h_proj": (n_mtp, H, H), "mtp.enorm": (n_mtp, H),
                       "mtp.hnorm": (n_mtp, H), "mtp.norm": (n_mtp, H), "mtp.hc_head_fn": (n_mtp, n, n * H),
                       "mtp.hc_head_base": (n_mtp, n), "mtp.hc_head_scale": (n_mtp, 1)})
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
    """``embed``, ``head``, ``final_norm``, the ``hc_head_*`` terms and the MTP blocks'
    ``mtp.*`` tensors (:func:`mtp_tensors`; float32, the packer casts)."""
    v = _view(ckpt)
    return {"embed": v.tensor("embed.weight"), "head": v.tensor("head.weight"), "final_norm": v.tensor("norm.weight"),
            "hc_head_fn": v.tensor("hc_head_fn"), "hc_head_base": v.tensor("hc_head_base"),
            "hc_head_scale": v.tensor("hc_head_scale"), **mtp_tensors(v)}


def mtp_tensors(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    """The ``mtp.*`` tensors of the module docstring, each stacked over the config's
    ``num_nextn_predict_layers`` blocks (none when it is 0). ``InvalidArgument`` when a declared
    block lacks a tensor (naming it) or the checkpoint holds ``mtp.i.*`` past the declared count."""
    v = _view(ckpt)
    c: DeepseekV4Config = ckpt.config
    n = c.num_nextn_predict_layers
    held = sorted({int(m.group(1)) for name in v.names() if (m := _MTP_BLOCK.match(name))})
    if held and held[-1] >= n:
        raise InvalidArgument(f"the DeepSeek V4 checkpoint holds MTP block mtp.{held[-1]}.* but its config declares "
                              f"{n} (num_nextn_predict_layers): {len(held)} blocks are stored")
    blocks = []
    for i in range(n):
        p = f"{MTP_PREFIX}{i}."
        try:
            block = _block_tensors(v, c, p, kind="sliding_attention", hashed=False)
            block.update({name: v.tensor(p + release) for name, release in MTP_OWN.items()})
        except InvalidArgument as e:
            raise InvalidArgument(f"{e}; its config declares {n} MTP block(s) (num_nextn_predict_layers; "
                                  "0 packs the model without MTP)") from None
        blocks.append(block)
    return {MTP_PREFIX + name: torch.stack([b[name] for b in blocks]) for name in (blocks[0] if blocks else {})}


def layer_tensors(ckpt: Checkpoint, layer: int, weights_dtype: str = "f32") -> dict[str, torch.Tensor]:
    """Layer ``layer``'s slice of every ``layers.*`` tensor, and of the ``hash.*`` / ``csa.*`` /
    ``hca.*`` tensors when the layer is of that kind (slices placed by :func:`stack_index`);
    fused as the module docstring's table says."""
    v = _view(ckpt)
    c: DeepseekV4Config = ckpt.config
    block = _block_tensors(v, c, f"layers.{layer}.", kind=c.layer_types[layer], hashed=layer in c.hash_layers,
                           layer=layer)
    return {name if "." in name else f"layers.{name}": t for name, t in block.items()}


def _block_tensors(v: ReleaseView, c: DeepseekV4Config, p: str, *, kind: str, hashed: bool,
                   layer: int | None = None) -> dict[str, torch.Tensor]:
    """One block's tensors from the release names under prefix ``p`` (``layers.N.`` or
    ``mtp.i.``): the ``layers.*`` suffixes unprefixed (``attn_norm``, ...), and the group
    tensors of its ``kind`` / hash routing under their sidecar names (``csa.ape``, ...)."""
    t = lambda name: v.tensor(p + name)  # noqa: E731
    cat = lambda *names: torch.cat([t(n) for n in names])  # noqa: E731
    experts_gate_up, experts_down = v.experts(layer, c.n_routed_experts, prefix=p)
    out = {
        "attn_norm": t("attn_norm.weight"), "ffn_norm": t("ffn_norm.weight"),
        "hc_attn_fn": t("hc_attn_fn"), "hc_attn_base": t("hc_attn_base"), "hc_attn_scale": t("hc_attn_scale"),
        "hc_ffn_fn": t("hc_ffn_fn"), "hc_ffn_base": t("hc_ffn_base"), "hc_ffn_scale": t("hc_ffn_scale"),
        "wq_a": t("attn.wq_a.weight"), "q_norm": t("attn.q_norm.weight"), "wq_b": t("attn.wq_b.weight"),
        "wkv": t("attn.wkv.weight"), "kv_norm": t("attn.kv_norm.weight"),
        "wo_a": t("attn.wo_a.weight"), "wo_b": t("attn.wo_b.weight"), "attn_sink": t("attn.attn_sink"),
        "gate": t("ffn.gate.weight"),
        "gate_bias": torch.zeros(c.n_routed_experts) if hashed else t("ffn.gate.bias"),
        "shared_gate_up": cat("ffn.shared_experts.w1.weight", "ffn.shared_experts.w3.weight"),
        "shared_down": t("ffn.shared_experts.w2.weight"),
        "experts_gate_up": experts_gate_up, "experts_down": experts_down,
    }
    if hashed:
        tid2eid = t("ffn.gate.tid2eid")
        if tid2eid.is_floating_point() or (tid2eid.numel() and not (
                0 <= int(tid2eid.min()) and int(tid2eid.max()) < c.n_routed_experts)):
            raise InvalidArgument(f"{p}ffn.gate.tid2eid must hold expert indices in [0, {c.n_routed_experts})")
        out["hash.tid2eid"] = tid2eid.to(torch.int32)
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
