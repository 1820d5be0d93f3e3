"""A small client for the ``Generation`` service (a runner or the router: same contract).

:data:`GENERATION_SERVICE` is the service's full name (registration, health checks).
Request builders (:func:`text_request`, :func:`chat_request`, :func:`sampling_params`), and
:class:`GenerationClient`, which streams responses, collects them into a
:class:`GenerationResult`, or writes the text as it arrives. RPC errors come out as
:class:`services.errors.WarmserveError` subclasses carrying the server's message.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import TextIO

import grpc

from services.channel import ClientSecurity, open_channel
from services.errors import InvalidArgument, from_rpc_error
from services.proto import generation_pb2, generation_pb2_grpc
from services.sampling_keys import FLOAT32_MAX

#: The full name of the ``Generation`` service, which runners and the router both serve.
GENERATION_SERVICE = "warmserve.v1.Generation"


def sampling_params(*, max_tokens: int | None = None, temperature: float | None = None,
                    top_p: float | None = None, top_k: int | None = None,
                    seed: int | None = None) -> generation_pb2.SamplingParams:
    """``SamplingParams`` with the fields given; one left ``None`` stays unset, so the server
    applies the model's default (its ``generation_config.json``: ``ModelInfoResponse.default_sampling``),
    else the runner's (64 tokens, greedy, no top-k, top-p 1.0). Temperature 0 = greedy, top-p 0
    = off. Raises ``InvalidArgument`` for values the runner would refuse anyway, so the CLI can
    say so before dialing."""
    if max_tokens is not None and not 0 < max_tokens < 2**31:
        raise InvalidArgument(f"--max-tokens must be > 0 and < 2^31, got {max_tokens}")
    if top_k is not None and not 0 <= top_k < 2**31:
        raise InvalidArgument(f"--top-k must be in [0, 2^31), got {top_k}")
    if seed is not None and not 0 <= seed < 2**64:
        raise InvalidArgument(f"--seed must be in [0, 2^64), got {seed}")
    if temperature is not None and not 0 <= temperature <= FLOAT32_MAX:
        raise InvalidArgument(f"--temperature must be >= 0 and a finite 32-bit float, got {temperature}")
    if top_p is not None and not 0 <= top_p <= 1:
        raise InvalidArgument(f"--top-p must be in [0, 1], got {top_p}")
    given = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed}
    return generation_pb2.SamplingParams(**{k: v for k, v in given.items() if v is not None})


def _valid_text(text: str, what: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidArgument(f"{what} is not valid UTF-8 text ({e.reason} at character {e.start})") from None
    return text


def text_request(text: str, sampling: generation_pb2.SamplingParams | None = None, *,
                 routing: int = generation_pb2.ROUTING_POLICY_UNSPECIFIED,
                 allow_special_tokens: bool = False) -> generation_pb2.GenerateRequest:
    """A raw-text request (no chat template); special-token text in it is plain text unless
    ``allow_special_tokens``. Raises ``InvalidArgument`` for text that is not valid Unicode (e.g.
    undecodable bytes from a command line)."""
    return generation_pb2.GenerateRequest(text=_valid_text(text, "the prompt"), sampling=sampling, routing=routing,
                                          allow_special_tokens=allow_special_tokens)


def chat_request(messages: Sequence[tuple[str, str]], sampling: generation_pb2.SamplingParams | None = None, *,
                 routing: int = generation_pb2.ROUTING_POLICY_UNSPECIFIED) -> generation_pb2.GenerateRequest:
    """A chat request from ``(role, content)`` pairs; the runner applies the model's template."""
    chat = generation_pb2.ChatPrompt(messages=[
        generation_pb2.ChatMessage(role=_valid_text(r, "a chat role"), content=_valid_text(c, "a chat message"))
        for r, c in messages])
    return generation_pb2.GenerateRequest(chat=chat, sampling=sampling, routing=routing)


@dataclass
class GenerationResult:
    """One finished request: text, token ids, finish reason name, usage, who served it, and
    timings in seconds (``first_token_s`` from the call to the first token; ``token_times_s``
    from the call to each message that carried tokens, with ``token_counts`` its token count).
    These are choice 0's; a request with ``n`` > 1 keeps every other choice in
    :attr:`others` (index -> its own result), and :attr:`choices` lists them all in order."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    runner_id: str = ""
    seconds: float = 0.0
    first_token_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)
    token_counts: list[int] = field(default_factory=list)
    others: dict[int, GenerationResult] = field(default_factory=dict)

    @property
    def choices(self) -> list[GenerationResult]:
        """Every choice's result, by index (choice 0 is this one)."""
        return [self, *(self.others[i] for i in sorted(self.others))]

    @property
    def max_gap_s(self) -> float:
        """The longest wait in seconds between two messages that carried tokens (0 with fewer
        than two): how long the stream stalled at worst."""
        return max((b - a for a, b in pairwise(self.token_times_s)), default=0.0)

    @property
    def per_token_s(self) -> float | None:
        """Mean seconds per token after the first message: (last - first arrival) / tokens
        after the first message; ``None`` when no token came after it."""
        after = sum(self.token_counts[1:])
        return (self.token_times_s[-1] - self.token_times_s[0]) / after if after else None

    def add(self, resp: generation_pb2.GenerateResponse) -> None:
        """Fold one streamed message in (into :attr:`others` when it is another choice's)."""
        if resp.index:
            self.others.setdefault(resp.index, GenerationResult()).add_choice(resp)
            return
        self.add_choice(resp)

    def add_choice(self, resp: generation_pb2.GenerateResponse) -> None:
        """Fold one message of this choice in."""
        self.text += resp.text
        self.token_ids.extend(resp.token_ids)
        if resp.runner_id:
            self.runner_id = resp.runner_id
        if resp.finish_reason:
            self.finish_reason = generation_pb2.FinishReason.Name(resp.finish_reason).removeprefix("FINISH_REASON_")
            self.prompt_tokens = resp.usage.prompt_tokens
            self.completion_tokens = resp.usage.completion_tokens

    def summary(self) -> str:
        """``[runner-0] 42 tokens in 1.23 s (34.1 tok/s), finish LENGTH``."""
        rate = self.completion_tokens / self.seconds if self.seconds > 0 else 0.0
        return (f"[{self.runner_id or '?'}] {self.completion_tokens} tokens in {self.seconds:.2f} s "
                f"({rate:.1f} tok/s), prompt {self.prompt_tokens} tokens, finish {self.finish_reason or '?'}")


class GenerationClient:
    """Client of one ``Generation`` endpoint (``host:port``); use as a context manager.

    ``ready_timeout_s``: seconds to wait for the connection (``Unavailable`` after that);
    ``fail_fast``: a refused or unreachable address raises ``Unavailable`` at once. Raises
    ``InvalidArgument`` for an address that is not ``host:port``. ``security``: the token and TLS
    files the client presents."""

    def __init__(self, address: str, *, ready_timeout_s: float = 10.0, fail_fast: bool = False,
                 security: ClientSecurity | None = None) -> None:
        from services.address import parse_address

        parse_address(address)
        self.address = address
        self._channel = open_channel(address, security=security, ready_timeout_s=ready_timeout_s, fail_fast=fail_fast)
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)

    def __enter__(self) -> GenerationClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close the channel (cancels calls still running on it)."""
        self._channel.close()

    def stream(self, request: generation_pb2.GenerateRequest, *,
               timeout_s: float | None = 120.0) -> Iterator[generation_pb2.GenerateResponse]:
        """The response stream; closing the iterator early cancels the call."""
        call = self._stub.Generate(request, timeout=timeout_s)
        try:
            yield from call
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e
        finally:
            call.cancel()

    def complete(self, request: generation_pb2.GenerateRequest, *,
                 timeout_s: float | None = 120.0) -> GenerationResult:
        """Run ``request`` to the end and return everything it produced."""
        return self.stream_to(request, None, timeout_s=timeout_s)

    def stream_to(self, request: generation_pb2.GenerateRequest, out: TextIO | None, *,
                  timeout_s: float | None = 120.0) -> GenerationResult:
        """Write each text delta to ``out`` (flushed) as it arrives; returns the result."""
        result = GenerationResult()
        start = time.perf_counter()
        for resp in self.stream(request, timeout_s=timeout_s):
            if resp.token_ids:
                result.token_times_s.append(time.perf_counter() - start)
                result.token_counts.append(len(resp.token_ids))
                if result.first_token_s is None:
                    result.first_token_s = result.token_times_s[0]
            result.add(resp)
            if out is not None and resp.text:
                out.write(resp.text)
                out.flush()
        result.seconds = time.perf_counter() - start
        return result

    def model_info(self, *, timeout_s: float = 10.0) -> generation_pb2.ModelInfoResponse:
        """``ModelInfo`` of the endpoint (the router forwards it to a READY runner)."""
        try:
            return self._stub.ModelInfo(generation_pb2.ModelInfoRequest(), timeout=timeout_s)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e
