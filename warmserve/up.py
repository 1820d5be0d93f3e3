"""``warmserve up``'s foreground: start a :class:`~warmserve.stack.LocalStack`, print its
endpoints and reports, heal it until Ctrl-C."""

from __future__ import annotations

import signal
import sys
import threading
from typing import TextIO

from services.ports import KERNEL_CACHE, OPENAI, WEIGHTS
from warmserve.stack import LocalStack
from warmserve.stack_config import StackConfig
from warmserve.stack_report import format_startup_report, programs_took_over


def _announce_programs(stack: LocalStack, pending: set[int], out: TextIO) -> None:
    """One line per runner in ``pending`` whose compiled programs took over (or failed) since the
    last look; those leave ``pending``."""
    for i in sorted(pending):
        try:
            info = stack.startup_report(i)
        except Exception:  # noqa: BLE001 - restarting, or busy: look again later
            continue
        if info.program_state != "pending":
            pending.discard(i)
            out.write(f"runner-{i}: {programs_took_over(info)}\n")
            out.flush()


def _announce_back(stack: LocalStack, back: set[int], pending: set[int], out: TextIO) -> None:
    """One line per restarted runner in ``back`` once it answers again: its start-up time and
    programs (a restarted runner usually finds them in the kernel cache); a runner whose programs
    are still pending joins ``pending``."""
    for i in sorted(back):
        try:
            info = stack.startup_report(i)
        except Exception:  # noqa: BLE001 - still starting
            continue
        back.discard(i)
        if info.program_state == "pending":
            pending.add(i)
        out.write(f"runner-{i} is back: serving after {info.startup.total_seconds:.1f} s; programs "
                  f"{info.program_state or info.compile_mode}: {info.program_detail}\n")
        out.flush()


def door_curl(stack: LocalStack) -> str:
    """The start of a ``curl`` command line (bash) that the stack's OpenAI door accepts: its
    TLS files, and with the stack's API key the ``Authorization`` header read from
    ``HOME/auth/openai.key`` by ``-H @<(printf ...)`` (``printf`` is a bash builtin, so the key
    is on no process's command line, unlike ``-H "Authorization: Bearer $(cat KEY)"``)."""
    from warmserve.stack_auth import DOOR_TAKES_API_KEY, OPENAI_KEY_FILE, auth_dir

    pki, parts = stack.commands.pki, ["curl"]
    if pki is not None:
        parts.append(f"--cacert {pki.ca} --cert {pki.cert} --key {pki.key}")
    if stack.config.auth and DOOR_TAKES_API_KEY:
        parts.append(f"-H @<(printf 'Authorization: Bearer %s' \"$(cat {auth_dir(stack.home) / OPENAI_KEY_FILE})\")")
    return " ".join(parts)


def ready_hint(stack: LocalStack) -> str:
    """What ``up`` prints once started: a ``generate`` command that works now, or, for a stack
    without runners, how to add one (its router answers UNAVAILABLE until one registers); then,
    when the stack runs its OpenAI door, the door's base URL and a ``curl`` line it accepts
    (:func:`door_curl`)."""
    door, pki = "", stack.commands.pki
    tls = f" --tls-ca {pki.ca} --tls-cert {pki.cert} --tls-key {pki.key}" if pki is not None else ""
    if OPENAI in stack.services:
        url = f"{'https' if pki else 'http'}://{stack.address(OPENAI)}/v1"
        door = f"\nOpenAI-compatible API: {url}   (e.g. {door_curl(stack)} {url}/models)"
    if stack.runners:
        return f"ready: warmserve generate --addr {stack.router_address}{tls} \"Hello!\"   (Ctrl-C stops)" + door
    return (f"ready, with no runners: the router at {stack.router_address} answers UNAVAILABLE until one "
            f"registers; add one that shares this stack's weights and kernel cache with\n"
            f"  warmserve runner serve --model {stack.config.model} --router {stack.router_address} --weights "
            f"{stack.address(WEIGHTS)} --kernel-cache {stack.address(KERNEL_CACHE)} --sidecar-dir "
            f"{stack.home / 'sidecars'} --port 0{door}\n(Ctrl-C stops the stack)")


def run_up(config: StackConfig, *, out: TextIO = sys.stdout) -> int:
    """``warmserve up``: start the stack, print endpoints and start-up reports, then run until
    SIGINT/SIGTERM (exit 0), relaunching children that exit (:meth:`LocalStack.heal`), or until
    one keeps exiting past the restart cap (exit 1); stops every child either way."""
    stop = threading.Event()
    started = threading.Event()

    def on_signal(signum, _frame):
        stop.set()
        if not started.is_set():
            raise KeyboardInterrupt  # abandon start-up; start() stops what it launched

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    stack = LocalStack(config)
    try:
        stack.start()
        started.set()
        out.write("\nendpoints:\n")
        for name, addr in stack.endpoints().items():
            scheme = "https" if config.tls else "http"
            out.write(f"  {name:<13} {f'{scheme}://{addr}/v1' if name == OPENAI else addr}\n")
        pending = set()
        for i in range(len(stack.runners)):
            info = stack.startup_report(i)
            out.write("\n" + format_startup_report(info) + "\n")
            if info.program_state == "pending":
                pending.add(i)
        if config.auth:
            from warmserve.stack_auth import DOOR_TAKES_API_KEY, OPENAI_KEY_FILE, auth_dir

            d = auth_dir(stack.home)
            out.write(f"\ntokens: {d} (0600; `warmserve generate/chat/status` against this stack use "
                      f"{d / 'client.token'} by themselves; drain/evict need {d / 'admin.token'})\n")
            if OPENAI in stack.services and DOOR_TAKES_API_KEY:
                out.write(f"OpenAI API key: {d / OPENAI_KEY_FILE} (send 'Authorization: Bearer <its first line>'; "
                          "the curl line below keeps it off the command line)\n")
        out.write("\n" + ready_hint(stack) + "\n")
        out.flush()
        ticks, restarts, back = 0, stack.restarts(), set()
        while not stop.wait(1.0):
            ticks += 1
            if pending and ticks % 5 == 0:
                _announce_programs(stack, pending, out)
            if back:
                _announce_back(stack, back, pending, out)
            given_up = stack.heal()
            now = stack.restarts()
            back |= {int(n.removeprefix("runner-")) for n, c in now.items()
                     if n.startswith("runner-") and c > restarts.get(n, 0)}
            restarts = now
            if given_up:
                for c in given_up:
                    print(f"warmserve: {c.name} keeps exiting (status {c.proc.returncode}, "
                          f"{config.max_restarts_per_minute} restarts in a minute); giving up. Its log "
                          f"({c.log_path}) ends:\n{c.log_tail(10)}", file=sys.stderr)
                return 1
        print("stopping ...", file=sys.stderr)
        return 0
    finally:
        stack.stop()
        for s, h in previous.items():
            signal.signal(s, h)
