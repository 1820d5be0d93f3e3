"""The three namings of a DeepSeek V4 checkpoint, read as one (release names, float32 values).

=============  ===============================================  ===================================
naming         detected by (layer 0)                            example
=============  ===============================================  ===================================
``release``    ``layers.0.attn_norm.weight``                    ``layers.3.attn.wq_a.weight``,
                                                                ``layers.3.ffn.experts.7.w1.weight``,
                                                                ``embed.weight``, ``hc_head_fn``
``saved``      ``model.layers.0.attn_norm.weight``              what transformers'
                                                                ``save_pretrained`` writes: release
                                                                names under ``model.``, except
                                                                ``model.embed_tokens.weight``,
                                                                ``model.norm.weight``,
                                                                ``model.hc_head.hc_{fn,base,scale}``,
                                                                ``head.weight``, and the K=V norm
                                                                ``attn.norm.weight``
``transformers``  ``model.layers.0.input_layernorm.weight``     module names
                                                                (``model.layers.3.self_attn.q_a_proj.weight``,
                                                                merged ``mlp.experts.gate_up_proj``
                                                                [E, 2I, H] / ``down_proj`` [E, H, I],
                                                                ``lm_head.weight``)
=============  ===============================================  ===================================

The ``saved`` row was checked by calling ``save_pretrained`` on a tiny transformers 5.23
``DeepseekV4ForCausalLM`` (the reverse of the ``deepseek_v4`` entry of
``conversion_mapping.py``: its ``^`` anchors miss the ``model.`` prefix of the globals, and the
``\\.norm\\.`` -> ``.kv_norm.`` rule reversed turns ``kv_norm`` into ``norm``). Where a naming
has two spellings of one tensor (``attn.kv_norm.weight`` / ``attn.norm.weight``) both are tried.

:class:`ReleaseView` reads a tensor by its release name, whatever the naming, and dequantizes
the stored quantized forms (:mod:`model_families.deepseek_v4.quantized`) with their companion
scales: ``<prefix>.scale`` next to ``<prefix>.weight`` (release, saved) or
``<prefix>.weight_scale_inv`` / ``<param>_scale_inv`` (transformers; also accepted in the other
two). A missing tensor raises ``InvalidArgument`` naming its release name and the names looked
for. The MTP blocks' tensors (``mtp.i.*``, :mod:`model_families.deepseek_v4.pack`) have their
release names in every naming: transformers has no module for them and keeps ``mtp.*`` as stored.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from model_families.deepseek_v4 import quantized
from services.errors import InvalidArgument

RELEASE, SAVED, TRANSFORMERS = "release", "saved", "transformers"
NAMINGS = (RELEASE, SAVED, TRANSFORMERS)
#: Probe names (layer 0's attention norm) -> naming, in detection order.
_PROBES = (("layers.0.attn_norm.weight", RELEASE), ("model.layers.0.attn_norm.weight", SAVED),
           ("model.layers.0.input_layernorm.weight", TRANSFORMERS))

#: Release global name -> (saved name, transformers name).
_GLOBALS = {
    "embed.weight": ("model.embed_tokens.weight", "model.embed_tokens.weight"),
    "head.weight": ("head.weight", "lm_head.weight"),
    "norm.weight": ("model.norm.weight", "model.norm.weight"),
    "hc_head_fn": ("model.hc_head.hc_fn", "model.hc_head.hc_fn"),
    "hc_head_base": ("model.hc_head.hc_base", "model.hc_head.hc_base"),
    "hc_head_scale": ("model.hc_head.hc_scale", "model.hc_head.hc_scale"),
}

#: Release per-layer suffix prefix -> transformers suffix prefix (first match wins, so the
#: indexer's entries come before the attention's). The transformers side of
#: ``conversion_mapping.py``'s ``deepseek_v4`` renames.
_LAYER_TO_TRANSFORMERS = (
    ("attn.indexer.compressor.wkv.", "self_attn.compressor.indexer.kv_proj."),
    ("attn.indexer.compressor.wgate.", "self_attn.compressor.indexer.gate_proj."),
    ("attn.indexer.compressor.ape", "self_attn.compressor.indexer.position_bias"),
    ("attn.indexer.compressor.norm.", "self_attn.compressor.indexer.kv_norm."),
    ("attn.indexer.wq_b.", "self_attn.compressor.indexer.q_b_proj."),
    ("attn.indexer.weights_proj.", "self_attn.compressor.indexer.scorer.weights_proj."),
    ("attn.compressor.wkv.", "self_attn.compressor.kv_proj."),
    ("attn.compressor.wgate.", "self_attn.compressor.gate_proj."),
    ("attn.compressor.ape", "self_attn.compressor.position_bias"),
    ("attn.compressor.norm.", "self_attn.compressor.kv_norm."),
    ("attn.attn_sink", "self_attn.sinks"),
    ("attn.wq_a.", "self_attn.q_a_proj."),
    ("attn.q_norm.", "self_attn.q_a_norm."),
    ("attn.wq_b.", "self_attn.q_b_proj."),
    ("attn.wkv.", "self_attn.kv_proj."),
    ("attn.kv_norm.", "self_attn.kv_norm."),
    ("attn.wo_a.", "self_attn.o_a_proj."),
    ("attn.wo_b.", "self_attn.o_b_proj."),
    ("ffn.gate.bias", "mlp.gate.e_score_correction_bias"),
    ("ffn.gate.", "mlp.gate."),
    ("ffn.shared_experts.w1.", "mlp.shared_experts.gate_proj."),
    ("ffn.shared_experts.w3.", "mlp.shared_experts.up_proj."),
    ("ffn.shared_experts.w2.", "mlp.shared_experts.down_proj."),
    ("attn_norm.", "input_layernorm."),
    ("ffn_norm.", "post_attention_layernorm."),
    ("hc_attn_fn", "attn_hc.fn"), ("hc_attn_base", "attn_hc.base"), ("hc_attn_scale", "attn_hc.scale"),
    ("hc_ffn_fn", "ffn_hc.fn"), ("hc_ffn_base", "ffn_hc.base"), ("hc_ffn_scale", "ffn_hc.scale"),
)
#: Release per-layer suffix -> the other spellings tried in the release and saved namings.
_ALIASES = {"attn.kv_norm.weight": ("attn.norm.weight",)}
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"ffn\.experts\.(\d+)\.(w[123])\.weight")


def detect_naming(has) -> str:
    """The naming of a checkpoint whose ``has(name)`` answers membership (probes layer 0's
    attention norm); ``InvalidArgument`` listing the probes when none is found."""
    for probe, naming in _PROBES:
        if has(probe):
            return naming
    raise InvalidArgument("the checkpoint is in no DeepSeek V4 naming this reader knows: it has none of "
                          + ", ".join(p for p, _ in _PROBES))


def candidates(release_name: str, naming: str) -> tuple[str, ...]:
    """The names ``release_name`` may have in ``naming``, in the order tried. Routed experts
    (``layers.N.ffn.experts.E.w1.weight``) have none in the transformers naming (merged, see
    :meth:`ReleaseView.experts`); ``InvalidArgument`` for them there and for an unknown name."""
    if naming not in NAMINGS:
        raise InvalidArgument(f"unknown naming {naming!r}; one of {NAMINGS}")
    if release_name in _GLOBALS:
        saved, hf = _GLOBALS[release_name]
        return {RELEASE: (release_name,), SAVED: (saved,), TRANSFORMERS: (hf,)}[naming]
    if release_name.startswith("mtp."):
        return (release_name, *(release_name.replace(r, a) for r, alts in _ALIASES.items() for a in alts
                                if release_name.endswith(r)))
    m = _LAYER.fullmatch(release_name)
    if m is None:
        if naming == RELEASE:
            return (release_name,)
        raise InvalidArgument(f"no {naming} name for the release tensor {release_name}")
    layer, rest = m.groups()
    if naming != TRANSFORMERS:
        prefix = "" if naming == RELEASE else "model."
        return tuple(f"{prefix}layers.{layer}.{r}" for r in (rest, *_ALIASES.get(rest, ())))
    if _EXPERT.fullmatch(rest):
        raise InvalidArgument(f"routed expert {release_name} is merged in the transformers naming")
    for release, hf in _LAYER_TO_TRANSFORMERS:
        if rest.startswith(release):
            return (f"model.layers.{layer}.{hf}{rest[len(release):]}",)
    raise InvalidArgument(f"no transformers name for the release tensor {release_name}")


def scale_names(name: str) -> tuple[str, ...]:
    """The companion scale names a stored quantized tensor ``name`` may have:
    ``<prefix>.scale`` and ``<prefix>.weight_scale_inv`` for ``<prefix>.weight``, else
    ``<name>_scale_inv`` (a merged expert parameter)."""
    if name.endswith(".weight"):
        prefix = name[: -len(".weight")]
        return (f"{prefix}.scale", f"{prefix}.weight_scale_inv")
    return (f"{name}_scale_inv",)


class ReleaseView:
    """A :class:`model_families.family.Checkpoint` read by release names in float32.

    ``naming``: the detected naming. ``tensor(release_name)``: the stored tensor under its name in
    this naming, dequantized when stored FP8/FP4 with a companion scale, float tensors as
    float32, integer ones (``tid2eid``) as stored. ``experts(layer)``: the routed experts merged as
    transformers merges them."""

    def __init__(self, ckpt) -> None:
        self.ckpt = ckpt
        self.config = getattr(ckpt, "config", None)
        self.naming = detect_naming(ckpt.has)

    def has(self, release_name: str) -> bool:
        """Whether the checkpoint holds ``release_name`` in its naming."""
        return self.find(release_name) is not None

    def find(self, release_name: str) -> str | None:
        """The checkpoint's name for ``release_name``, or ``None`` when it has none."""
        return next((n for n in candidates(release_name, self.naming) if self.ckpt.has(n)), None)

    def tensor(self, release_name: str) -> torch.Tensor:
        """``release_name``'s value (see the class docstring); ``InvalidArgument`` naming the
        release name and the names looked for when the checkpoint lacks it."""
        name = self.find(release_name)
        if name is None:
            looked = ", ".join(candidates(release_name, self.naming))
            raise InvalidArgument(f"the DeepSeek V4 checkpoint ({self.naming} naming) lacks tensor {release_name} "
                                  f"(looked for {looked})")
        return self.read(name)

    def read(self, name: str, *, halves: bool = False) -> torch.Tensor:
        """The checkpoint tensor ``name`` (its own naming) as float32, dequantized with its
        companion scale when stored quantized; integer tensors without a scale as stored."""
        t = self.ckpt.tensor(name)
        if quantized.is_quantized(t):
            scale = next((s for s in scale_names(name) if self.ckpt.has(s)), None)
            if scale is not None:
                return quantized.dequantize(t, self.ckpt.tensor(scale), what=name, halves=halves)
            if quantized.is_fp8(t):
                raise InvalidArgument(f"{name} is stored FP8 but the checkpoint has no scale for it "
                                      f"(looked for {', '.join(scale_names(name))})")
            return t
        return t.to(torch.float32) if t.is_floating_point() else t

    def experts(self, layer: int | None, n_experts: int, prefix: str | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s routed experts (or, with ``prefix`` ``mtp.i.``, an MTP block's,
        stored per expert under release names in every naming) as ``(gate_up [E, 2I, H], down
        [E, H, I])``: each expert's ``w1`` rows then ``w3`` rows, and ``w2`` (transformers'
        merged layout)."""
        prefix = prefix or f"layers.{layer}."
        if self.naming == TRANSFORMERS and not prefix.startswith("mtp."):
            p = f"model.layers.{layer}.mlp.experts."
            for part in ("gate_up_proj", "down_proj"):
                if not self.ckpt.has(p + part):
                    raise InvalidArgument(f"the DeepSeek V4 checkpoint (transformers naming) lacks tensor "
                                          f"layers.{layer}.ffn.experts.*.{'w1/w3' if part == 'gate_up_proj' else 'w2'}"
                                          f".weight (looked for {p + part})")
            gate_up, down = self.read(p + "gate_up_proj", halves=True), self.read(p + "down_proj")
            if gate_up.shape[0] != n_experts or down.shape[0] != n_experts:
                raise InvalidArgument(f"{p}gate_up_proj / down_proj hold {gate_up.shape[0]} / {down.shape[0]} "
                                      f"experts, the config says {n_experts}")
            return gate_up, down
        e_name = lambda e, w: f"{prefix}ffn.experts.{e}.{w}.weight"  # noqa: E731
        gate_up = torch.stack([torch.cat([self.tensor(e_name(e, "w1")), self.tensor(e_name(e, "w3"))])
                               for e in range(n_experts)])
        down = torch.stack([self.tensor(e_name(e, "w2")) for e in range(n_experts)])
        return gate_up, down

    def names(self) -> Iterable[str]:
        """Every tensor name the checkpoint holds (its own naming), when the reader can list
        them (``names()``); else nothing."""
        lister = getattr(self.ckpt, "names", None)
        return list(lister()) if lister is not None else []
