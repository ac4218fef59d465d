"""The daemon's forkservers, one per job kind that asks for one (``kind.warm``): each has
imported its kind's runner once and forks a child per job (provider/runners/forkserver.py has
the protocol). A job whose kind has no live forkserver starts cold, as ``python -m RUNNER``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import signal
import socket
import sys
from pathlib import Path

from gpumarket.provider.executor import ForkedChild, job_env, signal_group

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 120.0    # a forkserver's imports, done before it answers its first order
ANSWER_TIMEOUT_S = 10.0    # an order's answer once it is ready (a fork): longer means hung
MAX_MESSAGE = 1 << 16      # bytes of one message from a forkserver


class ForkServer:
    """One forkserver process and the daemon's end of its socket. Orders go one at a time."""

    def __init__(self, module: str, path: tuple[str, ...], proc: asyncio.subprocess.Process,
                 sock: socket.socket) -> None:
        self.module = module
        self.path = path              # import roots of a plugin's runner
        self.proc = proc
        self.sock = sock
        self.ready = asyncio.Event()   # its imports are done (or it is gone: no more waiting)
        self.served = False            # it got through its imports
        self.gone = False
        self.ended = False             # ended by the daemon: no news
        self.children: dict[int, ForkedChild] = {}
        self._answers: dict[int, tuple[asyncio.Future, Path]] = {}
        self._ids = itertools.count(1)
        self._one_order = asyncio.Lock()
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def start(cls, module: str, path: tuple[str, ...], jobs_dir: Path) -> ForkServer:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setblocking(False)
        env = job_env(jobs_dir, "", None)
        # A torch.cuda.is_available() in some import asks NVML, not the CUDA driver: a
        # driver initialised before the fork would be unusable in every child.
        env["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
        if path:
            env["PYTHONPATH"] = os.pathsep.join(path)
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "gpumarket.provider.runners.forkserver", module,
                str(jobs_dir), cwd=jobs_dir, env=env, stdin=theirs.fileno(),
                stdout=asyncio.subprocess.DEVNULL, start_new_session=True)
        except OSError:
            ours.close()
            raise
        finally:
            theirs.close()
        return cls(module, path, proc, ours)

    async def spawn(self, workdir: Path, env: dict[str, str], sandbox_json: str,
                    log_fd: int) -> ForkedChild | None:
        """Fork a child for the job in ``workdir``; None if this forkserver could not."""
        async with self._one_order:
            if not self.gone and not self.ready.is_set():
                try:
                    await asyncio.wait_for(self.ready.wait(), READY_TIMEOUT_S)
                except TimeoutError:
                    log.warning("forkserver for %s not ready after %.0fs: ended",
                                self.module, READY_TIMEOUT_S)
                    self.kill()
            if self.gone:
                return None
            order_id = next(self._ids)
            answer = asyncio.get_running_loop().create_future()
            self._answers[order_id] = (answer, workdir)
            order = json.dumps({"id": order_id, "workdir": str(workdir), "env": env,
                                "sandbox": sandbox_json}).encode()
            try:
                await self._send(order, log_fd)
                return await asyncio.wait_for(answer, ANSWER_TIMEOUT_S)
            except OSError as exc:
                log.warning("forkserver for %s: order not sent (%s)", self.module, exc)
            except TimeoutError:
                log.warning("forkserver for %s did not answer in %.0fs: ended", self.module,
                            ANSWER_TIMEOUT_S)
                self.kill()
            finally:
                self._answers.pop(order_id, None)
            return None

    async def _send(self, data: bytes, fd: int) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                socket.send_fds(self.sock, [data], [fd])
                return
            except BlockingIOError:
                writable = loop.create_future()
                loop.add_writer(self.sock, _settle, writable)
                try:
                    await writable
                finally:
                    loop.remove_writer(self.sock)

    async def _read(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while data := await loop.sock_recv(self.sock, MAX_MESSAGE):
                self._heard(data)
        except OSError as exc:
            log.warning("forkserver for %s: %s", self.module, exc)
        finally:
            self._lost()

    def _heard(self, data: bytes) -> None:
        try:
            message = json.loads(data)
        except ValueError:
            message = None
        if not isinstance(message, dict):
            log.warning("forkserver for %s sent something unreadable", self.module)
            return
        pid = message.get("pid")
        if message.get("ready") is True:
            self.served = True
            self.ready.set()
            log.info("forkserver for %s ready", self.module)
        elif "exit" in message:
            child = self.children.pop(pid, None) if isinstance(pid, int) else None
            if child is not None and isinstance(message["exit"], int):
                child.exited(message["exit"])
        elif (waiting := self._answers.pop(message.get("id"), None)) is not None:
            answer, workdir = waiting
            if isinstance(pid, int) and pid > 0:
                child = self.children[pid] = ForkedChild(pid, workdir)
            else:
                log.warning("forkserver for %s could not fork: %s", self.module,
                            str(message.get("error"))[:200])
                child = None
            if not answer.done():
                answer.set_result(child)
        elif isinstance(pid, int) and pid > 0:
            # A job forked for a start that was given up (cancelled): nobody follows it.
            log.warning("forkserver for %s: ending job process %d, no longer wanted",
                        self.module, pid)
            signal_group(pid, signal.SIGKILL)

    def _lost(self) -> None:
        """The forkserver ended (or was ended): its children are followed by pid now."""
        if not self.gone and not self.ended:
            log.warning("forkserver for %s ended (exit %s)", self.module, self.proc.returncode)
        self.gone = True
        self.ready.set()
        for answer, _ in self._answers.values():
            if not answer.done():
                answer.set_result(None)
        for child in self.children.values():
            child.orphaned()
        self.children.clear()
        self.sock.close()

    def kill(self) -> None:
        """End the forkserver (its process group), not the jobs it forked (their own)."""
        self.ended = True
        if self.proc.returncode is None:
            signal_group(self.proc.pid, signal.SIGKILL)
        self._reader.cancel()
        self._lost()

    async def close(self) -> None:
        self.kill()
        await asyncio.gather(self._reader, return_exceptions=True)
        await self.proc.wait()


def _settle(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


class ForkServers:
    """A forkserver per runner module, started by ``start`` and restarted when one that
    served has died. Disabled (``--no-warm``), every job starts cold."""

    def __init__(self, jobs_dir: Path, enabled: bool) -> None:
        self.jobs_dir = jobs_dir
        self.enabled = enabled
        self.closing = False        # draining or stopping: nothing (re)started
        self._servers: dict[str, ForkServer] = {}
        self._starting = asyncio.Lock()     # one start at a time: never two for a module

    async def start(self, module: str, path: tuple[str, ...] = ()) -> None:
        """Start a forkserver for ``module`` (importable from ``path``) unless one lives."""
        async with self._starting:
            current = self._servers.get(module)
            if not self.enabled or self.closing or (current is not None and not current.gone):
                return
            self.jobs_dir.mkdir(parents=True, exist_ok=True)
            try:
                self._servers[module] = await ForkServer.start(module, path, self.jobs_dir)
            except OSError as exc:
                log.error("forkserver for %s not started: %s", module, exc)

    async def spawn(self, module: str, workdir: Path, env: dict[str, str], sandbox_json: str,
                    log_fd: int) -> ForkedChild | None:
        """A child of ``module``'s forkserver running the job in ``workdir`` (already made,
        with its log open on ``log_fd``); None if there is no live forkserver for it (the
        caller starts the job cold). A forkserver that died after serving is restarted;
        one that never got through its imports is not."""
        server = self._servers.get(module)
        if server is None:
            return None
        if server.gone:
            if not server.served or self.closing:
                return None
            await self.start(module, server.path)
            server = self._servers[module]
            if server.gone:
                return None
        return await server.spawn(workdir, env, sandbox_json, log_fd)

    async def close(self) -> None:
        """End the forkservers; the jobs they forked live on (the daemon ends those)."""
        self.closing = True
        for server in self._servers.values():
            await server.close()
        self._servers.clear()
