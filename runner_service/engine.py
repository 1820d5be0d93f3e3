"""The engine: the runner's core object, no gRPC in here (``docs/architecture.md`` §8, §11).

``LLMEngine`` turns requests into sequences and steps them: scheduler, model runner, sampler,
then the output processor (:mod:`runner_service.output_processor`), which streams the deltas.
Any thread may add or abort requests (posted to an inbox); only the stepping thread touches the
scheduler, the sequences and the runner. A server builds its engine with :meth:`LLMEngine.launch`
so that one thread loads, warms up and steps (one OpenMP master, §8). Start-up is timed phase by
phase in :attr:`LLMEngine.startup_report`.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from model_families import family_for_config, get_family
from model_families.family import FamilyConfig, FamilyWeights, ModelFamily
from runner_service.block_manager import BlockManager
from runner_service.config import EngineConfig
from runner_service.device import free_memory_bytes, resolve_dtype, select_device, torch_dtype
from runner_service.generation_config import GenerationConfig
from runner_service.kv_cache import KVCache, bytes_per_block, num_blocks_for_bytes
from runner_service.limits import check_prompt_bytes
from runner_service.model_runner import ModelRunner
from runner_service.mtp import MtpDrafter
from runner_service.ngram import NgramDrafter, SpeculationGate
from runner_service.options import STREAMS_METHODS, check_family_method, speculative_summary
from runner_service.output_processor import OutputProcessor, RequestOutput, RequestStream
from runner_service.penalties import PenaltyState
from runner_service.program_installer import ProgramInstaller
from runner_service.sampler import Sampler
from runner_service.sampling_params import SamplingParams
from runner_service.scheduler import ScheduledBatch, Scheduler
from runner_service.sequence import FinishReason
from runner_service.sequence import Sequence as Seq
from runner_service.structured import GrammarCompiler, GrammarMasks, constrained, consume, finish_completed
from runner_service.tokenizer import Tokenizer
from services.errors import FailedPrecondition, InvalidArgument
from services.signing import TrustedKeys

if TYPE_CHECKING:
    from weight_service.loader import LoadedSidecar

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StartupPhase:
    """One timed start-up phase (``seconds`` wall time; ``detail`` one human phrase)."""

    name: str
    seconds: float
    detail: str = ""


@dataclass
class StartupReport:
    phases: list[StartupPhase] = field(default_factory=list)

    @property
    def total_seconds(self) -> float:
        return sum(p.seconds for p in self.phases)

    def line(self) -> str:
        """One log line: ``weights 0.41s (sidecar HOT) | kv_cache 0.02s (...) | total 0.9s``."""
        parts = [f"{p.name} {p.seconds:.3f}s" + (f" ({p.detail})" if p.detail else "") for p in self.phases]
        return " | ".join([*parts, f"total {self.total_seconds:.3f}s"])




class LLMEngine:
    """Continuous-batching generation over one model (see the module docstring).

    Args:
        args, weights: the family config and the family's weights (any dtype/device: converted
            here).
        config: serving limits.
        tokenizer: needed for text and chat prompts and for output text; ``None`` = ids only.
        family: the :class:`~model_families.family.ModelFamily` (default: the registered one
            whose config class built ``args``); its name is reported by ``ModelInfo``.
        model: the source name reported by ``ModelInfo``; ``sidecar_fingerprint`` likewise.
        startup: phases already spent by the caller (e.g. preparing the sidecar).
        kernel_cache: kernel-cache service address or directory, for compiled programs.
        weights_dtype: the sidecar's weights dtype, reported by ``ModelInfo`` (default: the
            weights' quantization, or their float dtype).
        generation_config: the model's generation defaults (the sidecar's
            ``generation_config.json``, :mod:`runner_service.generation_config`; default none).
        sidecar_path: the sidecar directory ``weights`` were mapped from (a background build
            child maps it too; ``None``: weights from memory, see :class:`ProgramInstaller`).
        mapping: the loaded sidecar ``weights`` view, whose pages under a head no matmul reads
            (:attr:`PackedMatrices.head_unread <model_families.prepack.PackedMatrices.head_unread>`;
            not with ``compile`` ``"inductor"``) are released from the resident set after the prepack.

    ``dtype_name`` is the resolved compute dtype (``config.dtype`` ``auto`` resolved for the
    device), ``dtype`` its torch dtype. ``eos_token_ids`` are the tokens that end a sequence
    (unless ``ignore_eos``): ``args.eos_token_ids`` then the generation config's, each once.
    ``sampling_defaults`` resolves a request's unset sampling fields (:class:`SamplingDefaults
    <runner_service.sampling_params.SamplingDefaults>`: :meth:`GenerationConfig.sampling_defaults`
    over ``config.default_max_tokens``). ``output`` is the :class:`OutputProcessor`.
    """

    def __init__(self, args: FamilyConfig, weights: FamilyWeights, config: EngineConfig,
                 tokenizer: Tokenizer | None = None, *, model: str = "", sidecar_fingerprint: str = "",
                 family: ModelFamily | None = None, startup: Sequence[StartupPhase] = (),
                 kernel_cache: str | None = None, weights_dtype: str = "",
                 generation_config: GenerationConfig | None = None, sidecar_path: str | Path | None = None,
                 mapping: LoadedSidecar | None = None) -> None:
        self._created = time.perf_counter()
        self.sampler = Sampler()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._inbox: list[tuple[str, object]] = []
        self._ids: set[str] = set()   # in-flight request ids (guarded by _lock)
        self.output = OutputProcessor(tokenizer)  # stepping thread only
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.generated_tokens_total = 0
        self.args = args
        self.model_family = family or family_for_config(args)
        self.family = self.model_family.name
        if config.batch_invariant:
            config = self._batch_invariant_config(config, weights)
        check_family_method(self.model_family, config.speculative)
        if config.speculative == "mtp" and not getattr(args, "num_nextn_predict_layers", 0):
            raise InvalidArgument("--speculative mtp needs the checkpoint's MTP block, and this model has none "
                                  "(num_nextn_predict_layers is 0)")
        #: Speculative decoding's drafter (:class:`~runner_service.ngram.NgramDrafter`, or
        #: :class:`~runner_service.mtp.MtpDrafter` once the runner is built), ``None`` when off.
        self.drafter = None if config.speculative != "ngram" else NgramDrafter(
            config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
        #: Speculative decoding counts (vLLM's): rows that verified drafts, draft tokens verified,
        #: draft tokens accepted.
        self.spec_num_drafts = self.spec_draft_tokens = self.spec_accepted_tokens = 0
        #: Whether every step returns the residual streams to the drafter (``mtp``): then every
        #: decode step verifies, drafts or not, and no gate applies.
        self._with_streams = config.speculative in STREAMS_METHODS
        #: Whether verify steps pay against the compiled decode (:class:`~runner_service.ngram.SpeculationGate`).
        self.gate = None if config.speculative == "off" or self._with_streams else SpeculationGate()
        self._gate_installs = 0  # the runner's program installs the gate's rates were measured under
        self.config = config
        self.tokenizer = tokenizer
        self.model = model
        self.sidecar_fingerprint = sidecar_fingerprint
        self.kernel_cache = kernel_cache
        self.startup_report = StartupReport(list(startup))
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.device = select_device(config.device)
        self.dtype_name = resolve_dtype(config.dtype, self.device)
        self.dtype = torch_dtype(self.dtype_name)
        self.max_model_len = config.resolved_max_model_len(args)
        self.weights_dtype = weights_dtype or weights.quantization or str(weights.dtype).removeprefix("torch.")
        self.generation_config = generation_config or GenerationConfig()
        self.eos_token_ids = tuple(dict.fromkeys((*args.eos_token_ids, *self.generation_config.eos_token_ids)))
        self.sampling_defaults = self.generation_config.sampling_defaults(config.default_max_tokens)
        #: Structured output: compiles requests' constraints (any thread), and masks their rows
        #: (every sampled position of a step: drafts too) (:mod:`runner_service.structured`).
        self.grammars = GrammarCompiler(tokenizer, args.vocab_size, self.eos_token_ids)
        self.grammar_masks = GrammarMasks(config.max_num_seqs * (1 + config.num_draft_tokens),
                                          self.grammars.mask_words)

        if weights.dtype != self.dtype or weights.device != self.device:
            t0 = time.perf_counter()
            weights = weights.to(self.dtype, self.device)
            self._phase("weights_to_device", t0,
                        f"{weights.nbytes() / 2**20:.0f} MiB {self.dtype_name} on {self.device}")
        self.weights = weights
        if weights.quantization and self.dtype == torch.float32 and self.device.type == "cpu":
            log.warning("%s weights with float32 compute are dequantized matrix by matrix at every step: exact, "
                        "but slower than a float32 model; bf16 compute runs the weight-only kernels (--dtype bf16, "
                        "or auto on a CPU with AVX512-BF16/AMX)", weights.quantization,
                        extra={"runner_id": config.runner_id})

        t0 = time.perf_counter()
        cache_specs = self.model_family.cache_specs(args, config.block_size)
        draft_specs = self.model_family.draft_cache_specs(args, config.block_size, config.speculative)
        self.block_layout = self.model_family.block_layout(  # draft_tokens only when speculating, as the runner
            args, config.block_size, self.max_model_len,
            **({"draft_tokens": config.num_draft_tokens} if config.num_draft_tokens else {}))
        num_blocks = self._num_kv_blocks((*cache_specs, *draft_specs))
        self.kv = KVCache(cache_specs, num_blocks, config.block_size, self.dtype, self.device)
        #: The drafter's pools (the same block ids as :attr:`kv`), ``None`` when it has none.
        self.draft_kv = KVCache(draft_specs, num_blocks, config.block_size, self.dtype, self.device) \
            if draft_specs else None
        #: Prefix caching is on when the config asks for it and the family supports it.
        self.prefix_caching = config.enable_prefix_caching and self.model_family.supports_prefix_caching
        self.block_manager = BlockManager(num_blocks, config.block_size, enable_prefix_caching=self.prefix_caching,
                                          layout=self.block_layout)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   config.resolved_max_num_batched_tokens(self.max_model_len), self.eos_token_ids)
        #: Penalties, ``logit_bias`` and ``min_tokens`` (:mod:`runner_service.penalties`).
        self.penalties = PenaltyState(config.max_num_seqs, args.vocab_size, self.eos_token_ids, self.device)
        touched = self.kv.touched_bytes()
        usable = self.block_manager.num_usable_blocks
        self._phase("kv_cache", t0, f"{num_blocks} blocks x {config.block_size} tokens ({usable} usable, "
                                    f"{num_blocks - usable} scratch), "
                                    f"{self.kv.nbytes / 2**20:.1f} MiB reserved"
                                    + ("" if touched is None else f", {touched / 2**20:.1f} MiB touched")
                                    + f", prefix caching {'on' if self.prefix_caching else 'off'}")

        t0 = time.perf_counter()
        self.runner = ModelRunner(args, self.weights, self.kv, config, self.max_model_len, self.device,
                                  self.model_family)
        packed = self.runner.packed
        # no matmul reads a head whose int8 copy serves every step: its mapped pages leave the RSS
        # (the tied embedding faults back in only the rows it gathers); a torch.compile graph
        # multiplies the plain head (F.linear), so not with --compile inductor
        unread = (mapping.release([packed.head_unread]) if mapping is not None and packed.head_unread is not None
                  and config.compile != "inductor" else 0)
        self._phase("prepack", t0, (f"{len(packed)} matrices, {packed.nbytes / 2**20:.0f} MiB in oneDNN's blocked "
                                    f"layout for batch {config.max_num_seqs}" if len(packed) else "none")
                    + ("; quantized matrices x int8 activations" if self.runner.int8_activations else "")
                    + (f"; the head's {unread / 2**20:.0f} MiB of mapped pages released (its int8 copy serves "
                       "every step)" if unread >> 20 else ""))

        if config.speculative == "mtp":
            self.drafter = MtpDrafter(config.num_speculative_tokens, self.runner.model, self.draft_kv,
                                      self.block_layout, lock=self.runner.forward_lock,
                                      max_num_seqs=config.max_num_seqs,
                                      max_blocks_per_seq=self.runner.max_blocks_per_seq)

        t0 = time.perf_counter()
        #: The compiled programs and their state (``ModelInfo.program_state``).
        self.programs = ProgramInstaller(self.runner, kernel_cache, sidecar=sidecar_path,
                                         weights_dtype=self.weights_dtype if sidecar_path else weights.quantization or "f32")
        self._phase("programs", t0, self.programs.start(self.call_between_steps, self._since_startup))
        t0 = time.perf_counter()
        #: What the start-up warm-up ran (:meth:`ModelRunner.warmup_plan`), ``None`` when it was off.
        self.warmup_plan = self.runner.warmup_plan() if config.warmup else None
        if self.warmup_plan is not None:
            self.runner.warmup(self.warmup_plan)
        self._phase("warmup", t0, "skipped" if self.warmup_plan is None else self.warmup_plan.describe())
        self._ready = time.perf_counter()  # serving from now on (eager while programs are pending)
        log.info("startup: " + self.startup_line(), extra={"runner_id": config.runner_id})


    def startup_line(self) -> str:
        """The start-up report's log line (:meth:`StartupReport.line`), then the speculative
        method and K when speculating (``... | total 0.9s | speculative ngram x3``)."""
        line = self.startup_report.line()
        if self.config.speculative == "off":
            return line
        return f"{line} | speculative {speculative_summary(self.config.speculative, self.config.num_speculative_tokens)}"

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_sidecar(cls, path: str | Path, config: EngineConfig, *, model: str = "",
                     startup: Sequence[StartupPhase] = (), kernel_cache: str | None = None,
                     detail: str = "", trusted_keys: TrustedKeys | None = None) -> LLMEngine:
        """Load a sidecar directory (``model.safetensors``, ``config.json``,
        ``generation_config.json``, tokenizer files) through
        :func:`weight_service.loader.load_sidecar` and build the engine; the load is the
        ``weights`` phase of the report. With ``trusted_keys`` the sidecar's signed manifest is
        checked before it is mapped (``Untrusted`` when it fails; the phase says what was verified,
        or ``artifacts not verified``)."""
        from weight_service.loader import load_sidecar

        t0 = time.perf_counter()
        sidecar = load_sidecar(Path(path), trusted_keys)
        family = get_family(sidecar.metadata.get("warmserve.family", "llama"))
        args = family.config_from_dict(sidecar.config)
        device = select_device(config.device)
        dtype = torch_dtype(resolve_dtype(config.dtype, device))
        weights = family.load_weights(args, sidecar.tensors, dtype, device, sidecar.weights_dtype)
        released = sidecar.release_unused(weights.tensors().values())  # what was read once to convert
        tokenizer = Tokenizer.from_dir(path)
        generation_config = GenerationConfig.from_dir(path, vocab_size=args.vocab_size)
        fingerprint = sidecar.metadata.get("warmserve.fingerprint", "")
        phases = [*startup, StartupPhase("weights", time.perf_counter() - t0, (detail or (
            f"sidecar {Path(path).name} ({sidecar.weights_dtype}), {weights.nbytes() / 2**20:.0f} MiB"))
            + (f", {released / 2**20:.0f} MiB of its mapping released after conversion" if released >> 20 else "")
            + f"; {sidecar.trust}")]
        return cls(args, weights, config, tokenizer, model=model or str(path), sidecar_fingerprint=fingerprint,
                   family=family, startup=phases, kernel_cache=kernel_cache, weights_dtype=sidecar.weights_dtype,
                   generation_config=generation_config, sidecar_path=path, mapping=sidecar)

    def _batch_invariant_config(self, config: EngineConfig, weights: FamilyWeights) -> EngineConfig:
        """The config batch-invariant mode runs: ``compile`` ``"off"`` (the mode's kernels run
        eager; compiled code would need its own proof). ``InvalidArgument`` for a family that does
        not declare :attr:`~model_families.family.ModelFamily.supports_batch_invariance` or for
        quantized weights (their kernels are not probed)."""
        if not self.model_family.supports_batch_invariance:
            raise InvalidArgument(f"batch-invariant mode does not cover the {self.family} family's kernels")
        if weights.quantization:
            raise InvalidArgument(f"batch-invariant mode needs float weights (an f32 or bf16 sidecar), not "
                                  f"{weights.quantization}")
        if config.compile != "off":
            log.info("batch-invariant mode runs eager: --compile %s is not used", config.compile,
                     extra={"runner_id": config.runner_id})
            config = replace(config, compile="off")
        return config

    def _phase(self, name: str, t0: float, detail: str) -> None:
        self.startup_report.phases.append(StartupPhase(name, time.perf_counter() - t0, detail))

    def _num_kv_blocks(self, specs) -> int:
        """Blocks to allocate: what ``kv_cache_bytes`` holds, else enough for ``max_num_seqs``
        full-length sequences within ``kv_cache_memory_fraction`` of free memory (a family
        without pools gets the full count: its blocks cost nothing)."""
        cfg = self.config
        per_block = bytes_per_block(specs, self.dtype)
        full = cfg.max_num_seqs * self.block_layout.blocks_needed(self.max_model_len) + 1
        if per_block == 0:
            return full
        if cfg.kv_cache_bytes is not None:
            return num_blocks_for_bytes(specs, self.dtype, cfg.kv_cache_bytes)
        budget = int(free_memory_bytes(self.device) * cfg.kv_cache_memory_fraction)
        return max(2, min(full, budget // per_block))

    def _since_startup(self) -> float:
        """Seconds since start-up began, on the start-up report's clock (serving started at ``_ready``)."""
        return self.startup_report.total_seconds + time.perf_counter() - self._ready

    def call_between_steps(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` in the stepping thread before the next step (at once if a step is not
        running: the next :meth:`step`, or the loop's next wake-up). Used to install programs
        built in another thread without changing anything under a running step."""
        with self._lock:
            self._inbox.append(("call", fn))
            self._wake.notify()

    # -- requests ----------------------------------------------------------------------------

    def tokenize(self, *, text: str | None = None, messages: Sequence[dict] | None = None,
                 token_ids: Sequence[int] | None = None, allow_special_tokens: bool = False,
                 tools: Sequence[dict] | None = None) -> list[int]:
        """Prompt token ids from exactly one of ``text``, chat ``messages`` (with the ``tools``
        the chat template receives) or ``token_ids``.
        Text and message content are plain text: special-token text in them is encoded as its
        characters (``allow_special_tokens`` lets raw ``text`` name control tokens; chat content
        stays plain, see :mod:`runner_service.tokenizer`). Raises ``InvalidArgument`` for none/several, an empty prompt, ids outside
        ``[0, vocab_size)``, an unknown chat role, or a prompt that leaves no room to generate,
        and, before anything is tokenized, for a prompt over ``config.max_prompt_bytes``."""
        given = [x is not None for x in (text, messages, token_ids)]
        if sum(given) != 1:
            raise InvalidArgument("give exactly one of text, chat messages or token ids as the prompt")
        if token_ids is not None:
            ids = [int(t) for t in token_ids]
        else:
            if self.tokenizer is None:
                raise InvalidArgument("this engine has no tokenizer; send token ids")
            check_prompt_bytes(self.config.max_prompt_bytes, text=text, messages=messages, tools=tools)
            if text is not None:
                ids = self.tokenizer.encode(text, allow_special_tokens=allow_special_tokens) if text else []
            else:
                ids = self.tokenizer.encode_chat(messages, tools=tools)
        if not ids:
            raise InvalidArgument("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.args.vocab_size]
        if bad:
            raise InvalidArgument(f"token id {bad[0]} is outside the vocabulary [0, {self.args.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise InvalidArgument(f"the prompt has {len(ids)} tokens but the context holds {self.max_model_len} "
                                  "(at least one must be left to generate)")
        return ids

    def add_request(self, params: SamplingParams, *, text: str | None = None,
                    messages: Sequence[dict] | None = None, token_ids: Sequence[int] | None = None,
                    request_id: str | None = None, allow_special_tokens: bool = False,
                    tools: Sequence[dict] | None = None) -> RequestStream:
        """Validate and queue a request; returns its stream. Raises ``InvalidArgument`` (see
        :meth:`tokenize`, a ``max_tokens`` above what the context leaves (unset: the default,
        capped), a ``min_tokens`` above it, bad stop token ids or ``logit_bias`` ids, a
        structured-output constraint that does not compile (:mod:`runner_service.structured`,
        compiled here, on the caller's thread), a request id already in flight, ``n`` above
        ``max_num_seqs``) or ``ResourceExhausted`` (the request, or its ``n`` choices together,
        can never fit the KV cache).

        ``params.n`` > 1: the request is ``n`` sequences (ids ``f"{request_id}-{i}"``; aborting
        ``request_id`` aborts them all), choice i sampling with seed ``seed + i`` (mod 2^64), or
        its own random seed when unseeded; choices 1..n-1 start their prefill once choice 0 has
        computed the prompt, and so share its full prompt blocks through the prefix cache
        (:attr:`Sequence.prefill_after <runner_service.sequence.Sequence.prefill_after>`). They
        stream on the one returned stream, each delta naming its choice (``index``)."""
        ids = self.tokenize(text=text, messages=messages, token_ids=token_ids,
                            allow_special_tokens=allow_special_tokens, tools=tools)
        params = self.sampling_defaults.resolve(params, len(ids), self.max_model_len)
        bad = [t for t in params.stop_token_ids if not 0 <= t < self.args.vocab_size]
        if bad:
            raise InvalidArgument(f"stop token id {bad[0]} is outside the vocabulary [0, {self.args.vocab_size})")
        bad = [t for t, _ in params.logit_bias if not 0 <= t < self.args.vocab_size]
        if bad:
            raise InvalidArgument(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {self.args.vocab_size})")
        rid = request_id or uuid.uuid4().hex
        n = params.n
        seqs = []
        for i in range(n):
            gen = None
            if not params.greedy:
                gen = torch.Generator().manual_seed(secrets.randbits(63) if params.seed is None
                                                    else (params.seed + i) % 2**64)
            seqs.append(Seq(rid if n == 1 else f"{rid}-{i}", ids, params, self.max_model_len, gen))
            if i:
                seqs[i].prefill_after = seqs[0]
        self.scheduler.check_fits(seqs[0], n)
        if params.structured is not None:  # each choice its own matcher (one compile, cached)
            for seq in seqs:
                seq.grammar = self.grammars.compile(params.structured)
        stream = RequestStream(rid, len(ids), self.abort, n)
        keys = {rid, *(s.request_id for s in seqs)}
        with self._lock:
            if self._stopping:
                raise FailedPrecondition("the engine is shutting down")
            if taken := sorted(keys & self._ids):
                raise InvalidArgument(f"request id {taken[0]!r} is already in flight")
            self._ids.update(keys)
            self._inbox.append(("add", (seqs, stream)))
            self._wake.notify()
        return stream

    def abort(self, request_id: str) -> None:
        """Cancel a request, every choice of it (no-op when unknown or finished): blocks freed,
        each choice's final delta CANCELLED."""
        with self._lock:
            self._inbox.append(("abort", request_id))
            self._wake.notify()

    # -- stepping ----------------------------------------------------------------------------

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._inbox) or self.scheduler.has_work()

    def _drain_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for kind, item in inbox:
            if kind == "call":
                item()
            elif kind == "add":
                seqs, stream = item
                for i, seq in enumerate(seqs):
                    self.output.add(seq, stream, i)
                    self.scheduler.add(seq)
            else:
                for seq in self.output.seqs_of(item):
                    self._finish(seq, FinishReason.CANCELLED)

    def step(self) -> int:
        """Apply queued adds/aborts and run one scheduler step. Returns the sequences stepped."""
        self._drain_inbox()
        self.block_manager.computed_by = self.runner.computed_by()  # programs change between steps only
        batch = self.scheduler.schedule()
        if not batch:
            return 0
        gated = self.gate is not None and not batch.is_prefill and self.runner.decode_program is not None
        if gated and self._gate_installs != self.runner.installs:
            self.gate.reset()
            self._gate_installs = self.runner.installs
        if gated and batch.is_speculative and not self.gate.allow(self.runner.batch_bucket(len(batch))):
            batch.drop_drafts()
        before = sum(s.num_tokens for s in batch.seqs) if gated else 0
        t0 = time.perf_counter()
        try:
            self._run(batch)
        except Exception:
            log.exception("step failed; aborting its sequences")
            for seq in batch.seqs:
                if self.output.seq(seq.request_id) is seq:  # its final delta not queued yet
                    self._finish(seq, FinishReason.ABORTED)
        else:
            if gated:  # the step's rate: tokens it emitted (every row; accepted drafts too) per second
                emitted = sum(s.num_tokens for s in batch.seqs) - before
                self.gate.record("verify" if batch.is_speculative else "decode", self.runner.batch_bucket(len(batch)),
                                 emitted, time.perf_counter() - t0)
        return len(batch)

    def _run(self, batch: ScheduledBatch) -> None:
        streams = self._with_streams
        if batch.is_speculative or (streams and not batch.is_prefill):
            self._run_verify(batch)
            return
        out = self.runner.run(batch, with_streams=True) if streams else (self.runner.run(batch),)
        logits = out[0]
        rows = batch.sampling_rows()
        sampling = [batch.seqs[i] for i in rows]
        if rows:
            grammars = constrained(sampling)
            if grammars:  # in place: a constrained row's logprobs are those of its masked logits
                self.grammar_masks.apply(logits, sampling)
            processed = self.penalties.process(logits, sampling)
            tokens, logprobs = self.sampler(processed, [s.params for s in sampling], [s.generator for s in sampling],
                                            raw=logits)
            if grammars:
                consume(sampling, [[t] for t in tokens])
            self.scheduler.postprocess(batch, tokens)
            self.generated_tokens_total += len(tokens)
            outs = self.output.process(sampling, logprobs)
            if grammars:
                finish_completed(sampling, outs)
            self._emit(sampling, outs)
        else:
            self.scheduler.postprocess(batch, [])
        if streams:
            self.drafter.observe(batch.seqs, batch.starts, batch.num_tokens, out[1])

    def _run_verify(self, batch: ScheduledBatch) -> None:
        """A speculative decode step: verify every row's drafts (:meth:`Sampler.verify`), append
        what each emits, count acceptance, stream the deltas, propose the next drafts."""
        seqs = batch.seqs
        drafts = [s.draft_token_ids for s in seqs]
        streams = self._with_streams
        out = self.runner.run(batch, with_streams=True) if streams else (self.runner.run(batch),)
        logits = out[0]
        scheduled = [1 + len(d) for d in drafts]
        walked = None
        if constrained(seqs):  # drafts cut at the first the grammar refuses; every position masked
            drafts, walked = self.grammar_masks.apply_verify(logits, seqs, drafts)
        emitted, logprobs = self.sampler.verify(self.penalties.process_verify(logits, seqs), drafts,
                                                [s.params for s in seqs], [s.generator for s in seqs], raw=logits)
        for d, e in zip(drafts, emitted, strict=True):
            if d:
                self.spec_num_drafts += 1
                self.spec_draft_tokens += len(d)
                self.spec_accepted_tokens += len(e) - 1
        if walked is not None:
            emitted = consume(seqs, emitted, walked)
        before = [s.num_tokens for s in seqs]
        # a batch without drafts (the mtp drafter's streams path) emits one token a row
        self.scheduler.postprocess(batch, emitted if batch.is_speculative else [e[0] for e in emitted])
        counts = [s.num_tokens - b for s, b in zip(seqs, before, strict=True)]
        self.generated_tokens_total += sum(counts)
        outs = self.output.process(seqs, [lp[:c] if lp else None for lp, c in zip(logprobs, counts, strict=True)],
                                   counts)
        if walked is not None:
            finish_completed(seqs, outs)
        self._emit(seqs, outs)
        if streams:
            self.drafter.observe(seqs, [b - 1 for b in before], scheduled, out[1])

    def _emit(self, seqs: list[Seq], outs: list[RequestOutput]) -> None:
        """Publish each sampling sequence's delta, or finish it with it; then, when speculating,
        propose the running ones' next drafts."""
        for seq, out in zip(seqs, outs, strict=True):
            if out.finish_reason is None:
                self.output.publish(seq, out)
            else:
                self._finish(seq, out.finish_reason, out)
        if self.drafter is not None:
            self.drafter.propose(seqs)

    def _finish(self, seq: Seq, reason: FinishReason, out: RequestOutput | None = None) -> None:
        """Free ``seq``'s blocks (no-op when the scheduler did already), then queue its final delta."""
        self.scheduler.finish(seq, reason)
        self.penalties.release(seq)
        done = self.output.finish(seq, reason, out)  # the request's id once its last choice finished
        with self._lock:
            self._ids.discard(seq.request_id)
            if done is not None:
                self._ids.discard(done)

    def run_until_done(self, max_steps: int | None = None) -> int:
        """Step (in this thread) until no work is left; returns the steps taken. For tests and
        benchmarks that do not start the loop thread.

        Raises ``RuntimeError`` when the loop thread is running: two threads stepping one
        engine would race on the scheduler and on each request's generator."""
        if self._thread is not None and self._thread is not threading.current_thread():
            raise RuntimeError("run_until_done() while the engine loop thread is running; "
                               "submit requests and read their streams instead")
        steps = 0
        while self.has_work() and (max_steps is None or steps < max_steps):
            self.step()
            steps += 1
        return steps

    # -- background loop ---------------------------------------------------------------------

    def start(self) -> None:
        """Start the background stepping thread (idempotent). A server should rather
        :meth:`launch` its engine (see the module docstring)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
            self._thread.start()

    @classmethod
    def launch(cls, build: Callable[[], LLMEngine]) -> LLMEngine:
        """Call ``build`` (which prepares the weights and constructs the engine) in a new thread
        that then runs the engine's loop; returns the engine once built, its loop running.
        Everything compute-heavy (packing, loading, warm-up, steps) thus runs in one thread:
        one OpenMP master for the process (see the module docstring). Raises what ``build``
        raises."""
        built: list[LLMEngine] = []
        failed: list[BaseException] = []
        done = threading.Event()

        def main() -> None:
            try:
                engine = build()
                engine._thread = threading.current_thread()
                built.append(engine)
            except BaseException as e:  # handed to the caller
                failed.append(e)
                return
            finally:
                done.set()
            engine._loop()

        threading.Thread(target=main, name="engine-loop", daemon=True).start()
        done.wait()
        if failed:
            raise failed[0]
        return built[0]

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and not self._inbox and not self.scheduler.has_work():
                    self._wake.wait(timeout=1.0)
                if self._stopping:
                    return
            try:
                self.step()
            except Exception:  # a scheduler bug must not kill the loop: fail what is in flight
                log.exception("engine step failed outside the model; aborting all requests")
                for seq in self.output.seqs():
                    self._finish(seq, FinishReason.ABORTED)

    def close(self) -> None:
        """Stop the loop and a background build, abort what is in flight (ABORTED), free the buffers
        (the runner's and the drafter's)."""
        self.programs.close()
        with self._lock:
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._drain_inbox()
        for seq in self.output.seqs():
            self._finish(seq, FinishReason.ABORTED)
        self.runner.close()
        close = getattr(self.drafter, "close", None)  # its staging buffers go with the runner's
        if close is not None:
            close()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- introspection -----------------------------------------------------------------------

    def stats(self) -> dict[str, int | float]:
        """Counts for metrics and the router (approximate when read from another thread):
        running, waiting, kv_blocks_used, kv_blocks_total, generated_tokens_total, and the
        prefix cache's: prefix_caching (1 on, 0 off), prefix_cache_queried_tokens (tokens of the
        sequences looked up when scheduled for prefill, preempted ones again), prefix_cache_tokens_saved
        (those found cached, so not computed), prefix_cache_hit_rate (saved / queried),
        prefix_cache_blocks (blocks holding cached K/V, in use or evictable); and speculative
        decoding's (vLLM's names): spec_decode_num_drafts (rows that verified drafts),
        spec_decode_num_draft_tokens, spec_decode_num_accepted_tokens,
        spec_decode_acceptance_rate (accepted / draft tokens) and spec_decode_mean_acceptance_length
        (tokens a drafted row emits per step: 1 + accepted / drafts), 0 while none was verified."""
        bm = self.block_manager
        return {
            "running": self.scheduler.num_running,
            "waiting": self.scheduler.num_waiting,
            "kv_blocks_used": bm.num_used_blocks,
            "kv_blocks_total": bm.num_usable_blocks,
            "generated_tokens_total": self.generated_tokens_total,
            "prefix_caching": int(bm.enable_prefix_caching),
            "prefix_cache_queried_tokens": bm.prefix_queried_tokens,
            "prefix_cache_tokens_saved": bm.prefix_hit_tokens,
            "prefix_cache_hit_rate": bm.prefix_hit_rate,
            "prefix_cache_blocks": bm.num_cached_blocks,
            **self.spec_stats(),
        }

    def spec_stats(self) -> dict[str, int | float]:
        """The speculative-decoding part of :meth:`stats`."""
        drafts, tokens, accepted = self.spec_num_drafts, self.spec_draft_tokens, self.spec_accepted_tokens
        return {
            "spec_decode_num_drafts": drafts,
            "spec_decode_num_draft_tokens": tokens,
            "spec_decode_num_accepted_tokens": accepted,
            "spec_decode_acceptance_rate": accepted / tokens if tokens else 0.0,
            "spec_decode_mean_acceptance_length": 1 + accepted / drafts if drafts else 0.0,
        }
