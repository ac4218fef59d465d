"""One training job on several devices of one provider: N processes with torch.distributed
(NCCL on CUDA, gloo on the CPU), data-parallel.

The daemon starts rank 0 as usual; rank 0 starts the other ranks (same runner, same work
dir, told their rank by environment) and is the only one that reports, checkpoints and
writes outputs. Every rank draws the same global batch for a step and trains on its own
rows of it, so N processes compute what one would, and a resumed job (same world size)
sees the same batches. Workers die with rank 0 (PR_SET_PDEATHSIG), so a killed or drained
job leaves no process behind.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from gpumarket.provider.runners.base import JobError

RANK_ENV, PORT_ENV, PARENT_ENV = "GPUMARKET_RANK", "GPUMARKET_MASTER_PORT", "GPUMARKET_RANK0_PID"


def _die_with_parent(parent: int) -> None:
    """Be killed when the rank-0 process ``parent`` dies (and go now if it already has).
    Set by the rank itself after it starts: a preexec_fn would run Python between fork and
    exec in a parent with torch's threads, where it can deadlock (and the job with it)."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


class World:
    def __init__(self, size: int, cuda: bool) -> None:
        self.size = max(1, size)
        self.rank = int(os.environ.get(RANK_ENV, "0"))
        self.cuda = cuda
        self.workers: list[subprocess.Popen] = []
        self._finishing = False

    @property
    def main(self) -> bool:
        return self.rank == 0

    def device(self) -> torch.device:
        if self.cuda:
            torch.cuda.set_device(self.rank)
            return torch.device("cuda", self.rank)
        if self.size > 1:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.size))
        return torch.device("cpu")

    def start(self, workdir: Path, module: str) -> None:
        """Rank 0: open the rendezvous store and start ranks 1..N-1; every rank: join the
        process group. All on loopback: one provider, one host (and a job without network
        still has its loopback)."""
        if self.size == 1:
            return
        os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = "lo"
        timeout = timedelta(minutes=10)
        if self.main:
            store = dist.TCPStore("127.0.0.1", 0, self.size, is_master=True, timeout=timeout,
                                  wait_for_workers=False)
            for rank in range(1, self.size):
                env = {**os.environ, RANK_ENV: str(rank), PORT_ENV: str(store.port),
                       PARENT_ENV: str(os.getpid()), "GPUMARKET_REPORT_FILE": os.devnull}
                self.workers.append(subprocess.Popen(
                    [sys.executable, "-m", module, str(workdir)], env=env,
                    stdout=subprocess.DEVNULL))
            threading.Thread(target=self._watch, daemon=True).start()
        else:
            _die_with_parent(int(os.environ[PARENT_ENV]))
            store = dist.TCPStore("127.0.0.1", int(os.environ[PORT_ENV]), self.size,
                                  is_master=False, timeout=timeout)
        dist.init_process_group("nccl" if self.cuda else "gloo", store=store, rank=self.rank,
                                world_size=self.size, timeout=timeout)
        if self.main:
            print(f"torch.distributed: {self.size} processes"
                  f" ({'nccl' if self.cuda else 'gloo'})", flush=True)

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.size == 1:
            return model
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[self.rank] if self.cuda else None)

    def shard(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the step's global batch."""
        return batch[self.rank::self.size]

    def mean(self, value: torch.Tensor) -> float:
        """The mean of a scalar over every rank (the global batch's loss)."""
        if self.size == 1:
            return float(value)
        total = value.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return float(total) / self.size

    def _watch(self) -> None:
        """Rank 0: a rank that dies would leave the others waiting in a collective until the
        timeout; end the job at once instead, saying which."""
        while not self._finishing:
            for rank, worker in enumerate(self.workers, 1):
                code = worker.poll()
                if code not in (None, 0):
                    print(f"error: training process of rank {rank} exited with code {code}",
                          file=sys.stderr, flush=True)
                    os._exit(1)
            time.sleep(0.5)

    def finish(self) -> None:
        if self.size == 1:
            return
        self._finishing = True
        dist.barrier()
        if not self.main:
            # A worker has nothing left to do: it ends here. Tearing down in-process could
            # deadlock: the last reference to the process group is the model's DDP reducer,
            # freed (GIL held) while gloo's thread still frees the barrier's work and waits
            # for the GIL (seen: ~ProcessGroupGloo joining that thread, the job hung until
            # its timeout).
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        # Rank 0 holds the rendezvous store: it leaves last, once the others are gone.
        for worker in self.workers:
            if worker.wait() != 0:
                raise JobError(f"a training process (pid {worker.pid}) exited with code"
                               f" {worker.returncode}")
        dist.destroy_process_group()
