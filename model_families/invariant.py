"""Batch-invariant kernels (``EngineConfig.batch_invariant``, ``--batch-invariant``): a token's
results do not depend on the other rows of its step, on how its prompt was chunked, nor on
whether its prefix came from the prefix cache (``docs/architecture.md`` §7, "Batch-invariant
mode").

Where stock CPU kernels depend on the batch, and what is used instead while a
:class:`RowPolicy` is active (:func:`active_policy`; the model runner activates it around its
eager steps, so :func:`model_families.linear.linear`, :func:`model_families.attention.paged_attention`
and :func:`silu` dispatch here):

- **Matmuls.** oneDNN (and MKL) pick their kernel by the row count ``M``; a row's bits can change
  with it. :meth:`RowPolicy.rows` runs every matmul at row counts the start-up probe
  (:func:`probe_rows`) found to give the same bits: at least :data:`MIN_ROWS` rows (padded with
  zero rows), or, where even that varies, fixed tiles of :data:`TILE_ROWS` rows.
- **Attention.** Prefill and decode run one kernel (:func:`paged_attention`): each query token
  attends over its row's gathered keys exactly as a decode step would, and every sum over the
  keys is taken in fixed chunks of one KV block, the chunks then added left to right in float64
  (``cumsum``). Keys past a query's position contribute exact zeros, so neither the padded
  block-table width nor the chunking of a prompt changes a bit.
- **Elementwise functions.** PyTorch computes some (``silu``, ``sigmoid``) with a vector kernel
  and a scalar one for the tail of each parallel chunk, which differ in the last bit, so a value
  depends on where it falls in the tensor; :func:`silu` uses ``exp`` and IEEE division instead
  (``exp`` runs one vectorized kernel, tail included).
- RMSNorm, RoPE, the embedding and sampling are per row already (checked by the tests).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.errors import FailedPrecondition

#: Fewest rows a matmul runs with: oneDNN's one-row (matrix-vector) path rounds differently from
#: its matrix-matrix path, which on the hosts measured gives the same bits for any ``M >= 2``.
MIN_ROWS = 2
#: Rows per tile where the probe finds the row count matters beyond :data:`MIN_ROWS`.
TILE_ROWS = 16
#: Row counts the probe compares (those up to the matrix's largest use).
PROBE_ROWS = (2, 3, 5, 8, 9, 16, 17, 31, 32, 33, 64, 65, 100, 128, 257, 512)
#: Elements of the largest temporary the attention materialises per query chunk (float32).
ATTENTION_CHUNK_ELEMENTS = 1 << 23

_ACTIVE: contextvars.ContextVar[RowPolicy | None] = contextvars.ContextVar("warmserve_batch_invariant", default=None)


@dataclass(frozen=True)
class RowPolicy:
    """How a batch-invariant matmul runs its ``M`` rows: with ``tile`` ``None``, all at once when
    ``M >= min_rows`` (else padded with zero rows to ``min_rows``); with ``tile``, in tiles of
    exactly ``tile`` rows, the last padded."""

    min_rows: int = MIN_ROWS
    tile: int | None = None

    def rows(self, x: torch.Tensor, matmul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``matmul`` (``[M, K] -> [M, N]``, rows independent) over ``x`` [..., K] -> [..., N], run
        at this policy's row counts."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        m = x2.shape[0]
        if self.tile is None:
            if m >= self.min_rows:
                y = matmul(x2.contiguous())
            else:
                y = matmul(torch.cat([x2, x2.new_zeros(self.min_rows - m, x2.shape[1])]))[:m]
        else:
            t = self.tile
            padded = torch.cat([x2, x2.new_zeros(-m % t, x2.shape[1])]) if m % t else x2.contiguous()
            y = torch.cat([matmul(padded[i:i + t]) for i in range(0, padded.shape[0], t)])[:m]
        return y.reshape(*lead, y.shape[-1])


def active_policy() -> RowPolicy | None:
    """The policy of the batch-invariant step running in this thread, or ``None`` (always while
    Dynamo traces: the mode runs eager, and Dynamo need not trace the context variable)."""
    if torch.compiler.is_compiling():
        return None
    return _ACTIVE.get()


@contextlib.contextmanager
def batch_invariant(policy: RowPolicy | None) -> Iterator[None]:
    """Run the block with ``policy`` active in this thread (``None``: stock kernels)."""
    token = _ACTIVE.set(policy)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def probe_rows(matmuls: Iterable[tuple[str, Callable[[torch.Tensor], torch.Tensor], int, int, torch.dtype]],
               seed: int = 0) -> RowPolicy:
    """Find a :class:`RowPolicy` under which each matmul's rows are independent of the row count.

    ``matmuls``: ``(name, fn, K, max_rows, dtype)``, ``fn`` ``[M, K] -> [M, N]`` on the
    model's device, used with up to ``max_rows`` rows. On random inputs, each row count of
    :data:`PROBE_ROWS` up to ``max_rows`` must give the first two rows and the last one the same
    bits as a two-row call; else tiles of :data:`TILE_ROWS` rows must give each row the same
    bits wherever it sits in the tile and whatever the other rows hold. Raises
    ``FailedPrecondition`` naming the matmul when neither holds (this host's kernels cannot run
    the mode)."""
    gen = torch.Generator().manual_seed(seed)
    probes = list(matmuls)
    policy = RowPolicy()
    for _name, fn, k, max_rows, dtype in probes:
        counts = [m for m in PROBE_ROWS if m <= max(max_rows, MIN_ROWS)]
        x = torch.randn(counts[-1], k, generator=gen).to(dtype)
        ref = fn(x[:2])
        for m in counts:
            y = fn(x[:m])
            if not (torch.equal(y[:2], ref) and torch.equal(y[m - 1:], fn(x[m - 2:m])[1:])):
                policy = RowPolicy(tile=TILE_ROWS)
                break
        if policy.tile is not None:
            break
    if policy.tile is None:
        return policy
    for name, fn, k, _max_rows, dtype in probes:
        t = TILE_ROWS
        x = torch.randn(t, k, generator=gen).to(dtype)
        ref = fn(x)
        for _ in range(3):
            perm = torch.randperm(t, generator=gen)
            other = torch.randn(t, k, generator=gen).to(dtype)
            other[0] = x[0]
            if not (torch.equal(fn(x[perm]), ref[perm]) and torch.equal(fn(other)[0], ref[0])):
                raise FailedPrecondition(f"batch-invariant mode: this host's matmul for {name} ({dtype}) gives "
                                         "rows that depend on the other rows of the batch")
    return policy


def silu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(x)`` elementwise, in ``x``'s dtype. With a batch-invariant policy active:
    ``x / (1 + exp(-x))`` in float32 (every element through the same kernels, whatever its place
    in the tensor); else ``F.silu``."""
    if active_policy() is None:
        return F.silu(x)
    xf = x.float()
    return (xf / (1 + torch.exp(-xf))).to(x.dtype)


def _chunked_sum(x: torch.Tensor, dim: int, chunk: int) -> torch.Tensor:
    """Sum over ``dim`` (its size a multiple of ``chunk``) in a fixed order: each run of
    ``chunk`` entries summed, then the runs added left to right in float64. Float32 result."""
    n = x.shape[dim]
    parts = x.unflatten(dim, (n // chunk, chunk)).sum(dim + 1)
    return parts.cumsum(dim, dtype=torch.float64).select(dim, -1).float()


def _own_rows(rows: torch.Tensor, new: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``rows`` [B, T, nkv, hd] with ``new`` [B, S, nkv, hd] at each row's step positions
    ``positions`` [B, S] (a padding token, whose position does not continue the row's run
    ``positions[b, 0] + s``, is left out)."""
    B, T = rows.shape[:2]
    S = positions.shape[1]
    valid = positions == positions[:, :1] + torch.arange(S, device=positions.device)
    flat = (torch.arange(B, device=positions.device)[:, None] * T + positions)[valid]
    out = rows.reshape(B * T, *rows.shape[2:]).clone()
    out[flat] = new[valid].to(out.dtype)
    return out.view_as(rows)


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                    positions: torch.Tensor, seq_lens: torch.Tensor, k_new: torch.Tensor | None = None,
                    v_new: torch.Tensor | None = None) -> torch.Tensor:
    """Batch-invariant paged attention, prefill and decode alike (arguments and result as
    :func:`model_families.attention.paged_attention`; ``k_new``/``v_new`` [B, S, nkv, hd], given
    together, stand in for the pool entries at the rows' step positions).

    For each query at position ``p``: scores ``q . k_t / sqrt(hd)`` over its row's keys
    ``t < T = nb * block_size`` in float32, keys ``t > p`` (or ``>= seq_len``) masked;
    ``e_t = exp(s_t - max s)``; ``out = (sum_t e_t v_t) / sum_t e_t``, each sum by
    :func:`_chunked_sum` in chunks of one block, so masked keys add exact zeros and a query's
    bits depend only on its own row's keys up to ``p``. Queries are processed in chunks whose
    temporaries hold at most :data:`ATTENTION_CHUNK_ELEMENTS` floats (a query's result does not
    depend on its chunk). Raises ``ValueError`` when only one of ``k_new``/``v_new`` is given."""
    if (k_new is None) != (v_new is None):
        raise ValueError("give the step's own K and V together (k_new and v_new), or neither")
    B, S, nh, hd = q.shape
    nb = block_tables.shape[1]
    bs, nkv = k_pool.shape[1], k_pool.shape[2]
    g, T = nh // nkv, nb * bs
    k = k_pool[block_tables].view(B, T, nkv, hd)
    v = v_pool[block_tables].view(B, T, nkv, hd)
    if k_new is not None:
        k, v = _own_rows(k, k_new, positions), _own_rows(v, v_new, positions)
    kf = k.float().view(B, 1, T, nkv, 1, hd)
    vf = v.float().view(B, 1, T, nkv, 1, hd)
    key_pos = torch.arange(T, device=q.device)
    visible = (key_pos[None, None, :] <= positions[:, :, None]) & (key_pos[None, None, :] < seq_lens[:, None, None])
    out = torch.empty((B, S, nh, hd), dtype=q.dtype, device=q.device)
    step = max(1, ATTENTION_CHUNK_ELEMENTS // max(1, B * T * nh * hd))
    for s0 in range(0, S, step):
        s1 = min(S, s0 + step)
        qf = q[:, s0:s1].float().reshape(B, s1 - s0, 1, nkv, g, hd) * hd ** -0.5
        scores = (qf * kf).sum(-1)  # [B, Sq, T, nkv, g]
        scores = scores.masked_fill(~visible[:, s0:s1, :, None, None], float("-inf"))
        e = torch.exp(scores - scores.amax(dim=2, keepdim=True))
        denom = _chunked_sum(e, 2, bs)  # [B, Sq, nkv, g]
        num = _chunked_sum(e[..., None] * vf, 2, bs)  # [B, Sq, nkv, g, hd]
        out[:, s0:s1] = (num / denom[..., None]).reshape(B, s1 - s0, nh, hd).to(q.dtype)
    return out
