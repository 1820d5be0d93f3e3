"""Token sampling from next-token logits, per request.

For each row (the order transformers' ``generate`` uses): greedy rows (``temperature == 0``)
take ``argmax``; other rows divide the logits by ``temperature``, keep the ``top_k`` largest
(ties at the k-th value kept), keep the smallest most-likely set whose probability reaches
``top_p`` (the most likely token always kept), renormalise, and draw by inverse CDF with one
uniform number from the request's own ``torch.Generator``. A request's samples therefore depend
only on its seed and its logits, never on the other rows of the batch.

Log-probabilities are those of the model's distribution (``log_softmax`` of the raw logits,
before temperature and filtering, and before the penalties, ``logit_bias`` and ``min_tokens``
of :mod:`runner_service.penalties`, as vLLM returns them by default: the ``raw`` argument),
natural log.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runner_service.sampling_params import SamplingParams


@dataclass
class TokenLogprobs:
    """``logprob`` of the sampled ``token_id`` and the ``top`` n (token id, logprob), most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


def filter_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor) -> torch.Tensor:
    """Temperature-scaled, top-k and top-p filtered logits (filtered entries ``-inf``).

    ``logits`` [n, V] float32; ``temperature`` [n] (> 0); ``top_k`` [n] int64 (0 = off);
    ``top_p`` [n] in (0, 1]. Returns [n, V] float32.
    """
    V = logits.shape[-1]
    scaled = logits / temperature[:, None]
    k = torch.where(top_k > 0, top_k.clamp(max=V), torch.full_like(top_k, V))
    sorted_logits, sorted_idx = scaled.sort(dim=-1, descending=True)
    kth = sorted_logits.gather(1, (k - 1)[:, None])
    keep_sorted = sorted_logits >= kth
    probs = torch.where(keep_sorted, sorted_logits, float("-inf")).softmax(-1)
    mass_before = probs.cumsum(-1) - probs  # probability of the strictly more likely tokens
    keep_sorted &= mass_before < top_p[:, None]
    keep = torch.zeros_like(keep_sorted).scatter_(1, sorted_idx, keep_sorted)
    return scaled.masked_fill(~keep, float("-inf"))


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draws: row ``i`` of ``probs`` [m, V] (non-negative, any total; float32)
    gives the first token whose cumulative mass exceeds ``u[i] * total``, ``u`` [m] uniform in
    [0, 1). Returns [m] int64. A draw that lands on a zero-probability entry (only through
    rounding at its left edge) steps back to the nearest token with mass."""
    cdf = probs.cumsum(-1)
    drawn = (cdf < (u * cdf[:, -1])[:, None]).sum(-1).clamp(max=probs.shape[-1] - 1)
    ok = probs.gather(1, drawn[:, None]).squeeze(1) > 0
    if not bool(ok.all()):
        for j in (~ok).nonzero().flatten().tolist():
            kept = (probs[j] > 0).nonzero().flatten()
            drawn[j] = kept[(kept <= drawn[j]).sum().clamp(min=1) - 1]
    return drawn


def token_logprobs(logits: torch.Tensor, tokens: list[int], top_n: list[int]) -> list[TokenLogprobs]:
    """:class:`TokenLogprobs` of ``tokens[j]`` under ``log_softmax(logits[j])`` (``logits`` [m, V]
    float32, raw: before temperature and filtering) with its ``top_n[j]`` most likely tokens."""
    lp = logits.float().log_softmax(-1)
    top_vals, top_ids = lp.topk(max(top_n), dim=-1)
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device)[:, None]).squeeze(1).tolist()
    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    return [TokenLogprobs(t, c, list(zip(ids[:k], vals[:k], strict=True)))
            for t, c, ids, vals, k in zip(tokens, chosen, top_ids, top_vals, top_n, strict=True)]


class Sampler:
    """Samples one token per row, or verifies draft tokens (:meth:`verify`); stateless (the
    generators live with the sequences)."""

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None],
                 raw: torch.Tensor | None = None) -> tuple[list[int], list[TokenLogprobs | None]]:
        """``logits`` [n, V] float32 on any device; ``params``/``generators`` one per row (a
        generator is needed only for non-greedy rows; CPU generators). Returns the n sampled
        token ids and, per row, :class:`TokenLogprobs` when ``params[i].logprobs > 0``, those of
        ``raw`` [n, V] (the logits before :mod:`runner_service.penalties` processed them into
        ``logits``; default ``logits``)."""
        raw = logits if raw is None else raw
        n = logits.shape[0]
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i in range(n) if not params[i].greedy]
        if random_rows:
            dev = logits.device
            rows = torch.tensor(random_rows, device=dev)
            probs = _filtered(logits[rows], [params[i] for i in random_rows]).softmax(-1)
            u = torch.stack([torch.rand((), generator=generators[i]) for i in random_rows]).to(dev)
            tokens[rows] = draw(probs, u)
        token_list = tokens.tolist()
        want = [i for i in range(n) if params[i].logprobs > 0]
        logprobs: list[TokenLogprobs | None] = [None] * n
        if want:
            for i, lp in zip(want, token_logprobs(raw[want], [token_list[i] for i in want],
                                                  [params[i].logprobs for i in want]), strict=True):
                logprobs[i] = lp
        return token_list, logprobs

    def verify(self, logits: torch.Tensor, drafts: list[list[int]], params: list[SamplingParams],
               generators: list[torch.Generator | None], raw: torch.Tensor | None = None
               ) -> tuple[list[list[int]], list[list[TokenLogprobs] | None]]:
        """Verify draft tokens: ``logits`` [n, S, V] float32, row ``i``'s position ``j`` the
        next-token logits after its last token and its first ``j`` drafts ``drafts[i]`` (``k_i
        <= S - 1`` of them). Returns per row the tokens it emits, 1 .. ``k_i + 1``: the accepted
        drafts, then one token of the target model (a correction, or the bonus token after all
        ``k_i``), and their :class:`TokenLogprobs` when ``params[i].logprobs > 0``.

        Greedy rows accept the longest prefix of drafts equal to the argmax at each position,
        so they emit what one-token-per-step greedy decoding would. Sampled rows use
        speculative sampling (Leviathan et al. 2023; Chen et al. 2023) with a deterministic
        draft (``q`` one-hot): draft ``d`` at position ``j`` is accepted with probability
        ``p_j(d)`` (``p`` the temperature/top-k/top-p filtered distribution :func:`filter_logits`
        gives), else the token is drawn from ``p_j`` with ``d`` removed (the normalised
        ``max(p - q, 0)``) and the row stops; after all drafts the bonus token is drawn from
        ``p_k``. Each emitted token is thus distributed as sampling from ``p`` would give.
        ``raw`` [n, S, V]: the logits the logprobs are of (default ``logits``), as in
        :meth:`__call__`."""
        raw = logits if raw is None else raw
        n = logits.shape[0]
        out: list[list[int]] = []
        greedy = [i for i in range(n) if params[i].greedy]
        targets = logits[greedy].argmax(-1).tolist() if greedy else []
        target_of = dict(zip(greedy, targets, strict=True))
        for i in range(n):
            d = drafts[i]
            if i in target_of:
                t = target_of[i]
                a = 0
                while a < len(d) and d[a] == t[a]:
                    a += 1
                out.append(t[:a + 1])
            else:
                out.append(self._speculative_sample(logits[i, :len(d) + 1], d, params[i], generators[i]))
        logprobs: list[list[TokenLogprobs] | None] = [None] * n
        for i in range(n):
            if params[i].logprobs > 0:
                m = len(out[i])
                logprobs[i] = token_logprobs(raw[i, :m], out[i], [params[i].logprobs] * m)
        return out, logprobs

    @staticmethod
    def _speculative_sample(logits: torch.Tensor, drafts: list[int], params: SamplingParams,
                            generator: torch.Generator | None) -> list[int]:
        """One sampled row of :meth:`verify`: ``logits`` [k + 1, V], ``drafts`` [k]."""
        k = len(drafts)
        probs = _filtered(logits, [params] * (k + 1)).softmax(-1)
        out: list[int] = []
        for j, d in enumerate(drafts):
            u = float(torch.rand((), generator=generator))
            if u < float(probs[j, d]):
                out.append(d)
                continue
            residual = probs[j:j + 1].clone()
            residual[0, d] = 0.0
            out.append(int(draw(residual, torch.rand(1, generator=generator).to(logits.device))[0]))
            return out
        out.append(int(draw(probs[k:k + 1], torch.rand(1, generator=generator).to(logits.device))[0]))
        return out


def _filtered(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """:func:`filter_logits` of ``logits`` [m, V] with row ``j``'s temperature, top-k and top-p
    from ``params[j]`` (non-greedy rows)."""
    dev = logits.device
    return filter_logits(logits,
                         torch.tensor([x.temperature for x in params], device=dev, dtype=torch.float32),
                         torch.tensor([x.top_k for x in params], device=dev, dtype=torch.int64),
                         torch.tensor([x.top_p for x in params], device=dev, dtype=torch.float32))
