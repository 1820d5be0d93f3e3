"""The runner's ``Generation`` servicer: validates and translates (:mod:`runner_service.convert`),
nothing more.

``Generate`` turns a ``GenerateRequest`` into an :meth:`LLMEngine.add_request` call and streams
the engine's deltas back; with ``n`` > 1 the choices' messages come interleaved, each naming its
choice (``index``; a slow reader's deltas are merged per choice, never across choices), and the
stream ends once every choice sent its final message. Bad input is ``INVALID_ARGUMENT`` with one sentence (the runner keeps
serving); a request that can never fit the KV cache is ``RESOURCE_EXHAUSTED``; a runner serving
its maximum of streams answers :class:`~services.errors.Overloaded`. Refusals at a limit
(:mod:`runner_service.limits`, the stream slots) are counted in :attr:`GenerationServicer.refusals`
(``warmserve_refused_total``, on the server's registry). When the client
cancels, disconnects or its deadline passes, gRPC ends the RPC and its termination callback
(the one cancellation path) aborts the sequence, which frees its KV blocks.

Metrics (:class:`RunnerCollector`, registered in the ``ServiceServer``'s registry): running and
waiting sequences, KV blocks used/total, generated tokens (counter) and tokens/s since the last
scrape; the prefix cache's queried tokens and tokens saved (counters), hit rate, cached blocks
and whether it is on.
"""

from __future__ import annotations

import threading
import time

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from runner_service.convert import (
    output_to_proto,
    prompt_from_proto,
    sampling_defaults_to_proto,
    sampling_from_proto,
    startup_report_to_proto,
    token_text_decoder,
)
from runner_service.engine import LLMEngine
from services.bootstrap import ServerConfig
from services.errors import InvalidArgument, WarmserveError
from services.proto import generation_pb2, generation_pb2_grpc
from services.refusals import Refusals
from services.stream_slots import StreamSlots


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    """``warmserve.v1.Generation`` over one :class:`LLMEngine` (whose loop thread is running)."""

    def __init__(self, engine: LLMEngine, runner_id: str, slots: StreamSlots | None = None,
                 refusals: Refusals | None = None) -> None:
        """``slots`` caps the ``Generate`` streams served at once (:mod:`services.stream_slots`;
        default: :attr:`ServerConfig.max_streams <services.bootstrap.ServerConfig>`); ``refusals``
        counts the requests refused at a limit (default: a new one; hand it to the
        :class:`~services.bootstrap.ServiceServer` to export it)."""
        self.engine = engine
        self.runner_id = runner_id
        self.slots = slots or StreamSlots(ServerConfig.max_streams, f"runner {runner_id}")
        self.refusals = refusals or Refusals()
        self._token_text = token_text_decoder(getattr(engine, "tokenizer", None))  # logprobs' token texts

    def Generate(self, request, context):
        """Run the request on the engine and stream its outputs."""
        try:
            if request.routing not in generation_pb2.RoutingPolicy.values():
                raise InvalidArgument(f"routing {request.routing} is not a RoutingPolicy value")
            self.slots.take(context)
            params = sampling_from_proto(request.sampling)
            stream = self.engine.add_request(params, request_id=request.request_id or None,
                                             **prompt_from_proto(request))
        except WarmserveError as e:
            self.refusals.abort(context, e)
        # Runs when the RPC ends (client cancel, deadline, disconnect, or done: then a no-op); the
        # engine then ends the stream with a CANCELLED delta. False: the RPC has already ended.
        if not context.add_callback(stream.cancel):
            stream.cancel()
            return
        for out in stream.coalesced():  # a slow reader gets the tokens it fell behind by in one message
            yield output_to_proto(out, self.runner_id, self._token_text)

    def ModelInfo(self, request, context):
        """The model, its EOS ids and sampling defaults, the serving limits and the start-up report."""
        eng = self.engine
        stats = eng.stats()
        return generation_pb2.ModelInfoResponse(
            runner_id=self.runner_id, model=eng.model, family=eng.family, dtype=eng.dtype_name,
            weights_dtype=eng.weights_dtype,
            device=str(eng.device), vocab_size=eng.args.vocab_size, max_model_len=eng.max_model_len,
            block_size=eng.config.block_size, num_kv_blocks=eng.block_manager.num_usable_blocks,
            max_num_seqs=eng.config.max_num_seqs, compile_mode=eng.config.compile,
            sidecar_fingerprint=eng.sidecar_fingerprint,
            startup=startup_report_to_proto(eng.startup_report), program_state=eng.programs.state,
            program_detail=eng.programs.detail, programs_installed_at_s=eng.programs.installed_at_s or 0.0,
            program_layers=eng.programs.layers, programs_unrolled_at_s=eng.programs.unrolled_at_s or 0.0,
            programs_building=eng.programs.in_flight,
            eos_token_ids=eng.eos_token_ids, default_sampling=sampling_defaults_to_proto(eng.sampling_defaults),
            running=stats["running"], waiting=stats["waiting"], kv_blocks_used=stats["kv_blocks_used"],
            kv_blocks_usable=stats["kv_blocks_total"], layer_types=eng.args.layer_kinds,
            speculative=generation_pb2.SpeculativeDecoding(
                method=eng.config.speculative, num_speculative_tokens=eng.config.num_draft_tokens,
                num_drafts=stats["spec_decode_num_drafts"], num_draft_tokens=stats["spec_decode_num_draft_tokens"],
                num_accepted_tokens=stats["spec_decode_num_accepted_tokens"],
                acceptance_rate=stats["spec_decode_acceptance_rate"],
                mean_acceptance_length=stats["spec_decode_mean_acceptance_length"]))


class RunnerCollector:
    """Prometheus collector reading :meth:`LLMEngine.stats` at scrape time."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._last: tuple[float, int] | None = None

    def collect(self):
        """Prometheus collector protocol: the engine's metrics, read now."""
        s = self.engine.stats()
        now = time.monotonic()
        with self._lock:
            last, self._last = self._last, (now, s["generated_tokens_total"])
        rate = 0.0 if last is None or now <= last[0] else (s["generated_tokens_total"] - last[1]) / (now - last[0])
        for name, doc, value in (
            ("warmserve_runner_running_sequences", "sequences being decoded", s["running"]),
            ("warmserve_runner_waiting_sequences", "sequences waiting for prefill", s["waiting"]),
            ("warmserve_runner_kv_blocks_used", "KV cache blocks in use", s["kv_blocks_used"]),
            ("warmserve_runner_kv_blocks_total", "KV cache blocks usable", s["kv_blocks_total"]),
            ("warmserve_runner_tokens_per_second", "generated tokens per second since the last scrape", rate),
            ("warmserve_runner_prefix_caching_enabled", "1 when prefix caching is on", s["prefix_caching"]),
            ("warmserve_runner_prefix_cache_hit_rate",
             "prefix-cache hit tokens / queried tokens since start", s["prefix_cache_hit_rate"]),
            ("warmserve_runner_prefix_cache_blocks", "KV blocks holding prefix-cached K/V (in use or evictable)",
             s["prefix_cache_blocks"]),
            ("warmserve_runner_spec_decode_acceptance_rate", "accepted / proposed draft tokens since start",
             s["spec_decode_acceptance_rate"]),
            ("warmserve_runner_spec_decode_mean_acceptance_length",
             "tokens a drafted sequence emits per verify step (1 + accepted / drafts) since start",
             s["spec_decode_mean_acceptance_length"]),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        for name, doc, value in (
            ("warmserve_runner_generated_tokens", "generated tokens", s["generated_tokens_total"]),
            ("warmserve_runner_prefix_cache_queried_tokens",
             "tokens looked up in the prefix cache when sequences were scheduled for prefill",
             s["prefix_cache_queried_tokens"]),
            ("warmserve_runner_prefix_cache_tokens_saved",
             "prompt tokens found in the prefix cache (prefill not computed)", s["prefix_cache_tokens_saved"]),
            ("warmserve_runner_spec_decode_num_drafts", "sequence steps that verified draft tokens",
             s["spec_decode_num_drafts"]),
            ("warmserve_runner_spec_decode_num_draft_tokens", "draft tokens verified",
             s["spec_decode_num_draft_tokens"]),
            ("warmserve_runner_spec_decode_num_accepted_tokens", "draft tokens accepted",
             s["spec_decode_num_accepted_tokens"]),
        ):
            yield CounterMetricFamily(name, doc, value=value)
