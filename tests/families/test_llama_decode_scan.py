"""With ``LlamaModel.scan_layers`` the exported Llama decode runs its layers as one ``scan`` loop
(docs/architecture.md §9, "Compile time"): the exported graph holds the layer body once whatever the layer count, and computes what
the eager decode (the unrolled loop, checked against transformers in test_llama_model.py) does.
Export only, no C++ compile (the compiled program is compared in tests/runner/test_runner_programs.py)."""

from __future__ import annotations

import pytest
import torch
from runner_tiny import tiny_args

from model_families import native
from model_families.llama import FAMILY as LLAMA
from model_families.llama.model import LlamaModel

BLOCKS, BLOCK_SIZE = 12, 4


def _model(layers: int, bias: bool = False, weights_dtype: str = "f32", group: int = 1
           ) -> tuple[LlamaModel, tuple]:
    args = tiny_args(vocab=96, hidden=32, inter=64, layers=layers, heads=4, kv_heads=2, head_dim=8, max_pos=64,
                     bias=bias)
    model = LLAMA.build_model(args, LLAMA.random_weights(args, seed=layers, weights_dtype=weights_dtype), 64)
    model.scan_layers = group  # off by default (its step is slower); what is tested is the loop
    g = torch.Generator().manual_seed(7)
    pools = tuple(torch.randn((layers, BLOCKS, BLOCK_SIZE, 2, 8), generator=g) for _ in range(2))
    return model, pools


def _export(model: LlamaModel, pools: tuple) -> torch.export.ExportedProgram:
    """Export the decode module as the runner does (batch and block-table width dynamic)."""
    Dim = torch.export.Dim
    batch, width = Dim("batch", min=1, max=8), Dim("blocks", min=1, max=8)
    row = {0: batch}
    example = (pools, torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64),
               torch.zeros(2, dtype=torch.int64), torch.zeros((2, 2), dtype=torch.int64), torch.ones(2, dtype=torch.int64))
    dynamic = (({1: Dim("num_blocks", min=2)},) * 2, row, row, row, {0: batch, 1: width}, row)
    with torch.no_grad():
        return torch.export.export(LLAMA.decode_module(model), example, dynamic_shapes=dynamic, strict=False)


def _calls(ep: torch.export.ExportedProgram) -> list[str]:
    return [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]


def _inputs(batch: int, width: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Row i decodes at a random position < width * BLOCK_SIZE over random distinct blocks."""
    g = torch.Generator().manual_seed(seed)
    tables = torch.stack([torch.randperm(BLOCKS - 1, generator=g)[:width] + 1 for _ in range(batch)])
    pos = torch.randint(0, width * BLOCK_SIZE, (batch,), generator=g)
    slots = tables[torch.arange(batch), pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
    return torch.randint(0, 96, (batch,), generator=g), pos, slots, tables, pos + 1


@pytest.fixture(scope="module")
def exported() -> dict:
    """(model, pools, exported program) of a 2-layer model, a 3-layer one with a q/k/v bias
    (Qwen2), and a 5-layer one looping 2 layers per iteration (its last layer after the loop)."""
    out = {}
    for name, layers, bias, group in (("2", 2, False, 1), ("3-bias", 3, True, 1), ("5-g2", 5, False, 2)):
        model, pools = _model(layers, bias=bias, group=group)
        out[name] = model, pools, _export(model, pools)
    return out


@pytest.mark.parametrize("name, group, after", [("2", 1, 0), ("3-bias", 1, 0), ("5-g2", 2, 1)])
def test_the_graph_holds_the_layer_body_once(exported, name, group, after):
    ep = exported[name][2]
    linear = str(torch.ops.warmserve.linear.default)
    assert _calls(ep).count("scan") == 1
    # the head, and the layers after the loop (5 = 2 x 2 + 1); no other layer's matrices outside it
    assert _calls(ep).count(linear) == 1 + 4 * after
    body = [str(n.target) for n in ep.graph_module.scan_combine_graph_0.graph.nodes if n.op == "call_function"]
    assert body.count(linear) == 4 * group  # qkv, o, gate_up, down: the prepacked-matrix op, once a layer


@pytest.mark.parametrize("name", ["2", "3-bias", "5-g2"])
def test_the_loop_computes_what_the_eager_decode_does(exported, name):
    model, pools, ep = exported[name]
    program = ep.module()
    layers = model.config.num_hidden_layers
    step = LLAMA.decode_module(model)
    for n, (batch, width) in enumerate([(1, 1), (3, 2), (8, 3)]):
        inputs = _inputs(batch, width, seed=n)
        with torch.no_grad():
            got, want = program(pools, *inputs), step(pools, *inputs)
        assert [tuple(t.shape) for t in got] == [(batch, 96), (layers, batch, 2, 8), (layers, batch, 2, 8)]
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("weights_dtype", ["int8", "int4"])
def test_quantized_matrices_loop_too_and_compute_what_the_eager_decode_does(weights_dtype):
    """A quantized weight's stacked parts go through the loop and are rebuilt per layer as the
    matrix ``linear`` runs (int4 in float32: the sidecar's groups, dequantized per matmul)."""
    model, pools = _model(2, weights_dtype=weights_dtype)
    ep = _export(model, pools)
    assert "scan" in _calls(ep)
    inputs = _inputs(3, 2, seed=4)
    with torch.no_grad():
        got, want = ep.module()(pools, *inputs), LLAMA.decode_module(model)(pools, *inputs)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.slow  # one AOTI compile of the loop (C++ compiler)
def test_the_compiled_loop_computes_what_the_eager_decode_does(exported, tmp_path):
    from runner_service.programs.aoti import AotiProgram, compile_aoti

    model, pools, _ep = exported["3-bias"]
    step = LLAMA.decode_module(model)
    example = (pools, *_inputs(2, 2, seed=9))
    Dim = torch.export.Dim
    batch, width = Dim("batch", min=1, max=8), Dim("blocks", min=1, max=8)
    dynamic = (({1: Dim("num_blocks", min=2)},) * 2, {0: batch}, {0: batch}, {0: batch}, {0: batch, 1: width},
               {0: batch})
    program = AotiProgram(compile_aoti(step, example, dynamic, tmp_path / "loop.pt2"), step, torch.device("cpu"))
    for n, (batch_size, blocks) in enumerate([(1, 1), (3, 2), (8, 3)]):
        inputs = _inputs(batch_size, blocks, seed=20 + n)
        with torch.no_grad():
            got, want = program(pools, *inputs), step(pools, *inputs)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.slow  # one AOTI compile of the loop (C++ compiler)
@pytest.mark.parametrize("int8_activations", [False, True])
def test_the_compiled_loop_over_int4_in_bf16_computes_what_the_eager_decode_does(int8_activations, tmp_path):
    """bf16 over int4 runs warmserve's int4 kernel (PyTorch's where it cannot be built); inside
    the loop body it is the custom op ``warmserve::int4_tiles_linear`` (``warmserve::int4_linear``
    for PyTorch's: Inductor's own lowering of that kernel makes C++ that does not compile there),
    or with int8 activations the op ``warmserve::int4_mm_tiles_a8`` itself (the body rebuilds each
    layer's matrix with its flag), once a layer, and the compiled loop gives the eager step's logits."""
    from model_families.quantized_weights import Int4TileWeight
    from runner_service.programs.aoti import AotiProgram, compile_aoti

    args = tiny_args(vocab=96, hidden=64, inter=128, layers=2, heads=4, kv_heads=2, head_dim=16, max_pos=64)
    int8_activations = int8_activations and native.int8_activations_enabled()  # else the bf16 path again
    model = LLAMA.build_model(args, LLAMA.random_weights(args, torch.bfloat16, seed=3, weights_dtype="int4"), 64)
    for m in model.modules():
        if isinstance(m, Int4TileWeight):
            m.int8_activations = int8_activations
    model.scan_layers = 1
    g = torch.Generator().manual_seed(7)
    pools = tuple(torch.randn((2, BLOCKS, BLOCK_SIZE, 2, 16), generator=g).to(torch.bfloat16) for _ in range(2))
    step = LLAMA.decode_module(model)
    Dim = torch.export.Dim
    batch, width = Dim("batch", min=1, max=8), Dim("blocks", min=1, max=8)
    dynamic = (({1: Dim("num_blocks", min=2)},) * 2, {0: batch}, {0: batch}, {0: batch}, {0: batch, 1: width},
               {0: batch})
    example = (pools, *_inputs(2, 2, seed=9))
    with torch.no_grad():
        ep = torch.export.export(step, example, dynamic_shapes=dynamic, strict=False)
    body = [str(n.target) for n in ep.graph_module.scan_combine_graph_0.graph.nodes if n.op == "call_function"]
    tiles = isinstance(model.qkv_proj, Int4TileWeight)
    assert tiles == native.int4_tiles_enabled()
    op = (torch.ops.warmserve.int4_mm_tiles_a8 if int8_activations else
          torch.ops.warmserve.int4_tiles_linear if tiles else torch.ops.warmserve.int4_linear)
    assert body.count(str(op.default)) == 4  # qkv, o, gate_up, down
    assert str(torch.ops.aten._weight_int4pack_mm_for_cpu.default) not in body
    program = AotiProgram(compile_aoti(step, example, dynamic, tmp_path / "loop-int4.pt2"), step, torch.device("cpu"))
    for n, (batch_size, blocks) in enumerate([(1, 1), (3, 2), (8, 3)]):
        inputs = _inputs(batch_size, blocks, seed=30 + n)
        with torch.no_grad():
            got, want = program(pools, *inputs), step(pools, *inputs)
        for a, b in zip(got, want, strict=True):  # bf16: Inductor fuses the norms and the rope its own way
            torch.testing.assert_close(a.float(), b.float(), atol=3e-2, rtol=0)


def _prefill_inputs(seed: int) -> tuple[torch.Tensor, ...]:
    """Three rows over distinct blocks: a 4-token chunk after 5 cached tokens, a 6-token prompt,
    and a 2-token chunk after 7 cached ones, padded to 6 tokens (padding writes the scratch
    block 0); ``last`` each row's last real token."""
    g = torch.Generator().manual_seed(seed)
    starts, counts, S = [5, 0, 7], [4, 6, 2], 6
    tables = (torch.randperm(BLOCKS - 1, generator=g)[:9] + 1).view(3, 3)  # no block in two rows
    ids = torch.randint(0, 96, (3, S), generator=g)
    pos, slots = torch.zeros(3, S, dtype=torch.int64), torch.zeros(3, S, dtype=torch.int64)
    for b, (st, n) in enumerate(zip(starts, counts, strict=True)):
        p = torch.arange(st, st + n)
        pos[b, :n], slots[b, :n] = p, tables[b, p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
    lens = torch.tensor([st + n for st, n in zip(starts, counts, strict=True)])
    return ids, pos, slots, tables, lens, torch.tensor(counts) - 1


@pytest.mark.parametrize("layers, group", [(3, 1), (5, 2)])
def test_the_looped_prefill_writes_and_computes_what_the_eager_prefill_does(layers, group):
    """The exported prefill's loop only reads the pools and returns the rows, which the program
    writes after it: same logits and same pools (every block, scratch block 0 aside) as the
    eager prefill, which writes each layer's rows before its attention."""
    model, pools = _model(layers, group=group)
    Dim = torch.export.Dim
    batch, tokens, width = Dim("batch", min=1, max=8), Dim("tokens", min=2, max=16), Dim("blocks", min=1, max=8)
    grid, row = {0: batch, 1: tokens}, {0: batch}
    example = (pools, *(torch.zeros((2, 2), dtype=torch.int64) for _ in range(3)),
               torch.zeros((2, 2), dtype=torch.int64), torch.ones(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64))
    dynamic = (({1: Dim("num_blocks", min=2)},) * 2, grid, grid, grid, {0: batch, 1: width}, row, row)
    with torch.no_grad():
        ep = torch.export.export(model, example, dynamic_shapes=dynamic, strict=False)
    assert _calls(ep).count("scan") == 1
    inputs = _prefill_inputs(seed=layers)
    got_pools, want_pools = tuple(p.clone() for p in pools), tuple(p.clone() for p in pools)
    with torch.no_grad():
        got = ep.module()(got_pools, *inputs)
        want = model(want_pools, *inputs)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    for a, b, before in zip(got_pools, want_pools, pools, strict=True):
        assert not torch.equal(b[:, 1:], before[:, 1:])  # the prefill wrote rows
        torch.testing.assert_close(a[:, 1:], b[:, 1:], atol=1e-5, rtol=0)
