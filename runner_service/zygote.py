"""A runner zygote: a process that imported the runner's code (torch, gRPC, the engine) once and
forks a runner for each launch, so a launch pays no interpreter start or imports
(``docs/architecture.md`` §1, "The runner zygote").

``warmserve runner zygote --socket PATH`` serves launches on a Unix socket;
``warmserve runner serve --zygote PATH ...`` is a launch: instead of building the engine itself,
the process hands its other arguments, environment, working directory and standard streams to the
zygote, which forks a child that runs ``runner serve`` with them. The launching process stays
the runner for whoever started it: signals sent to it reach the runner, it exits with the
runner's status (re-raising the signal that killed it), and when it dies the runner is killed.
The runner answers health checks with the launching process's pid
(:data:`services.procs.SERVING_PID_ENV`), so a launcher's "is this my child" check holds. SIGSTOP
cannot be passed on: it stops only the stand-in; the runner stays in the zygote's process group
(pause that group, or the runner's own pid, which its log records carry).

Wire format, one connection per launch: length-prefixed JSON messages (:func:`send_message`),
the first from the client carrying its stdin/stdout/stderr as ``SCM_RIGHTS``. The client sends
``{"argv", "env", "cwd", "python", "code"}``; the zygote answers ``{"pid"}`` or ``{"error"}``,
then ``{"exit"}`` (``Popen.returncode``'s convention: ``-N`` for signal N) when the runner ends.

What a zygote refuses (``{"error"}``, the client exits 2): a peer of another uid, argv other than
``runner serve``'s flags, another interpreter or checkout than its own (its code was imported
from them), and an environment whose variables read at import time (:data:`IMPORT_TIME_ENV`)
differ from its own (they took effect when the zygote imported torch, so the runner would not see
the client's). The zygote never runs a step itself: no OpenMP pool, gRPC channel or thread exists
when it forks.
"""

from __future__ import annotations

import array
import importlib
import json
import logging
import os
import selectors
import signal
import socket
import struct
import sys
import time
from pathlib import Path

from services.errors import FailedPrecondition, InvalidArgument, Unavailable
from services.procs import PARENT_PID_ENV, SERVING_PID_ENV

log = logging.getLogger(__name__)

#: Modules a zygote imports before it serves: what ``runner serve`` imports on its way to the
#: first token (the engine and torch, the servers and clients, the families, the tokenizer,
#: AOTInductor's loader). One that fails to import is skipped (the runner imports it itself).
PRELOAD = (
    "runner_service.daemon", "runner_service.servicer", "runner_service.registration", "runner_service.structured",
    "services.bootstrap", "services.channel", "kernel_cache_service.client", "weight_service.client",
    "weight_service.prepare", "weight_service.loader", "model_families.llama.model", "model_families.deepseek_v4.model",
    "torch._inductor.package", "tokenizers", "jinja2",
)
#: Environment variables read when those modules are imported (OpenMP, oneDNN/MKL, torch and
#: Inductor settings, the dynamic loader, the interpreter): a launch whose values differ from
#: the zygote's is refused.
IMPORT_TIME_ENV = ("OMP_", "GOMP_", "KMP_", "MKL_", "DNNL_", "ONEDNN_", "TORCH", "PYTORCH_", "LD_", "PYTHON")
#: Of those, the ones torch reads each time it uses them (so the runner sees the launch's value):
#: Inductor's compile cache (``torch._inductor.runtime.cache_dir_utils.cache_dir``).
READ_AT_USE_ENV = ("TORCHINDUCTOR_CACHE_DIR",)
#: Seconds a client waits for the zygote's socket to accept (a zygote started beside it may
#: still be importing torch).
CONNECT_TIMEOUT_S = 120.0
#: The largest message either side accepts (bytes): an environment and a command line.
MAX_MESSAGE_BYTES = 1 << 20
_HEADER = struct.Struct("!I")
_CODE_DIR = str(Path(__file__).resolve().parent.parent)
#: Signals the client passes on to the runner.
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def send_message(sock: socket.socket, message: dict, fds: list[int] | None = None) -> None:
    """Send ``message`` as a 4-byte big-endian length and its UTF-8 JSON, with ``fds`` as
    ``SCM_RIGHTS`` on the first bytes."""
    data = json.dumps(message).encode()
    payload = _HEADER.pack(len(data)) + data
    if fds:
        sock.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.sendall(payload)


def receive_message(sock: socket.socket, max_fds: int = 0) -> tuple[dict | None, list[int]]:
    """One message of :func:`send_message` and the fds that came with it (at most ``max_fds``);
    ``(None, [])`` when the peer closed first. ``InvalidArgument`` for a message too large or not
    a JSON object."""
    fds: list[int] = []
    buf = b""
    need = _HEADER.size
    size = None
    while len(buf) < need:
        if max_fds and not fds:
            chunk, anc, _flags, _addr = sock.recvmsg(need - len(buf), socket.CMSG_LEN(max_fds * 4))
            for level, kind, data in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.extend(array.array("i", data[: len(data) - len(data) % 4]))
        else:
            chunk = sock.recv(need - len(buf))
        if not chunk:
            for fd in fds:
                os.close(fd)
            return None, []
        buf += chunk
        if size is None and len(buf) >= _HEADER.size:
            (size,) = _HEADER.unpack(buf[:_HEADER.size])
            if size > MAX_MESSAGE_BYTES:
                raise InvalidArgument(f"a zygote message of {size} bytes (at most {MAX_MESSAGE_BYTES})")
            need = _HEADER.size + size
    try:
        message = json.loads(buf[_HEADER.size:])
    except ValueError as e:
        raise InvalidArgument(f"a zygote message that is not JSON: {e}") from None
    if not isinstance(message, dict):
        raise InvalidArgument("a zygote message must be a JSON object")
    return message, fds


def _peer_uid(sock: socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def _peer_pid(sock: socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[0]


def import_time_env(env: dict[str, str]) -> dict[str, str]:
    """The variables of ``env`` that :data:`IMPORT_TIME_ENV` names, but :data:`READ_AT_USE_ENV`."""
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV) and k not in READ_AT_USE_ENV}


def without_zygote_flag(argv: list[str]) -> list[str]:
    """``argv`` without its ``--zygote PATH`` / ``--zygote=PATH`` words."""
    out, skip = [], False
    for word in argv:
        if skip:
            skip = False
        elif word == "--zygote":
            skip = True
        elif not word.startswith("--zygote="):
            out.append(word)
    return out


def check_launch(request: dict) -> list[str]:
    """The argv of a launch request, after the checks of the module docstring
    (``InvalidArgument`` naming the first that fails)."""
    argv, env = request.get("argv"), request.get("env")
    if not (isinstance(argv, list) and all(isinstance(a, str) for a in argv)):
        raise InvalidArgument("a launch needs argv, a list of strings")
    if argv[:2] != ["runner", "serve"] or any(a == "--zygote" or a.startswith("--zygote=") for a in argv):
        raise InvalidArgument("a runner zygote launches `runner serve` only (without --zygote)")
    if not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        raise InvalidArgument("a launch needs env, an object of strings")
    if not isinstance(request.get("cwd"), str):
        raise InvalidArgument("a launch needs cwd, a string")
    if request.get("python") != sys.executable or request.get("code") != _CODE_DIR:
        raise InvalidArgument(f"this zygote runs {sys.executable} with the code in {_CODE_DIR}; the launch "
                              f"came from {request.get('python')} with {request.get('code')}")
    mine, theirs = import_time_env(dict(os.environ)), import_time_env(env)
    differ = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
    if differ:
        raise InvalidArgument(f"the launch's environment differs from the zygote's in {', '.join(differ)}, read "
                              "when torch was imported: start the zygote with the runner's environment")
    return argv


class ZygoteServer:
    """The zygote's side: :meth:`serve` accepts launches on ``path`` until SIGTERM/SIGINT, forks a
    runner per launch and reports each one's exit; on SIGTERM it stops accepting, passes SIGTERM
    to its runners and returns once they exited. Raises ``FailedPrecondition`` when another zygote
    answers on ``path``."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._sel = selectors.DefaultSelector()
        self._runners: dict[int, tuple[socket.socket, int]] = {}  # pid -> (client connection, pidfd)
        self._stopping = False
        self._listener: socket.socket | None = None
        self._wake: tuple[int, ...] = ()

    def preload(self) -> float:
        """Import :data:`PRELOAD`; returns the seconds it took."""
        t0 = time.perf_counter()
        for name in PRELOAD:
            try:
                importlib.import_module(name)
            except Exception as e:  # noqa: BLE001 - optional: the runner imports what it needs itself
                log.warning("zygote preload skipped %s: %s", name, e)
        import threading

        others = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
        if others:  # a fork copies only the calling thread: what these hold (locks, pools) would be broken
            log.warning("zygote: threads running after the preload (%s); runners forked from it may hang",
                        ", ".join(others))
        return time.perf_counter() - t0

    def bind(self) -> None:
        """Listen on :attr:`path` (its directory made 0700 if new, the socket 0600); a stale socket
        file is replaced."""
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        if self.path.exists():
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(str(self.path))
                raise FailedPrecondition(f"another runner zygote serves {self.path}")
            except (ConnectionRefusedError, FileNotFoundError):
                self.path.unlink(missing_ok=True)
            finally:
                probe.close()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o077)
        try:
            listener.bind(str(self.path))
        finally:
            os.umask(old)
        listener.listen(64)
        listener.setblocking(False)
        self._listener = listener
        self._sel.register(listener, selectors.EVENT_READ, ("accept", None))

    def serve(self) -> int:
        """Serve until stopped (see the class docstring); returns the exit code (0)."""
        wake_r, wake_w = self._wake = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_stop)
        self._sel.register(wake_r, selectors.EVENT_READ, ("wake", None))
        try:
            while not (self._stopping and not self._runners):
                for key, _ in self._sel.select(timeout=1.0):
                    kind, pid = key.data
                    if kind == "accept":
                        self._accept()
                    elif kind == "wake":
                        os.read(wake_r, 512)
                    elif kind == "client":
                        self._client_event(pid)
                    elif kind == "exit":
                        self._reap(pid)
        finally:
            signal.set_wakeup_fd(-1)
            self._close_listener()
            os.close(wake_r)
            os.close(wake_w)
            self._wake = ()
        return 0

    def _on_stop(self, signum, _frame) -> None:
        if not self._stopping:
            log.info("zygote stopping (signal %d): %d runner(s) asked to stop", signum, len(self._runners))
        self._stopping = True
        self._close_listener()
        for pid in list(self._runners):
            _kill(pid, signal.SIGTERM)

    def _close_listener(self) -> None:
        if self._listener is not None:
            self._sel.unregister(self._listener)
            self._listener.close()
            self._listener = None
            self.path.unlink(missing_ok=True)

    def _accept(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except (BlockingIOError, AttributeError):
            return
        fds: list[int] = []
        try:
            conn.setblocking(True)
            conn.settimeout(10.0)
            if _peer_uid(conn) != os.getuid():
                raise InvalidArgument("a launch from another user")
            request, fds = receive_message(conn, max_fds=3)
            if request is None:
                raise InvalidArgument("the client closed before its request")
            argv = check_launch(request)
            if len(fds) != 3:
                raise InvalidArgument(f"a launch carries stdin, stdout and stderr, got {len(fds)} file descriptors")
            pid = self._fork(argv, request, fds, _peer_pid(conn), conn)
        except (InvalidArgument, OSError) as e:
            log.warning("zygote refused a launch: %s", e)
            try:
                send_message(conn, {"error": str(e)})
            except OSError:
                pass
            conn.close()
            return
        finally:
            for fd in fds:
                os.close(fd)
        pidfd = os.pidfd_open(pid)
        self._runners[pid] = (conn, pidfd)
        conn.settimeout(None)
        send_message(conn, {"pid": pid})
        self._sel.register(conn, selectors.EVENT_READ, ("client", pid))
        self._sel.register(pidfd, selectors.EVENT_READ, ("exit", pid))
        log.info("zygote forked runner pid %d for client pid %d", pid, _peer_pid(conn))

    def _fork(self, argv: list[str], request: dict, fds: list[int], client_pid: int, conn: socket.socket) -> int:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid:
            return pid
        code = 1
        try:  # the child: becomes `runner serve` with the client's streams, cwd and environment
            signal.set_wakeup_fd(-1)
            for other, pidfd in self._runners.values():  # the zygote's ends of other launches
                other.close()
                os.close(pidfd)
            conn.close()
            self._sel.close()
            if self._listener is not None:
                self._listener.close()
            for fd in self._wake:
                os.close(fd)
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
                signal.signal(sig, signal.SIG_DFL)
            # it stays in the zygote's process group: a signal to the group (Ctrl-C on a zygote run in a
            # terminal, a benchmark pausing the stack) reaches every runner forked from it
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
            os.chdir(request["cwd"])
            os.environ.clear()
            # the zygote is its parent: die_with_parent() watches it (which kills this runner when the
            # zygote dies); health checks answer with the client's pid, the launcher's child
            os.environ.update(request["env"], **{PARENT_PID_ENV: str(os.getppid()), SERVING_PID_ENV: str(client_pid)})
            sys.argv = ["warmserve", *argv]
            code = _run_serve(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
        except BaseException:  # noqa: BLE001 - reported on the runner's stderr, then exit 1
            import traceback

            traceback.print_exc()
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
        return 0  # not reached

    def _client_event(self, pid: int) -> None:
        conn, _ = self._runners[pid]
        try:
            data = conn.recv(1)
        except OSError:
            data = b""
        if not data:  # the client is gone without waiting for the exit: its runner goes too
            log.warning("zygote: the client of runner pid %d is gone; killing it", pid)
            self._sel.unregister(conn)
            _kill(pid, signal.SIGKILL)

    def _reap(self, pid: int) -> None:
        conn, pidfd = self._runners.pop(pid)
        self._sel.unregister(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        log.info("zygote: runner pid %d exited (%d)", pid, code)
        try:
            self._sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        try:
            send_message(conn, {"exit": code})
        except OSError:
            pass
        conn.close()


def _run_serve(argv: list[str]) -> int:
    """``warmserve runner serve`` with ``argv`` in this process, as the ``warmserve`` CLI runs it."""
    import argparse

    from runner_service.cli import register
    from services.errors import run_command
    from services.procs import die_with_parent

    die_with_parent()
    parser = argparse.ArgumentParser(prog="warmserve")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    args.cli_argv = argv
    return run_command(args)


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def connect(path: str | os.PathLike, timeout_s: float = CONNECT_TIMEOUT_S) -> socket.socket:
    """A connection to the zygote at ``path``, waiting up to ``timeout_s`` seconds for it to
    accept. ``Unavailable`` when none does; ``FailedPrecondition`` when the socket's owner is
    another user."""
    end = time.monotonic() + timeout_s
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError) as e:
            sock.close()
            if time.monotonic() > end:
                raise Unavailable(f"no runner zygote answers on {path} after {timeout_s:g} s ({e.strerror})") from None
            time.sleep(0.05)
            continue
        if _peer_uid(sock) != os.getuid():
            sock.close()
            raise FailedPrecondition(f"the runner zygote socket {path} is served by another user")
        return sock


def launch(path: str | os.PathLike, argv: list[str], timeout_s: float = CONNECT_TIMEOUT_S) -> int:
    """Run ``warmserve`` ``argv`` (``runner serve ...``) in the zygote at ``path`` as this
    process's stand-in (see the module docstring); returns the runner's exit code, or re-raises
    the signal that killed it. ``InvalidArgument`` when the zygote refuses the launch,
    ``Unavailable`` when none answers or it dies before the runner."""
    sock = connect(path, timeout_s)
    with sock:
        send_message(sock, {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "python": sys.executable,
                            "code": _CODE_DIR}, fds=[0, 1, 2])
        first, _ = receive_message(sock)
        if first is None:
            raise Unavailable(f"the runner zygote on {path} closed the launch")
        if "error" in first:
            raise InvalidArgument(f"the runner zygote on {path} refused the launch: {first['error']}")
        pid = int(first["pid"])
        for sig in FORWARDED_SIGNALS:
            signal.signal(sig, lambda signum, _frame: _kill(pid, signum))
        last, _ = receive_message(sock)
    if last is None or "exit" not in last:
        raise Unavailable(f"the runner zygote on {path} died before runner pid {pid} ended")
    code = int(last["exit"])
    if code < 0:  # killed by a signal: die of it too, so our launcher sees what a direct child would
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        time.sleep(1.0)
    return code


def serve_zygote(path: str) -> int:
    """``warmserve runner zygote``: preload, bind, log ``ready`` and serve; returns the exit code."""
    server = ZygoteServer(path)
    seconds = server.preload()
    server.bind()
    log.info("ready", extra={"socket": str(server.path), "preload_s": round(seconds, 3)})
    return server.serve()
