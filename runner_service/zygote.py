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
import contextlib
import importlib
import io
import json
import logging
import os
import selectors
import signal
import socket
import stat
import struct
import sys
import time
from pathlib import Path

from services.errors import FailedPrecondition, InvalidArgument, Unavailable
from services.procs import PARENT_PID_ENV, SERVING_PID_ENV, die_with_parent

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
#: Environment variables read once, when the interpreter starts or those modules are imported
#: (OpenMP, oneDNN/MKL/OpenBLAS, torch and Inductor settings, the dynamic loader and the C
#: library's allocator, the interpreter, the locale): a launch whose values differ from the
#: zygote's is refused.
IMPORT_TIME_ENV = ("OMP_", "GOMP_", "KMP_", "MKL_", "DNNL_", "ONEDNN_", "OPENBLAS_", "TORCH", "PYTORCH_", "LD_",
                   "MALLOC_", "GLIBC_TUNABLES", "PYTHON", "LANG", "LC_")
#: Of those, the ones torch reads each time it uses them (so the runner sees the launch's value):
#: Inductor's compile cache (``torch._inductor.runtime.cache_dir_utils.cache_dir``).
READ_AT_USE_ENV = ("TORCHINDUCTOR_CACHE_DIR",)
#: Seconds a client waits for the zygote's socket to accept (a zygote started beside it may
#: still be importing torch).
CONNECT_TIMEOUT_S = 120.0
#: Seconds a client has to send its whole request (the zygote serves one request at a time).
REQUEST_TIMEOUT_S = 2.0
#: The largest message either side accepts (bytes): an environment and a command line.
MAX_MESSAGE_BYTES = 256 << 10
_HEADER = struct.Struct("!I")
_CODE_DIR = str(Path(__file__).resolve().parent.parent)
#: Signals the client passes on to the runner.
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


def send_message(sock: socket.socket, message: dict, fds: list[int] | None = None) -> None:
    """Send ``message`` as a 4-byte big-endian length and its UTF-8 JSON, with ``fds`` as
    ``SCM_RIGHTS`` on the first bytes."""
    data = json.dumps(message).encode()
    payload = _HEADER.pack(len(data)) + data
    if fds:
        sent = sock.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        if sent < len(payload):  # never an empty send: to a peer that already answered and closed, EPIPE
            sock.sendall(payload[sent:])
    else:
        sock.sendall(payload)


def receive_message(sock: socket.socket, max_fds: int = 0,
                    deadline: float | None = None) -> tuple[dict | None, list[int]]:
    """One message of :func:`send_message` and the fds that came with it (at most ``max_fds``;
    the caller closes them); ``(None, [])`` when the peer closed first. ``InvalidArgument`` for a
    message too large, not a JSON object, or not complete by ``deadline`` (``time.monotonic()``);
    fds received before an error are closed."""
    fds: list[int] = []
    try:
        buf = b""
        need, size = _HEADER.size, None
        while len(buf) < need:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise InvalidArgument(f"a zygote request not complete within {REQUEST_TIMEOUT_S:g} s")
                sock.settimeout(left)
            try:
                if max_fds and not fds:
                    chunk, anc, _flags, _addr = sock.recvmsg(need - len(buf), socket.CMSG_SPACE(max_fds * 4))
                    for level, kind, data in anc:
                        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                            fds.extend(array.array("i", data[: len(data) - len(data) % 4]))
                else:
                    chunk = sock.recv(need - len(buf))
            except TimeoutError:
                raise InvalidArgument(f"a zygote request not complete within {REQUEST_TIMEOUT_S:g} s") from None
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
        except (ValueError, RecursionError) as e:
            raise InvalidArgument(f"a zygote message that is not JSON: {type(e).__name__}") from None
        if not isinstance(message, dict):
            raise InvalidArgument("a zygote message must be a JSON object")
        return message, fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """``(pid, uid)`` of the process at the other end of a Unix socket (``SO_PEERCRED``)."""
    pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid, uid


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


def _serve_parser():
    """``warmserve``'s parser with only ``runner serve`` and ``runner zygote``: what a forked
    runner parses its argv with."""
    import argparse

    from runner_service.cli import register

    parser = argparse.ArgumentParser(prog="warmserve")
    register(parser.add_subparsers(dest="command", required=True))
    return parser


def check_launch(request: dict) -> list[str]:
    """The argv of a launch request, after the checks of the module docstring
    (``InvalidArgument`` naming the first that fails)."""
    argv, env = request.get("argv"), request.get("env")
    if not (isinstance(argv, list) and all(isinstance(a, str) for a in argv)):
        raise InvalidArgument("a launch needs argv, a list of strings")
    if argv[:2] != ["runner", "serve"]:
        raise InvalidArgument("a runner zygote launches `runner serve` only")
    try:  # as the runner will read it, abbreviations included; argv it cannot parse fails in the runner (exit 2)
        with contextlib.redirect_stderr(io.StringIO()):
            zygote = _serve_parser().parse_known_args(argv)[0].zygote
    except SystemExit:  # the runner will refuse it; refused here too if a word may be --zygote, abbreviated
        zygote = next((a for a in argv[2:] if a.startswith("--z")), None)
    if zygote is not None:
        raise InvalidArgument("a runner zygote launches `runner serve` without --zygote")
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
                              "when the zygote started: start the zygote with the runner's environment")
    return argv


def _private_directory(path: Path) -> None:
    """Make ``path`` a directory of ours that only we can enter (0700); ``FailedPrecondition``
    when it is a symlink, not a directory, another user's, or open to others."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise FailedPrecondition(f"{path} is not a directory of this user (uid {os.getuid()})")
    if st.st_mode & 0o077:
        raise FailedPrecondition(f"{path} is open to other users (mode {st.st_mode & 0o777:o}); a zygote socket "
                                 "needs a 0700 directory")


class ZygoteServer:
    """The zygote's side: :meth:`serve` accepts launches on ``path`` until SIGTERM/SIGINT, forks a
    runner per launch and reports each one's exit; on SIGTERM it stops accepting, passes SIGTERM
    to its runners and returns once they exited. A request that fails a check is answered with
    ``{"error"}`` and the zygote goes on. Its runners die with it (SIGKILL): it only dies with
    runners alive when it was killed. :meth:`bind` raises ``FailedPrecondition`` when another
    zygote answers on ``path``, something else than a socket is there, or its directory is not
    private (:func:`_private_directory`)."""

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
        """Listen on :attr:`path` (0600, in a private directory); a stale socket is replaced."""
        _private_directory(self.path.parent)
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            st = None
        if st is not None:
            if not stat.S_ISSOCK(st.st_mode):
                raise FailedPrecondition(f"{self.path} exists and is not a socket; not replacing it")
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
        for sig in _STOP_SIGNALS:
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
                    elif kind == "client" and pid in self._runners:
                        self._client_event(pid)
                    elif kind == "exit" and pid in self._runners:
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
        if self._listener is None:
            return
        try:
            conn, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:  # out of fds, ...: this client is not served, the zygote goes on
            log.warning("zygote could not accept a launch: %s", e)
            return
        fds: list[int] = []
        try:
            client_pid, uid = _peer_credentials(conn)
            if uid != os.getuid():
                raise InvalidArgument("a launch from another user")
            conn.setblocking(True)
            request, fds = receive_message(conn, max_fds=3, deadline=time.monotonic() + REQUEST_TIMEOUT_S)
            if request is None:
                raise InvalidArgument("the client closed before its request")
            argv = check_launch(request)
            if len(fds) != 3:
                raise InvalidArgument(f"a launch carries stdin, stdout and stderr, got {len(fds)} file descriptors")
            if self._stopping:
                raise InvalidArgument("the zygote is stopping")
            pid = self._fork(argv, request, fds, client_pid, conn)
        except Exception as e:  # noqa: BLE001 - one client's request never ends the zygote
            log.warning("zygote refused a launch: %s", e)
            with contextlib.suppress(OSError):
                conn.settimeout(1.0)
                send_message(conn, {"error": str(e) if isinstance(e, InvalidArgument) else repr(e)})
            conn.close()
            return
        finally:
            for fd in fds:
                os.close(fd)
        pidfd = None
        try:
            pidfd = os.pidfd_open(pid)
            conn.settimeout(1.0)
            send_message(conn, {"pid": pid})
            conn.settimeout(None)
        except OSError as e:  # the client went away before it knew the pid: its runner goes too
            log.warning("zygote: the client of runner pid %d is gone before its pid was sent (%s)", pid, e)
            _kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            if pidfd is not None:
                os.close(pidfd)
            conn.close()
            return
        self._runners[pid] = (conn, pidfd)
        self._sel.register(conn, selectors.EVENT_READ, ("client", pid))
        self._sel.register(pidfd, selectors.EVENT_READ, ("exit", pid))
        log.info("zygote forked runner pid %d for client pid %d", pid, client_pid)
        if self._stopping:  # the stop came between the fork and now: this runner was not asked yet
            _kill(pid, signal.SIGTERM)

    def _fork(self, argv: list[str], request: dict, fds: list[int], client_pid: int, conn: socket.socket) -> int:
        sys.stdout.flush()
        sys.stderr.flush()
        zygote = os.getpid()
        # no stop signal between the fork and the child's own handlers: a child running _on_stop would
        # SIGTERM its siblings, and one forked after a stop began would never be asked to stop
        signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        try:
            pid = os.fork()
        finally:
            if os.getpid() == zygote:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
        if pid:
            return pid
        code = 1
        try:  # the child: becomes `runner serve` with the client's streams, cwd and environment
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
            die_with_parent(signal.SIGKILL, parent=zygote)  # the zygote died mid-launch: so does this
            for other, pidfd in self._runners.values():  # the zygote's ends of other launches
                other.close()
                os.close(pidfd)
            conn.close()
            self._sel.close()
            if self._listener is not None:
                self._listener.close()
            for fd in self._wake:
                os.close(fd)
            # it stays in the zygote's process group: a signal to the group (Ctrl-C on a zygote run in a
            # terminal, a benchmark pausing the stack) reaches every runner forked from it
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
            os.chdir(request["cwd"])
            os.environ.clear()
            os.environ.update(request["env"])
            os.environ.pop(PARENT_PID_ENV, None)  # the zygote is its launcher, watched above
            os.environ[SERVING_PID_ENV] = str(client_pid)  # health answers with the client's pid
            import tempfile

            tempfile.tempdir = None  # read again from the launch's TMPDIR
            sys.argv = ["warmserve", *argv]
            code = _run_serve(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
        except BaseException:  # noqa: BLE001 - reported on the runner's stderr, then exit 1
            import traceback

            traceback.print_exc()
        finally:
            try:
                logging.shutdown()
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
        return 0  # not reached

    def _client_event(self, pid: int) -> None:
        conn, _ = self._runners[pid]
        try:
            data = conn.recv(65536)  # a client sends nothing after its request: whatever comes is dropped
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
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(conn)
        with contextlib.suppress(OSError):
            conn.settimeout(1.0)
            send_message(conn, {"exit": code})
        conn.close()


def _run_serve(argv: list[str]) -> int:
    """``warmserve runner serve`` with ``argv`` in this process, as the ``warmserve`` CLI runs it."""
    from services.errors import run_command

    args = _serve_parser().parse_args(argv)
    if args.zygote is not None:  # checked by check_launch; never a launch from a launch
        raise InvalidArgument("a runner forked by a zygote cannot launch through one")
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
        if _peer_credentials(sock)[1] != os.getuid():
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
        try:  # signals go to this runner, not to a process that reuses its pid after it is reaped
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            pidfd = None
        for sig in FORWARDED_SIGNALS:
            signal.signal(sig, lambda signum, _frame: _pass_on(pidfd, signum))
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


def _pass_on(pidfd: int | None, sig: int) -> None:
    if pidfd is not None:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(pidfd, sig)


def serve_zygote(path: str) -> int:
    """``warmserve runner zygote``: preload, bind, log ``ready`` and serve; returns the exit code."""
    server = ZygoteServer(path)
    seconds = server.preload()
    server.bind()
    log.info("ready", extra={"socket": str(server.path), "preload_s": round(seconds, 3)})
    return server.serve()
