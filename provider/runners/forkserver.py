"""The forkserver of one job kind: it imports the kind's runner (torch, transformers) once,
then forks a child per job, so a job starts in milliseconds instead of paying seconds of
imports — most of the CPU of a small job of a job array.

    python -m gpumarket.provider.runners.forkserver RUNNER_MODULE JOBS_DIR

Its stdin is the daemon's end of a Unix SOCK_SEQPACKET socket, one message each way:

    daemon -> server  {"id": n, "workdir": ..., "env": {...}, "sandbox": "<Sandbox JSON>" or ""}
                      with the job's open log passed alongside (SCM_RIGHTS)
    server -> daemon  {"ready": true}                      once its imports are done
                      {"id": n, "pid": p} | {"id": n, "error": why}   an answer to an order
                      {"pid": p, "exit": code}             a child ended (negative: a signal)

A child leads a process group of its own, takes on the job's work directory, environment
(with the paths its imports kept from the server's own, e.g. Hugging Face's cache, moved to
the job's own: ``IMPORT_TIME_PATHS``) and log, and enters the job's sandbox
(provider/sandbox.py: cgroup, namespaces, limits, the job's uid, keyrings), on its CPU cores
where it has some (GPUMARKET_CPU_CORES), before it runs anything of the job; then it runs ``RUNNER_MODULE.main()`` as if started
as ``python -m RUNNER_MODULE WORKDIR``. Two jobs never share a process: each is its own child.

EOF on the socket (the daemon stopped or died) ends the server but none of its children: a job
outlives its daemon, and a restarted daemon re-attaches to it by pid — the child's command
line is this server's (it names gpumarket.provider.runners and JOBS_DIR) and its working
directory is the job's (executor.pid_runs_in).

Forking is only safe before CUDA is initialised and while no other thread runs (a lock held
by another thread, or an OpenMP pool, does not survive a fork): the server runs no torch op,
starts no thread, and refuses to serve if its imports did either. No torch import here.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import select
import signal
import socket
import sys
import threading
import traceback
import weakref
from typing import NoReturn

from gpumarket.provider import sandbox
from gpumarket.provider.priority import job_cores

MAX_ORDER = 1 << 20        # bytes of one order; a longer one is refused
# Modules that keep paths made from the server's $HOME and cache variables at import (its
# environment is a job's, made for the jobs directory: provider/executor.py job_env): in a
# child, each such path is moved to the same place under the job's own $HOME.
IMPORT_TIME_PATHS = ("huggingface_hub.constants", "transformers.utils.hub",
                     "transformers.utils", "transformers.dynamic_module_utils")
USAGE = "usage: python -m gpumarket.provider.runners.forkserver RUNNER_MODULE JOBS_DIR"


def unsafe_to_fork() -> str:
    """Why forking this process now would hand its children a broken runtime ("" if not)."""
    if threading.active_count() > 1:
        return f"{threading.active_count() - 1} Python threads are running"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "torch initialised CUDA"
    return ""


def cuda_driver_loaded() -> bool:
    """Whether libcuda is mapped: someone called into the CUDA driver (a CUDA build of torch
    loads it only on first use), after which a forked child cannot use the GPU."""
    try:
        with open("/proc/self/maps") as maps:
            return any("libcuda.so" in line for line in maps)
    except OSError:
        return False


class Server:
    def __init__(self, sock: socket.socket, module, jobs_dir: str) -> None:
        self.sock = sock
        self.module = module
        self.jobs_dir = os.path.abspath(jobs_dir)
        self.cwd = os.getcwd()       # sys.path[0] of ``python -m``: a cold job has its own
        self.home = os.environ.get("HOME", "")
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        # What the server changes and a child puts back: a child ignoring SIGUSR1 would miss
        # the daemon's drain request (the runner's own handler, set at import, is restored).
        self.saved = {s: signal.getsignal(s) for s in (signal.SIGCHLD, signal.SIGUSR1)}

    def send(self, message: dict) -> None:
        self.sock.send(json.dumps(message).encode())

    def serve(self) -> int:
        """Answer orders until EOF; return the exit code."""
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)
        signal.set_wakeup_fd(self.wake_w)      # a child's end wakes the select below
        try:
            self.send({"ready": True})
            while True:
                readable, _, _ = select.select([self.sock, self.wake_r], [], [])
                if self.wake_r in readable:
                    self.drain_wakeups()
                    self.reap()
                if self.sock in readable:
                    msg, fds, flags, _ = socket.recv_fds(self.sock, MAX_ORDER, 1)
                    if not msg and not fds:
                        return 0          # the daemon is gone; its jobs live on
                    self.take(msg, fds, flags)
        except (BrokenPipeError, ConnectionResetError):
            return 0

    def drain_wakeups(self) -> None:
        try:
            while os.read(self.wake_r, 512):
                pass
        except BlockingIOError:
            pass

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.send({"pid": pid, "exit": os.waitstatus_to_exitcode(status)})

    def take(self, msg: bytes, fds: list[int], flags: int) -> None:
        order, why = self.check(msg, fds, flags)
        if why:
            for fd in fds:
                os.close(fd)
            self.send({"id": order.get("id"), "error": why})
            return
        log_fd = fds[0]
        sync_r, sync_w = os.pipe()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()        # or the child would write the server's buffer to its log
        try:
            pid = os.fork()
        except OSError as exc:
            for fd in (log_fd, sync_r, sync_w):
                os.close(fd)
            self.send({"id": order["id"], "error": f"fork failed ({exc.strerror})"})
            return
        if pid == 0:
            self.child(order, log_fd, sync_w)
        os.close(sync_w)
        os.close(log_fd)
        os.read(sync_r, 1)     # the child leads its process group: a signal to it reaches it
        os.close(sync_r)
        self.send({"id": order["id"], "pid": pid})

    def check(self, msg: bytes, fds: list[int], flags: int) -> tuple[dict, str]:
        """The order in ``msg`` and "", or what is wrong with it."""
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            return {}, f"an order is at most {MAX_ORDER} bytes and one descriptor"
        try:
            order = json.loads(msg)
        except ValueError:
            return {}, "an order is a JSON object"
        if not isinstance(order, dict):
            return {}, "an order is a JSON object"
        ref = {"id": order["id"]} if isinstance(order.get("id"), int) else {}
        workdir, env = order.get("workdir"), order.get("env")
        if not ref:
            return ref, "an order needs an integer id"
        if (not isinstance(workdir, str) or not os.path.isabs(workdir)
                or os.path.dirname(os.path.normpath(workdir)) != self.jobs_dir):
            return ref, "workdir is not a directory in the jobs directory"
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                for k, v in env.items()):
            return ref, "env maps names to strings"
        if not isinstance(order.get("sandbox", ""), str):
            return ref, "sandbox is a string"
        if len(fds) != 1:
            return ref, "an order comes with the job's log, and nothing else"
        if why := unsafe_to_fork():
            return ref, f"cannot fork: {why}"
        return order, ""

    def child(self, order: dict, log_fd: int, sync_w: int) -> NoReturn:
        code = 1
        try:
            os.setsid()
            if cores := job_cores(order["env"]):
                # On its cores before anything of it runs (its sandbox's processes too),
                # never on a neighbouring slice's (provider/priority.py).
                try:
                    os.sched_setaffinity(0, cores)
                except OSError:
                    pass            # the runner's apply_share says why, in the job's log
            signal.set_wakeup_fd(-1)
            for signum, handler in self.saved.items():
                signal.signal(signum, handler)
            os.write(sync_w, b".")
            os.close(sync_w)
            self.sock.close()
            os.close(self.wake_r)
            os.close(self.wake_w)
            code = self.run_job(order, log_fd)
        except BaseException:  # noqa: BLE001 (a child never returns into the server's loop)
            traceback.print_exc()
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
            os._exit(code)

    def run_job(self, order: dict, log_fd: int) -> int:
        """Become the job's process, enter its sandbox, run the runner; its exit code."""
        # The finalizers the server's imports registered (torch's operator libraries: 134
        # of them, 40 ms of its exit here, 0.1-0.25 s on a loaded machine, every lease)
        # are the server's: at the job's exit only its own run.
        for finalizer in list(weakref.finalize._registry):
            finalizer.atexit = False
        workdir = order["workdir"]
        os.chdir(workdir)
        os.environ.clear()
        os.environ.update(order["env"])
        move_home(self.home, os.environ.get("HOME", ""))
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        close_other_fds()
        if order.get("sandbox") and not sandbox.enter(order["sandbox"]):
            return 1
        # What the imports took from the server's environment, the job's own now.
        if "tempfile" in sys.modules:
            sys.modules["tempfile"].tempdir = None
        if sys.path and sys.path[0] == self.cwd:
            sys.path[0] = workdir
        importlib.invalidate_caches()
        if (np := sys.modules.get("numpy")) is not None:
            np.random.seed()     # not every job the server's random state (random reseeds)
        threads = os.environ.get("OMP_NUM_THREADS", "")
        if (torch := sys.modules.get("torch")) is not None and threads.isdigit():
            torch.set_num_threads(max(1, int(threads)))   # OpenMP read the server's at load
        sys.argv = [self.module.__file__, workdir]
        try:
            code = self.module.main()
        except SystemExit as exc:
            code = exc.code
        except BaseException:  # noqa: BLE001 (what the interpreter does with it: a traceback)
            traceback.print_exc()
            code = 1
        if code is None:
            code = 0
        elif not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
        # What interpreter exit does for the job (its threads, its atexit handlers), less
        # finalising the objects it inherited from the server.
        threading._shutdown()
        atexit._run_exitfuncs()
        return code & 0xFF


def move_home(old: str, new: str) -> None:
    """Point the paths under ``old`` that the modules of IMPORT_TIME_PATHS took at import
    to the same places under ``new`` (only those modules' own globals are read: reading
    every module's would copy much of the server's memory into each child)."""
    if not old or not new or old == new:
        return
    prefix = old.rstrip("/") + "/"
    for name in IMPORT_TIME_PATHS:
        module = sys.modules.get(name)
        if module is None:
            continue
        for key, value in list(vars(module).items()):
            if isinstance(value, str) and (value == old or value.startswith(prefix)):
                setattr(module, key, new.rstrip("/") + value[len(old.rstrip("/")):])


def close_other_fds() -> None:
    """Close every descriptor above stderr: nothing of the server reaches the job."""
    for name in os.listdir("/proc/self/fd"):
        if int(name) > 2:
            try:
                os.close(int(name))
            except OSError:
                pass      # the listing's own descriptor, closed already


def main() -> int:
    if len(sys.argv) != 3:
        print(USAGE, file=sys.stderr)
        return 2
    module = importlib.import_module(sys.argv[1])
    if hasattr(module, "warm_up"):
        module.warm_up()
    why = unsafe_to_fork() or ("the CUDA driver is loaded" if cuda_driver_loaded() else "")
    if why:
        print(f"forkserver for {sys.argv[1]}: cannot fork after its imports: {why}",
              file=sys.stderr)
        return 3
    sock = socket.socket(fileno=os.dup(0))
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    gc.freeze()     # the imported modules' objects stay shared with every child (no GC writes)
    return Server(sock, module, sys.argv[2]).serve()


if __name__ == "__main__":
    sys.exit(main())
