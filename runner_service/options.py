"""The runner's options, each declared once (``docs/architecture.md`` §1, "The local stack").

:data:`RUNNER_OPTIONS` generates ``runner serve``'s flags (:func:`add_serve_options`), the
``up``/``demo`` flags that reach every runner (:func:`add_forwarded_options`), a stack's runner
command line (:func:`runner_argv`), :class:`runner_service.config.EngineConfig`'s defaults and
the engine config of parsed flags (:func:`engine_fields`).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from model_families.dtypes import COMPUTE_DTYPES, QUANTIZED_ACTIVATIONS, WEIGHTS_DTYPE_CHOICES
from services.bootstrap import int_at_least
from services.errors import InvalidArgument

if TYPE_CHECKING:
    from model_families.family import ModelFamily

log = logging.getLogger(__name__)

#: ``--compile`` choices: eager, ``torch.compile`` with Inductor, AOTInductor packages.
COMPILE_MODES = ("off", "inductor", "aoti")
#: ``--dtype`` choices (``auto``: :func:`runner_service.device.resolve_dtype`).
DTYPES = ("auto", *COMPUTE_DTYPES)
#: ``--weights-dtype`` choices.
WEIGHTS_DTYPES = WEIGHTS_DTYPE_CHOICES
#: The most rows (sequences) of a step a compiled program takes: programs are exported for batches
#: 1 .. this bound whatever ``--max-num-seqs`` is (it bounds only the programs' shape check), so
#: runners that differ in ``--max-num-seqs`` share them (``docs/architecture.md`` §9).
MAX_PROGRAM_BATCH = 256
#: ``--speculative`` choices: ``off`` (one token per sequence and step), ``ngram`` (prompt
#: lookup drafts: :mod:`runner_service.ngram`) or ``mtp`` (the checkpoint's multi-token-prediction
#: block drafts: :mod:`runner_service.mtp`), the drafts verified by one step of ``1 + K`` tokens per
#: sequence.
SPECULATIVE_METHODS = ("off", "ngram", "mtp")
#: The methods whose drafter needs every step's residual streams: their verify step (eager or
#: the ``verify`` program) returns them beside the logits, and every decode step is a verify step.
STREAMS_METHODS = ("mtp",)
#: The most draft tokens per sequence and step (``--num-speculative-tokens``).
MAX_SPECULATIVE_TOKENS = 4
#: The longest suffix the n-gram lookup tries (``--prompt-lookup-max``, and so ``--prompt-lookup-min``).
#: vLLM sets no cap, but here every appended token registers one n-gram per size in ``[min, max]``
#: (:class:`runner_service.ngram.NgramIndex`: host time and memory grow with ``max**2``), and
#: suffixes longer than a few tokens rarely find a match a shorter one misses; 32 keeps that
#: bounded at 8x vLLM's largest documented example (4).
MAX_PROMPT_LOOKUP = 32
#: The ``namespace`` attribute listing the dests of the value flags given on the command line
#: (:class:`_Given`), for :func:`check_options`' warning about ignored ones.
GIVEN = "given_options"

_positive_int = int_at_least(1)
_SAME = object()


class _Given(argparse.Action):
    """``store``, and the dest added to the namespace's :data:`GIVEN` set."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        setattr(namespace, GIVEN, {*getattr(namespace, GIVEN, ()), self.dest})


@dataclass(frozen=True)
class Option:
    """One ``runner serve`` flag.

    ``kind``: ``value`` (takes one value), ``switch`` (``--x`` / ``--no-x``) or ``off`` (a
    ``--no-x`` flag that sets ``dest`` to ``False``). ``default`` is the library's
    (:class:`~runner_service.config.EngineConfig`'s where ``field`` names its field);
    ``cli_default`` is ``runner serve``'s where it differs on purpose. ``forwarded``: ``up`` and
    ``demo`` take the flag and pass it to every runner. ``group``: flags sharing one are
    mutually exclusive.
    """

    flag: str
    help: str
    default: object = None
    cli_default: object = _SAME
    type: Callable[[str], object] | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    kind: str = "value"
    dest: str = ""
    field: str | None = None
    required: bool = False
    forwarded: bool = False
    group: str | None = None

    def __post_init__(self) -> None:
        if not self.dest:
            object.__setattr__(self, "dest", self.flag.removeprefix("--").replace("-", "_"))

    @property
    def serve_default(self) -> object:
        """``runner serve``'s default."""
        return self.default if self.cli_default is _SAME else self.cli_default

    def add_to(self, parser, *, default: object, help: str) -> None:
        """Add this flag to an ``argparse`` parser (or group) with ``default`` and ``help``."""
        if self.kind == "off":
            parser.add_argument(self.flag, dest=self.dest, action="store_false", help=help)
            return
        if self.kind == "switch":
            parser.add_argument(self.flag, dest=self.dest, action=argparse.BooleanOptionalAction,
                                default=default, help=help)
            return
        extra = {"required": True} if self.required else {"default": default}
        parser.add_argument(self.flag, dest=self.dest, action=_Given, type=self.type, choices=self.choices,
                            metavar=self.metavar, help=help, **extra)

    def argv(self, value: object) -> list[str]:
        """The words that give ``value`` to ``runner serve``: ``[]`` for ``None`` (and for an
        ``off`` flag's ``True``)."""
        if value is None:
            return []
        if self.kind == "off":
            return [] if value else [self.flag]
        if self.kind == "switch":
            return [self.flag if value else "--no-" + self.flag.removeprefix("--")]
        return [self.flag, str(value)]

    def validate(self, value: object) -> None:
        """``InvalidArgument`` naming the flag when ``value`` (not ``None``) is not one it takes."""
        if value is None or self.kind != "value":
            return
        if self.choices is not None and value not in self.choices:
            raise InvalidArgument(f"{self.flag} must be one of {', '.join(self.choices)}, got {value!r}")
        if self.type is not None:
            try:
                self.type(str(value))
            except (argparse.ArgumentTypeError, ValueError) as e:
                raise InvalidArgument(f"{self.flag}: {e}") from None


def check_program_batch(compile: str, max_num_seqs: int) -> None:
    """``InvalidArgument`` when ``compile`` (a :data:`COMPILE_MODES` entry) compiles programs and
    ``max_num_seqs`` exceeds :data:`MAX_PROGRAM_BATCH`, the most rows they take."""
    if compile != "off" and max_num_seqs > MAX_PROGRAM_BATCH:
        raise InvalidArgument(f"--max-num-seqs {max_num_seqs} exceeds {MAX_PROGRAM_BATCH}, the most sequences a "
                              f"compiled program takes (--compile {compile}); use at most {MAX_PROGRAM_BATCH}, "
                              "or --compile off")


def speculative_summary(method: str, num_speculative_tokens: int, num_drafts: int | None = None,
                        acceptance_rate: float = 0.0, mean_acceptance_length: float = 0.0) -> str:
    """Speculative decoding as a phrase: ``off``, ``ngram x3`` (no counts: ``num_drafts`` ``None``),
    or with counts ``ngram x3: acceptance 0.62, 2.10 tokens/step`` (``no drafts yet`` for 0 drafts)."""
    if not method or method == "off":
        return "off"
    if num_drafts is None:
        return f"{method} x{num_speculative_tokens}"
    counts = (f"acceptance {acceptance_rate:.2f}, {mean_acceptance_length:.2f} tokens/step" if num_drafts
              else "no drafts yet")
    return f"{method} x{num_speculative_tokens}: {counts}"


def check_prompt_lookup(prompt_lookup_min: int, prompt_lookup_max: int) -> None:
    """``InvalidArgument`` unless ``1 <= prompt_lookup_min <= prompt_lookup_max <=``
    :data:`MAX_PROMPT_LOOKUP` (the n-gram suffix sizes)."""
    if not 1 <= prompt_lookup_max <= MAX_PROMPT_LOOKUP:
        raise InvalidArgument(f"--prompt-lookup-max must be in [1, {MAX_PROMPT_LOOKUP}], got {prompt_lookup_max}")
    if not 1 <= prompt_lookup_min <= prompt_lookup_max:
        raise InvalidArgument(f"--prompt-lookup-min ({prompt_lookup_min}) must be in [1, --prompt-lookup-max "
                              f"({prompt_lookup_max})]")


def check_family_method(family: ModelFamily, method: str) -> None:
    """``InvalidArgument`` when ``family`` cannot draft with the speculative ``method`` (not
    ``off`` and not in its :attr:`~model_families.family.ModelFamily.speculative_methods`)."""
    if method != "off" and method not in family.speculative_methods:
        methods = ", ".join(family.speculative_methods) or "none"
        raise InvalidArgument(f"the {family.name} family cannot use --speculative {method} (its methods: {methods})")


def check_model_method(model: str, method: str) -> None:
    """:func:`check_family_method` for the model source ``model``, before anything starts, when
    its family is cheap to know here: from a local GGUF's header or ``config.json``
    (:func:`weight_service.checkpoint.source_architecture`, no weights read). A source that does not
    resolve here (one only a weight service sees) or of no known family is left to the engine,
    which checks again once the model is loaded."""
    if method == "off":
        return
    from model_families import family_for_architecture
    from weight_service.checkpoint import source_architecture
    from weight_service.sources import resolve_source

    try:
        family = family_for_architecture(source_architecture(resolve_source(model)))
    except InvalidArgument:
        return
    check_family_method(family, method)


def _with_default(text: str, value: object) -> str:
    if value is None or "default" in text:
        return text
    shown = {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value
    return f"{text} (default {shown:g})" if isinstance(shown, float) else f"{text} (default {shown})"


MODEL = Option("--model", "model source: a GGUF file or an HF checkpoint dir", required=True)
WEIGHTS = Option("--weights", "weight-sidecar service address (default: prepare the sidecar here)", metavar="ADDR")
KERNEL_CACHE = Option("--kernel-cache", "kernel-cache service address", metavar="ADDR", group="cache")
KERNEL_CACHE_DIR = Option("--kernel-cache-dir", "local kernel-cache directory", metavar="DIR", group="cache")
DTYPE = Option("--dtype", "compute and KV-cache dtype (auto: bf16 where the CPU has AVX512-BF16 or AMX, else f32)",
               default="f32", cli_default="auto", choices=DTYPES, field="dtype", forwarded=True)
WEIGHTS_DTYPE = Option("--weights-dtype", "the sidecar's dtype; int4/int8 stay quantized (auto: the checkpoint's own)",
                       default="auto", choices=WEIGHTS_DTYPES, forwarded=True)
ACTIVATIONS = Option("--quantized-activations", "bf16 compute over int4 weights and the int8 head: int8 quantizes "
                     "each row's activations per 32 values (llama.cpp's Q8; AVX512-VNNI, else bf16), bf16 keeps them",
                     default="int8", choices=QUANTIZED_ACTIVATIONS, field="quantized_activations", forwarded=True)
COMPILE = Option("--compile", "compiled decode and prefill programs, through the kernel cache (off: eager)",
                 default="off", cli_default="aoti", choices=COMPILE_MODES, field="compile", forwarded=True)
COMPILE_IN_BACKGROUND = Option("--compile-in-background", kind="switch", default=False, cli_default=True,
                               field="background_compile",
                               help="with --compile aoti: serve eager until the programs are fetched or built")
BUILD_LEASE_TTL = Option("--build-lease-ttl", "seconds a kernel-cache build lease outlives a runner that dies",
                         default=30.0, type=float, metavar="SECONDS", field="build_lease_s")
MAX_NUM_SEQS = Option("--max-num-seqs", "sequences decoded together at most", default=32, type=_positive_int,
                      field="max_num_seqs", forwarded=True)
MAX_NUM_BATCHED_TOKENS = Option("--max-num-batched-tokens", "tokens per scheduler step at most (unset: "
                                "max(2048, max-model-len)); longer prompts and backlogs are prefilled in chunks, "
                                "a decode step between chunks; smaller: a lower median TTFT under a burst, fewer "
                                "tokens/s (docs/benchmarks.md)", type=_positive_int, field="max_num_batched_tokens",
                                forwarded=True)
MAX_MODEL_LEN = Option("--max-model-len", "context length in tokens (default: the model's, capped at 2048)",
                       type=_positive_int, field="max_model_len")
BLOCK_SIZE = Option("--block-size", "tokens per KV block", default=16, type=_positive_int, field="block_size")
KV_CACHE_BYTES = Option("--kv-cache-bytes", "KV cache size in bytes (default: a fraction of free memory)",
                        type=_positive_int, field="kv_cache_bytes")
SIDECAR_DIR = Option("--sidecar-dir", "where sidecars are prepared or fetched to (default $WARMSERVE_HOME/sidecars)",
                     metavar="DIR")
RUNNER_ID = Option("--runner-id", "name reported to clients and the router")
ROUTER = Option("--router", "register with this router", metavar="ADDR")
DEVICE = Option("--device", "auto | cpu | cuda[:N] | npu[:N]", default="auto", field="device")
PREFIX_CACHING = Option("--no-prefix-caching", "do not reuse KV blocks across requests sharing a prompt prefix",
                        kind="off", dest="prefix_caching", default=True, field="enable_prefix_caching",
                        forwarded=True)
BATCH_INVARIANT = Option("--batch-invariant", kind="switch", default=False, field="batch_invariant", forwarded=True,
                         help="a request's tokens, bit for bit, independent of its batch-mates, of the prefill "
                              "chunking and of prefix-cache hits; runs eager, slower (docs/benchmarks.md)")
SIGNING_KEY = Option("--signing-key", "this runner's own Ed25519 key (PEM, `warmserve keys new`): programs it publishes "
                     "and sidecars it packs are signed with it (default $WARMSERVE_SIGNING_KEY)", metavar="F")
TRUSTED_KEYS = Option("--trusted-keys", "a .pub key or a directory of them: fetched programs and sidecars must be "
                      "signed by one, else they are refused (default $WARMSERVE_TRUSTED_KEYS; none: artifacts not "
                      "verified)", metavar="PATH")
MAX_PROMPT_BYTES = Option("--max-prompt-bytes", "largest prompt in UTF-8 bytes, refused before it is tokenized",
                          default=1 << 20, type=_positive_int, metavar="BYTES", field="max_prompt_bytes")
SPECULATIVE = Option("--speculative", "speculative decoding: draft tokens verified by one step (ngram: prompt "
                     "lookup; mtp: the checkpoint's MTP block; greedy output unchanged, sampled output keeps its "
                     "distribution)", default="off",
                     choices=SPECULATIVE_METHODS, field="speculative", forwarded=True)
NUM_SPECULATIVE_TOKENS = Option("--num-speculative-tokens", f"draft tokens per sequence and step, 1..{MAX_SPECULATIVE_TOKENS}",
                                default=3, type=int_at_least(1, MAX_SPECULATIVE_TOKENS), metavar="K", field="num_speculative_tokens",
                                forwarded=True)
PROMPT_LOOKUP_MAX = Option("--prompt-lookup-max", f"ngram: the longest suffix (tokens) looked up in the sequence, "
                           f"1..{MAX_PROMPT_LOOKUP}", default=4, type=int_at_least(1, MAX_PROMPT_LOOKUP), metavar="N",
                           field="prompt_lookup_max", forwarded=True)
PROMPT_LOOKUP_MIN = Option("--prompt-lookup-min", "ngram: the shortest suffix (tokens) looked up, at most "
                           "--prompt-lookup-max", default=2, type=int_at_least(1, MAX_PROMPT_LOOKUP), metavar="N",
                           field="prompt_lookup_min", forwarded=True)
ZYGOTE = Option("--zygote", "launch through the pre-started runner process serving this socket (`runner zygote`): "
                "no interpreter start or imports; this process stands in for the runner", metavar="PATH")
THREADS = Option("--threads", "CPU threads for torch ops (default: torch's choice)", type=_positive_int,
                 field="num_threads")

#: Every ``runner serve`` flag but the server ones (:func:`services.bootstrap.add_server_args`).
RUNNER_OPTIONS: tuple[Option, ...] = (
    MODEL, WEIGHTS, KERNEL_CACHE, KERNEL_CACHE_DIR, DTYPE, WEIGHTS_DTYPE, ACTIVATIONS, COMPILE,
    COMPILE_IN_BACKGROUND, BUILD_LEASE_TTL, MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS, MAX_MODEL_LEN, BLOCK_SIZE,
    KV_CACHE_BYTES, SIDECAR_DIR, RUNNER_ID, ROUTER, DEVICE, PREFIX_CACHING, BATCH_INVARIANT, SPECULATIVE,
    NUM_SPECULATIVE_TOKENS, PROMPT_LOOKUP_MAX, PROMPT_LOOKUP_MIN, THREADS, MAX_PROMPT_BYTES, SIGNING_KEY,
    TRUSTED_KEYS, ZYGOTE)
#: The options ``up`` and ``demo`` take and pass to every runner.
FORWARDED_OPTIONS: tuple[Option, ...] = tuple(o for o in RUNNER_OPTIONS if o.forwarded)
#: The flags only a speculating runner reads: ``--speculative off`` ignores them.
SPECULATIVE_TUNING: tuple[Option, ...] = (NUM_SPECULATIVE_TOKENS, PROMPT_LOOKUP_MAX, PROMPT_LOOKUP_MIN)


def check_options(values: Mapping[str, object], given: Collection[str] = ()) -> None:
    """Check the runner options that constrain one another, as soon as they are parsed (``runner
    serve``; ``up`` and ``demo`` through :class:`warmserve.stack_config.StackConfig`). ``values``:
    dest -> value (``None`` or missing: ``runner serve``'s default). ``InvalidArgument`` for a
    compiled batch too large (:func:`check_program_batch`) or n-gram sizes out of order
    (:func:`check_prompt_lookup`); with ``--speculative off``, a warning naming the flags of
    :data:`SPECULATIVE_TUNING` among ``given`` (dests) that it ignores."""
    value = {o.dest: o.serve_default if values.get(o.dest) is None else values[o.dest] for o in RUNNER_OPTIONS}
    check_program_batch(value[COMPILE.dest], value[MAX_NUM_SEQS.dest])
    check_prompt_lookup(value[PROMPT_LOOKUP_MIN.dest], value[PROMPT_LOOKUP_MAX.dest])
    ignored = [o.flag for o in SPECULATIVE_TUNING if o.dest in given]
    if value[SPECULATIVE.dest] == "off" and ignored:
        log.warning("%s ignored: --speculative is off", ", ".join(ignored))


def add_serve_options(parser: argparse.ArgumentParser) -> None:
    """Add every option of :data:`RUNNER_OPTIONS` to ``runner serve``'s parser, at ``runner
    serve``'s defaults."""
    groups: dict[str, object] = {}
    for opt in RUNNER_OPTIONS:
        if opt.group and opt.group not in groups:
            groups[opt.group] = parser.add_mutually_exclusive_group()
        target = groups[opt.group] if opt.group else parser
        shown = opt.help if opt.kind == "off" else _with_default(opt.help, opt.serve_default)
        opt.add_to(target, default=opt.serve_default, help=shown)


def add_forwarded_options(parser: argparse.ArgumentParser, defaults: Mapping[str, object] | None = None) -> None:
    """Add :data:`FORWARDED_OPTIONS` to ``up``/``demo``'s parser; ``defaults`` (dest -> value)
    overrides the runner's own default, which is otherwise left to the runner (``None``)."""
    defaults = defaults or {}
    for opt in FORWARDED_OPTIONS:
        default = defaults.get(opt.dest)
        shown = default if default is not None else "the runner's"
        opt.add_to(parser, default=default, help=f"runners: {opt.help}" + ("" if opt.kind == "off" else
                                                                            f" (default {shown})"))


def runner_argv(values: Mapping[str, object]) -> list[str]:
    """``runner serve``'s words for ``values`` (dest -> value; ``None`` leaves the runner's
    default), in :data:`RUNNER_OPTIONS` order; ``KeyError`` for a dest no option declares."""
    unknown = set(values) - {o.dest for o in RUNNER_OPTIONS}
    if unknown:
        raise KeyError(f"no runner option has dest {sorted(unknown)}")
    return [word for o in RUNNER_OPTIONS if o.dest in values for word in o.argv(values[o.dest])]


def engine_fields(args: argparse.Namespace) -> dict[str, object]:
    """The :class:`~runner_service.config.EngineConfig` fields ``runner serve``'s parsed flags set
    (field -> value)."""
    return {o.field: getattr(args, o.dest) for o in RUNNER_OPTIONS if o.field}
