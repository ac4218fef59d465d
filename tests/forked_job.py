"""A tiny runner for the forkserver tests (tests/test_forkserver.py): nothing to import, so
a forkserver of it is up at once.

    python -m tests.forked_job WORKDIR      (reads WORKDIR/job.json: {"do": ..., ...})

Its first line says who it is: "forked_job: pid P uid U sid S".
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import tempfile
import time


def warm_up() -> None:
    tempfile.gettempdir()     # as transformers' imports do: cached from the server's $TMPDIR


# Longer than the test's own 60 s for the other job to start (tests/test_forkserver.py,
# until()): a peer job that gave up first would end "no peer" while its test still waited.
def wait_for(path: str, timeout_s: float = 120.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def main() -> int:
    workdir = sys.argv[1]
    print(f"forked_job: pid {os.getpid()} uid {os.getuid()} sid {os.getsid(0)}", flush=True)
    with open(os.path.join(workdir, "job.json")) as f:
        job = json.load(f)
    what = job["do"]
    if what == "hello":
        print(f"hello: argv {sys.argv} cwd {os.getcwd()} tmp {tempfile.gettempdir()}"
              f" path0 {sys.path[0]} env {sorted(os.environ)}")
    elif what == "exit":
        return job["code"]
    elif what == "raise":
        raise RuntimeError("the job broke")
    elif what == "crash":
        os.kill(os.getpid(), signal.SIGSEGV)
    elif what == "sleep":
        open(os.path.join(workdir, "running"), "w").close()
        time.sleep(job["seconds"])
    elif what == "sandbox":
        print(f"sandbox: uid {os.getuid()} gid {os.getgid()} groups {os.getgroups()}")
        with open("/proc/self/cgroup") as f:
            print(f"sandbox: cgroup {' ; '.join(f.read().split())}")
        try:
            socket.create_connection(("192.0.2.1", 80), timeout=2).close()
            print("sandbox: CONNECTED")
        except OSError as exc:
            print(f"sandbox: network {exc.strerror or exc}")
    elif what == "peer":
        # Wait for the other job's pid, try to signal it, wait to be told to stop.
        open(os.path.join(workdir, "running"), "w").close()
        if not wait_for(os.path.join(workdir, "peer")):
            print("peer: no peer")
            return 1
        with open(os.path.join(workdir, "peer")) as f:
            pid = int(f.read())
        try:
            os.kill(pid, 0)
            print(f"peer: SIGNALLED {pid}")
        except PermissionError:
            print(f"peer: {pid} PermissionError")
        except OSError as exc:
            print(f"peer: {pid} {exc!r}")
        sys.stdout.flush()
        wait_for(os.path.join(workdir, "stop"))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
