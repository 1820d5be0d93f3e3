"""Token sampling from next-token logits, per request.

For each row (the order transformers' ``generate`` uses): greedy rows (``temperature == 0``)
take ``argmax``; other rows divide the logits by ``temperature``, keep the ``top_k`` largest
(ties at the k-th value kept), keep the smallest most-likely set whose probability reaches
``top_p`` (the most likely token always kept), renormalise, and draw by inverse CDF with one
uniform number from the request's own ``torch.Generator``. A request's samples therefore depend
only on its seed and its logits, never on the other rows of the batch.

Log-probabilities are those of the model's distribution (``log_softmax`` of the raw logits,
before temperature and filtering), natural log.
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


class Sampler:
    """Samples one token per row; stateless (the generators live with the sequences)."""

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> tuple[list[int], list[TokenLogprobs | None]]:
        """``logits`` [n, V] float32 on any device; ``params``/``generators`` one per row (a
        generator is needed only for non-greedy rows; CPU generators). Returns the n sampled
        token ids and, per row, :class:`TokenLogprobs` when ``params[i].logprobs > 0``."""
        n = logits.shape[0]
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i in range(n) if not params[i].greedy]
        if random_rows:
            dev = logits.device
            rows = torch.tensor(random_rows, device=dev)
            p = [params[i] for i in random_rows]
            filtered = filter_logits(
                logits[rows],
                torch.tensor([x.temperature for x in p], device=dev, dtype=torch.float32),
                torch.tensor([x.top_k for x in p], device=dev, dtype=torch.int64),
                torch.tensor([x.top_p for x in p], device=dev, dtype=torch.float32),
            )
            cdf = filtered.softmax(-1).cumsum(-1)
            u = torch.stack([torch.rand((), generator=generators[i]) for i in random_rows]).to(dev)
            drawn = (cdf < (u * cdf[:, -1])[:, None]).sum(-1).clamp(max=logits.shape[-1] - 1)
            # Inverse-CDF can land on a filtered (zero-probability) entry only through rounding
            # at its left edge; step back to the nearest kept token in that case.
            ok = filtered.gather(1, drawn[:, None]).squeeze(1) > float("-inf")
            if not bool(ok.all()):
                for j in (~ok).nonzero().flatten().tolist():
                    kept = (filtered[j] > float("-inf")).nonzero().flatten()
                    drawn[j] = kept[(kept <= drawn[j]).sum().clamp(min=1) - 1]
            tokens[rows] = drawn
        token_list = tokens.tolist()
        want = [i for i in range(n) if params[i].logprobs > 0]
        logprobs: list[TokenLogprobs | None] = [None] * n
        if want:
            lp = logits[want].float().log_softmax(-1)
            top_n = max(params[i].logprobs for i in want)
            top_vals, top_ids = lp.topk(top_n, dim=-1)
            chosen = lp.gather(1, tokens[want][:, None]).squeeze(1).tolist()
            top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
            for j, i in enumerate(want):
                k = params[i].logprobs
                logprobs[i] = TokenLogprobs(token_list[i], chosen[j], list(zip(top_ids[j][:k], top_vals[j][:k],
                                                                              strict=True)))
        return token_list, logprobs
