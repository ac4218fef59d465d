"""Idle warm runners, one per job kind, with their imports done (see runners/warm.py)."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

from gpumarket.provider.executor import job_env, signal_group


class WarmPool:
    def __init__(self, jobs_dir: Path, enabled: bool) -> None:
        self.jobs_dir = jobs_dir
        self.enabled = enabled
        self.closing = False     # draining or stopping: no new idle runners
        self._idle: dict[str, asyncio.subprocess.Process] = {}   # runner module -> process

    async def refill(self, module: str) -> None:
        """Start an idle runner for ``module`` unless one is already waiting."""
        current = self._idle.get(module)
        if not self.enabled or self.closing or (current is not None
                                                 and current.returncode is None):
            return
        self.jobs_dir.mkdir(parents=True, exist_ok=True)
        self._idle[module] = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gpumarket.provider.runners.warm", module, str(self.jobs_dir),
            cwd=self.jobs_dir, env=job_env(self.jobs_dir, "", None),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL, start_new_session=True)

    def take(self, module: str) -> asyncio.subprocess.Process | None:
        """The idle runner for ``module``, if one is alive (the caller refills)."""
        proc = self._idle.pop(module, None)
        return proc if proc is not None and proc.returncode is None else None

    async def close(self) -> None:
        self.closing = True
        for proc in self._idle.values():
            if proc.returncode is None:
                signal_group(proc.pid, signal.SIGKILL)
                await proc.wait()
        self._idle.clear()
