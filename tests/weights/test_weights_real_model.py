"""The bundled SmolLM2 GGUF packed to float32 equals transformers' own GGUF-loaded model, tensor
by tensor, and the exported tokenizer encodes like transformers' GGUF tokenizer."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer
from weights_tiny import _llamacpp_permute

from model_families import quant
from weight_service.loader import load_sidecar

pytestmark = pytest.mark.slow


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item()


def test_sidecar_tensors_equal_transformers_gguf_model(smollm2_sidecar, hf_model):
    hf = hf_model.config
    nh, nkv = hf.num_attention_heads, hf.num_key_value_heads
    hd = hf.hidden_size // nh
    with load_sidecar(smollm2_sidecar) as sc:
        t = sc.tensors
        assert sc.config["num_hidden_layers"] == hf.num_hidden_layers == 30
        assert sc.config["tie_word_embeddings"] is True and "lm_head" not in t
        assert sc.metadata["warmserve.dtype"] == "f32" and t["embed_tokens"].dtype == torch.float32
        assert _max_diff(t["embed_tokens"], hf_model.model.embed_tokens.weight) <= 1e-6
        assert _max_diff(t["embed_tokens"], hf_model.lm_head.weight) <= 1e-6  # tied
        assert _max_diff(t["final_norm"], hf_model.model.norm.weight) <= 1e-6
        worst = 0.0
        for i, layer in enumerate(hf_model.model.layers):
            att, mlp = layer.self_attn, layer.mlp
            qkv = t["layers.qkv_proj"][i]
            q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd])
            gate, up = t["layers.gate_up_proj"][i].chunk(2)
            pairs = [
                (q, att.q_proj.weight), (k, att.k_proj.weight), (v, att.v_proj.weight),
                (t["layers.o_proj"][i], att.o_proj.weight),
                (gate, mlp.gate_proj.weight), (up, mlp.up_proj.weight),
                (t["layers.down_proj"][i], mlp.down_proj.weight),
                (t["layers.input_norm"][i], layer.input_layernorm.weight),
                (t["layers.post_attn_norm"][i], layer.post_attention_layernorm.weight),
            ]
            for ours, ref in pairs:
                worst = max(worst, _max_diff(ours, ref.detach()))
        assert worst <= 1e-6
        # The weights are not trivially equal (e.g. all zero): q differs from k where both exist.
        assert t["layers.qkv_proj"][0].abs().sum() > 0


#: GGUF tensor stem -> (sidecar projection, first row, end row) for SmolLM2 (nh 9, nkv 3, hd 64).
_ROWS = {"attn_q": ("layers.qkv_proj", 0, 576), "attn_k": ("layers.qkv_proj", 576, 768),
         "attn_v": ("layers.qkv_proj", 768, 960), "attn_output": ("layers.o_proj", 0, 576),
         "ffn_gate": ("layers.gate_up_proj", 0, 1536), "ffn_up": ("layers.gate_up_proj", 1536, 3072),
         "ffn_down": ("layers.down_proj", 0, 576)}


def test_int4_sidecar_holds_the_gguf_q4_1_values_exactly(smollm2_int4_sidecar, smollm2_sidecar, smollm2_gguf):
    """Every one of the 210 Q4_1 matrices, decoded from the int4 sidecar with
    (q - 8) * scale + zero, equals gguf's own dequantization bit for bit (rows permuted back
    with llama.cpp's permutation), and so equals the f32 sidecar (the dequantized model)."""
    reader = gguf.GGUFReader(smollm2_gguf)
    checked = 0
    with load_sidecar(smollm2_int4_sidecar) as sc, load_sidecar(smollm2_sidecar) as ref:
        assert sc.metadata["warmserve.dtype"] == "int4"
        for t in reader.tensors:
            if t.tensor_type != gguf.GGMLQuantizationType.Q4_1:
                continue
            _, layer, stem, _ = t.name.split(".")
            name, a, b = _ROWS[stem]
            parts = {p: sc.tensors[f"{name}.{p}"][int(layer)][a:b] for p in quant.FORMATS["int4"]}
            ours = quant.dequantize(parts).numpy()
            expected = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(ours.shape)
            heads = {"attn_q": 9, "attn_k": 3}.get(stem)
            assert np.array_equal(_llamacpp_permute(ours, heads) if heads else ours, expected), t.name
            assert np.array_equal(ours, ref.tensors[name][int(layer)][a:b].numpy()), t.name
            checked += 1
        assert checked == 210
        assert torch.equal(sc.tensors["embed_tokens"], ref.tensors["embed_tokens"].to(torch.bfloat16))
        assert torch.equal(sc.tensors["layers.post_attn_norm"], ref.tensors["layers.post_attn_norm"])
    f32_bytes = (smollm2_sidecar / "model.safetensors").stat().st_size
    int4_bytes = (smollm2_int4_sidecar / "model.safetensors").stat().st_size
    assert int4_bytes < f32_bytes / 3.9, (int4_bytes, f32_bytes)  # 136 MB vs 538 MB


def test_sidecar_config_matches_transformers(smollm2_sidecar, hf_model):
    cfg = json.loads((smollm2_sidecar / "config.json").read_text())
    hf = hf_model.config
    assert cfg["vocab_size"] == hf.vocab_size == 49152
    assert cfg["hidden_size"] == hf.hidden_size and cfg["intermediate_size"] == hf.intermediate_size
    assert cfg["num_attention_heads"] == hf.num_attention_heads
    assert cfg["num_key_value_heads"] == hf.num_key_value_heads
    assert cfg["head_dim"] == hf.hidden_size // hf.num_attention_heads
    assert cfg["rms_norm_eps"] == pytest.approx(hf.rms_norm_eps, rel=1e-6)
    assert cfg["rope_theta"] == pytest.approx(hf.rope_parameters["rope_theta"])
    assert cfg["rope_scaling"] is None
    assert cfg["max_position_embeddings"] == hf.max_position_embeddings
    assert cfg["bos_token_id"] == hf.bos_token_id and cfg["eos_token_id"] == hf.eos_token_id
    assert cfg["architecture"] == "LlamaForCausalLM" and cfg["attention_bias"] is False


PROMPTS = [
    "Hello!",
    "Héllo wörld — naïve café, 日本語のテキスト, emoji 🤖🎉",
    "digits 1234567890 3.14159 and 1,000,000; year 2025",
    "whitespace   runs\t\ttabs\n\n\nnewlines    end  ",
    "special tokens inline <|im_start|>user\nnested<|im_end|> <|endoftext|>",
    "code: def f(x):\n    return x**2  # square",
]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_exported_tokenizer_matches_transformers(smollm2_sidecar, hf_tokenizer, prompt):
    ours = Tokenizer.from_file(str(smollm2_sidecar / "tokenizer.json"))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt}]
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = hf_tokenizer(text)["input_ids"]
    assert ours.encode(text).ids == expected
    assert ours.decode(expected, skip_special_tokens=False) == text


def test_exported_tokenizer_config_renders_the_same_chat_prompt(smollm2_sidecar, hf_tokenizer):
    import jinja2

    cfg = json.loads((smollm2_sidecar / "tokenizer_config.json").read_text())
    assert cfg["bos_token"] == hf_tokenizer.bos_token == "<|im_start|>"
    assert cfg["eos_token"] == hf_tokenizer.eos_token == "<|im_end|>"
    assert cfg["add_bos_token"] is False
    messages = [{"role": "user", "content": "What is 2+2?"}]
    ours = jinja2.Environment().from_string(cfg["chat_template"]).render(
        messages=messages, add_generation_prompt=True, bos_token=cfg["bos_token"], eos_token=cfg["eos_token"])
    assert ours == hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ours_tok = Tokenizer.from_file(str(smollm2_sidecar / "tokenizer.json"))
    assert ours_tok.token_to_id("<|im_start|>") == 1 and ours_tok.token_to_id("<|im_end|>") == 2


def _mapping_rss(path) -> int:
    """Bytes of ``path``'s mappings resident in this process (``/proc/self/smaps`` ``Rss``)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line
            inside = len(head) >= 6 and head[5] == str(path)
        elif inside and head[0] == "Rss:":
            total += int(head[1]) * 1024
    return total


def test_an_int4_runner_drops_the_pages_it_read_once_to_convert(smollm2_int4_sidecar):
    """After the int4 codes are converted into the kernel's layout, the sidecar pages only they
    lie on leave the runner's resident set; the tensors still read back the file's bytes
    (safetensors' own reader is the reference)."""
    import mmap

    from safetensors import safe_open

    from model_families.llama import FAMILY

    path = (smollm2_int4_sidecar / "model.safetensors").resolve()
    with load_sidecar(smollm2_int4_sidecar) as sc:
        for t in sc.tensors.values():
            t.sum()  # every page resident in this mapping
        size = path.stat().st_size
        assert _mapping_rss(path) >= size - mmap.PAGESIZE
        args = FAMILY.config_from_dict(sc.config)
        weights = FAMILY.load_weights(args, sc.tensors, torch.bfloat16, torch.device("cpu"), sc.weights_dtype)
        kept = [t for t in weights.tensors().values()]
        released = sc.release_unused(kept)
        kept_ptrs = {t.untyped_storage().data_ptr() for t in kept}
        unkept = {n: t.nbytes for n, t in sc.tensors.items() if t.untyped_storage().data_ptr() not in kept_ptrs}
        assert {n for n in sc.tensors if n.endswith(".qweight")} <= set(unkept)  # converted, never read again
        assert "embed_tokens" not in unkept  # bf16 in the sidecar: used in place
        whole = sum(unkept.values())  # less at most a page at each edge of each run of unkept tensors
        assert whole > 50 * 2**20 and whole - 2 * len(unkept) * mmap.PAGESIZE <= released <= whole
        assert _mapping_rss(path) <= size - released + mmap.PAGESIZE  # the last page is partly the file
        with safe_open(str(path), framework="pt") as ref:
            name = "layers.gate_up_proj.qweight"
            assert torch.equal(sc.tensors[name], ref.get_tensor(name))  # faults back the same bytes


def test_a_head_multiplied_from_its_int8_copy_leaves_the_resident_set(smollm2_int4_sidecar):
    """With int8 activations the head's int8 copy serves every row count, so no matmul reads the
    plain bf16 head: it gets no oneDNN-blocked copy, :meth:`LoadedSidecar.release` drops its
    mapped pages (tied, it is the embedding table: 49152 x 576 bf16), and a gather faults back
    the file's bytes. Without int8 activations the plain head is still read (steps of 8 rows or
    more, through its blocked copy): nothing to drop."""
    import mmap

    from safetensors import safe_open

    from model_families import native, prepack
    from model_families.prepack import PackedMatrices

    path = (smollm2_int4_sidecar / "model.safetensors").resolve()
    with load_sidecar(smollm2_int4_sidecar) as sc:
        head = sc.tensors["embed_tokens"]
        assert head.dtype == torch.bfloat16 and tuple(head.shape) == (49152, 576)
        head.sum()  # resident, as after the int8 copy is packed from it
        before = _mapping_rss(path)
        plain = PackedMatrices([head], batch_hint=8, head=head, int8_activations=False)
        assert plain.head_unread is None and len(plain) == int(prepack._HAS_ONEDNN)  # its blocked copy
        plain.close()
        packed = PackedMatrices([head], batch_hint=8, head=head, int8_activations=True)
        try:
            if not native.int8_activations_enabled():  # no VNNI: bf16 activations, the head is read
                assert packed.head_unread is None and len(packed) == int(prepack._HAS_ONEDNN)
                return
            assert packed.head_unread is head and len(packed) == 0  # no blocked copy either
            assert packed.nbytes < head.nbytes  # the int8 copy and its scales only
            released = sc.release([packed.head_unread])
            assert head.nbytes - 2 * mmap.PAGESIZE <= released <= head.nbytes  # whole pages inside it
            assert before - _mapping_rss(path) >= released - mmap.PAGESIZE
            ids = torch.tensor([0, 17, 2047, 49151])
            with safe_open(str(path), framework="pt") as ref:
                assert torch.equal(torch.nn.functional.embedding(ids, head), ref.get_tensor("embed_tokens")[ids])
            assert sc.release([torch.zeros(4)]) == 0  # not in the mapping
        finally:
            packed.close()
        assert packed.head_unread is None
