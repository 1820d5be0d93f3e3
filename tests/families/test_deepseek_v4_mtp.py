"""DeepSeek V4's MTP block (the release's ``inference/model.py`` ``MTPBlock``) against a reference
built from transformers' own modules (``deepseek_v4_tiny.TinyMTP``: a ``DeepseekV4DecoderLayer``
plus the block's projections, norms and ``DeepseekV4HyperHead``), fed the residual streams a
hook captures at the input of transformers' ``hc_head``.

The checkpoint goes the whole way a user's goes (written in the release naming, packed by the
weight service, loaded by the runner); the sequence runs past the window (8) so the block's own
window ring is exercised, in one call, in chunks and one position at a time, and recurrently
(a second draft from the block's own output streams)."""

from __future__ import annotations

import pytest
import torch
from deepseek_v4_tiny import TINY_ALL_KINDS, TINY_HC4, write_tiny_deepseek_v4

from model_families.deepseek_v4 import FAMILY
from runner_service.kv_cache import KVCache
from weight_service.loader import load_sidecar
from weight_service.prepare import prepare

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

PRESETS = {"all_kinds_hc2": TINY_ALL_KINDS, "hc4_2layers": TINY_HC4}
BLOCKS, BS = 64, 4


@pytest.fixture(scope="module", params=sorted(PRESETS))
def packed(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"dsv4-mtp-{request.param}")
    reference = write_tiny_deepseek_v4(root / "ckpt", PRESETS[request.param])
    with load_sidecar(prepare(str(root / "ckpt"), root=root / "sidecars").path) as sidecar:
        config = FAMILY.config_from_dict(sidecar.config)
        tensors = {name: t.clone() for name, t in sidecar.tensors.items()}
    weights = FAMILY.load_weights(config, tensors, torch.float32, torch.device("cpu"))
    return reference, config, FAMILY.build_model(config, weights, 256)


def _reference_streams(reference, ids: list[int]) -> torch.Tensor:
    """transformers' residual streams [1, S, n, H] at the input of its ``hc_head``."""
    seen = {}
    hook = reference.model.hc_head.register_forward_pre_hook(lambda _m, args: seen.setdefault("h", args[0]))
    try:
        with torch.no_grad():
            reference(torch.tensor([ids]), use_cache=False)
    finally:
        hook.remove()
    return seen["h"]


def test_mtp_draft_logits_equal_the_reference_whole_chunked_and_recurrent(packed):
    reference, config, model = packed
    ids = torch.randint(3, 120, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    S = len(ids)
    layout = FAMILY.block_layout(config, BS, 256)
    table = torch.tensor([list(range(1, 1 + layout.blocks_needed(S + 1)))])
    kv = KVCache(FAMILY.cache_specs(config, BS), BLOCKS, BS, torch.float32, torch.device("cpu"))
    with torch.inference_mode():
        _, streams = model.streams(kv.tensors, torch.tensor([ids]), torch.arange(S)[None],
                                   torch.zeros(1, S, dtype=torch.int64), table, torch.tensor([S]))
    want_streams = _reference_streams(reference, ids)
    torch.testing.assert_close(streams, want_streams, atol=1e-4, rtol=0)

    mtp = reference.mtp_blocks[0]
    with torch.no_grad():  # pairs (h_p, token p + 1) for p = 0 .. S - 2
        want, want_out = mtp(want_streams[:, :-1], torch.tensor([ids[1:]]))

    def pool():
        return torch.zeros(config.num_nextn_predict_layers, BLOCKS, BS, config.head_dim)

    def run(p, start, n):
        return model.mtp(p, streams[:, start:start + n], torch.tensor([ids[start + 1:start + 1 + n]]),
                         torch.arange(start, start + n)[None], table, torch.tensor([start + n]))

    with torch.inference_mode():
        whole_pool = pool()
        whole, out = run(whole_pool, 0, S - 1)
        torch.testing.assert_close(whole, want, atol=1e-4, rtol=0)
        torch.testing.assert_close(out, want_out, atol=1e-4, rtol=0)
        for chunks in ([10, 1, 7, 11], [1] * (S - 1)):  # the block's ring carries the context across calls
            p, start, got = pool(), 0, []
            for n in chunks:
                got.append(run(p, start, n)[0])
                start += n
            torch.testing.assert_close(torch.cat(got, dim=1), want, atol=1e-4, rtol=0)
        # a second draft: the block's own output streams at the last position, with the first draft
        draft = int(whole[0, -1].argmax())
        second, _ = model.mtp(whole_pool, out[:, -1:], torch.tensor([[draft]]), torch.tensor([[S - 1]]), table,
                              torch.tensor([S]))
    with torch.no_grad():
        ref_second, _ = mtp(torch.cat([want_streams[:, :-1], want_out[:, -1:]], dim=1), torch.tensor([ids[1:] + [draft]]))
    torch.testing.assert_close(second[0, -1], ref_second[0, -1], atol=1e-4, rtol=0)
