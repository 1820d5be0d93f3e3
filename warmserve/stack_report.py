"""What ``warmserve up``, ``status`` and ``demo`` print: start-up reports and the status tables."""

from __future__ import annotations

from typing import TextIO

from router_service.client import list_runners
from runner_service import options
from services.ports import OPENAI
from services.table import format_table


def programs_took_over(info) -> str:
    """How a ``ModelInfoResponse``'s background-built programs ended: ``compiled programs
    installed at 31.0 s, loop layers; unrolled ones at 190.2 s (DETAIL)`` (or ``building the
    unrolled ones``), or ``failed (staying eager)`` in place of ``installed``."""
    took = "installed" if info.program_state == "installed" else "failed (staying eager)"
    form = f", {info.program_layers} layers" if info.program_layers else ""
    unrolled = (f"; unrolled ones at {info.programs_unrolled_at_s:.1f} s" if info.programs_unrolled_at_s
                else "; building the unrolled ones" if info.programs_building and info.program_layers == "loop" else "")
    return (f"compiled programs {took} at {info.programs_installed_at_s:.1f} s{form}{unrolled} "
            f"({info.program_detail})")


def speculative_summary(spec) -> str:
    """A ``SpeculativeDecoding`` message as the runner's phrase
    (:func:`runner_service.options.speculative_summary`): ``off``, or ``ngram x3: acceptance 0.62,
    2.10 tokens/step`` (``no drafts yet`` before any was verified)."""
    return options.speculative_summary(spec.method, spec.num_speculative_tokens, spec.num_drafts,
                                       spec.acceptance_rate, spec.mean_acceptance_length)


def layer_kinds_summary(kinds) -> str:
    """``kinds`` (one per layer) as runs: ``"0 sliding_attention, 1-3 compressed_sparse_attention"``."""
    runs: list[list] = []
    for i, kind in enumerate(kinds):
        if runs and runs[-1][2] == kind:
            runs[-1][1] = i
        else:
            runs.append([i, i, kind])
    return ", ".join(f"{a}{'' if a == b else f'-{b}'} {k}" for a, b, k in runs)


def format_startup_report(info, title: str = "") -> str:
    """A ``ModelInfoResponse``'s start-up report as an aligned text block (seconds per phase)."""
    head = title or f"start-up report of {info.runner_id}"
    lines = [f"{head}: {info.startup.total_seconds:.2f} s total",
             f"  model {info.model} ({info.family}, {info.weights_dtype or '?'} weights, {info.dtype} compute, "
             f"{info.device}, compile {info.compile_mode}, "
             f"{info.num_kv_blocks} KV blocks x {info.block_size} tokens)"]
    if info.layer_types:
        lines.append(f"  layers {layer_kinds_summary(info.layer_types)}")
    if info.speculative.method not in ("", "off"):
        lines.append(f"  speculative decoding {speculative_summary(info.speculative)}")
    width = max((len(p.name) for p in info.startup.phases), default=0)
    for p in info.startup.phases:
        lines.append(f"  {p.name:<{width}}  {p.seconds:7.2f} s  {p.detail}")
    if info.program_state == "pending":
        lines.append(f"  serving eager at {info.startup.total_seconds:.1f} s; compiled programs pending: "
                     f"{info.program_detail}")
    elif info.programs_installed_at_s:
        lines.append(f"  serving eager at {info.startup.total_seconds:.1f} s; {programs_took_over(info)}")
    return "\n".join(lines)


def _runner_info(address: str, security=None):
    """A runner's ``ModelInfoResponse`` (its programs and its load as of now), ``None`` when it
    does not answer within 2 s."""
    from services.generation_client import GenerationClient

    try:
        with GenerationClient(address, security=security) as client:
            return client.model_info(timeout_s=2.0)
    except Exception:  # noqa: BLE001 - a status line, not an error
        return None


def print_status(router_address: str, services: dict[str, str], *, out: TextIO,
                 restarts: dict[str, int] | None = None, security=None) -> int:
    """Print the health of the router and of each ``name -> address`` in ``services``, then the
    router's runners (state, compiled programs, outstanding, lease, load, KV use, failures). The
    programs and the load come from each runner's ``ModelInfo``, so they are as of now, not as of
    its last heartbeat to the router; a runner that does not answer shows the heartbeat's, marked
    ``(hb)``. ``restarts`` (name -> count, from :func:`read_state`) adds
    a restarts column. The ``openai`` service (the stack's OpenAI door) is probed over HTTP
    (``GET /health``: SERVING, or NOT_SERVING while no runner is READY) and shown by its URL.
    ``security`` (a :class:`services.channel.ClientSecurity`): what every probe presents; its
    TLS files make the door's probe HTTPS too.
    Returns 0, or 1 when the router cannot be reached."""
    from openai_service.healthcheck import check_http_health, client_tls
    from services.healthcheck import check_health
    from services.proto import router_pb2

    restarts = restarts or {}
    tls = security.tls if security is not None else None
    https = client_tls(tls.ca, tls.cert, tls.key) if tls is not None and tls.ca else None
    extra = ("restarts",) if restarts else ()
    rows = [("service", "address", "health", *extra)]
    for name, addr in {"router": router_address, **services}.items():
        shown, health = (f"{'https' if https else 'http'}://{addr}/v1", check_http_health(
            addr, timeout_s=2.0, tls=https)) if name == OPENAI else (addr, check_health(addr, timeout_s=2.0,
                                                                                       security=security))
        rows.append((name, shown, health, *((str(restarts.get(name, 0)),) if restarts else ())))
    out.write(format_table(rows) + "\n")
    if rows[1][2] != "SERVING":
        return 1
    runners = list_runners(router_address, security=security)
    out.write("\n")
    table = [("runner", "address", "state", "programs", "outstanding", "lease", "running/waiting", "KV blocks",
              "speculative", "failures", *extra)]
    for r in runners:
        lease = "static" if r.static else f"{r.lease_expires_in_s:.1f} s"
        info = _runner_info(r.address, security)
        if info is not None:
            programs = info.program_state or info.compile_mode or "?"
            running, waiting, used, usable, mark = (info.running, info.waiting, info.kv_blocks_used,
                                                    info.kv_blocks_usable, "")
            spec = speculative_summary(info.speculative)
        else:
            programs = spec = "?"
            running, waiting, used, usable, mark = (r.load.running, r.load.waiting, r.load.kv_blocks_used,
                                                    r.load.kv_blocks_total, " (hb)")
        kv = f"{used}/{usable}{mark}" if usable else "-"
        state = router_pb2.RunnerStatus.State.Name(r.state).removeprefix("STATE_")
        table.append((r.runner_id, r.address, state, programs,
                      str(r.outstanding), lease, f"{running}/{waiting}{mark}", kv, spec, str(r.consecutive_failures),
                      *((str(restarts.get(r.runner_id, 0)),) if restarts else ())))
    if len(table) == 1:
        out.write("no runners\n")
    else:
        out.write(format_table(table) + "\n")
    return 0

