"""A job that tries to break out of its sandbox; the isolation tests run it as a runner.

    python -m tests.hostile_job WORKDIR      (reads WORKDIR/job.json: {"attack": ..., ...})

Prints one line per attempt, "<attack>: <what happened>", and exits 0 unless noted.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time


def main() -> int:
    workdir = sys.argv[1]
    job = json.load(open(os.path.join(workdir, "job.json")))
    attack = job["attack"]
    if attack == "identity":
        print(f"identity: uid {os.getuid()} gid {os.getgid()} groups {os.getgroups()}")
        print(f"identity: env {sorted(os.environ)}")
    elif attack == "read_key":
        try:
            data = open(job["key"], "rb").read()
            print(f"read_key: READ {len(data)} bytes")
        except OSError as exc:
            print(f"read_key: denied ({exc.strerror})")
        try:
            os.link(job["key"], os.path.join(workdir, "stolen"))
            print("read_key: LINKED")
        except OSError as exc:
            print(f"read_key: link denied ({exc.strerror})")
    elif attack == "network":
        for host, port in job["targets"]:
            try:
                socket.create_connection((host, port), timeout=3).close()
                print(f"network: CONNECTED to {host}:{port}")
            except OSError as exc:
                print(f"network: {host}:{port} {exc.strerror or exc}")
    elif attack == "fork_bomb":
        children = 0
        try:
            while children < 100_000:
                pid = os.fork()
                if pid == 0:
                    time.sleep(30)
                    os._exit(0)
                children += 1
        except OSError as exc:
            print(f"fork_bomb: stopped after {children} processes ({exc.strerror})")
        else:
            print(f"fork_bomb: UNLIMITED ({children} processes)")
    elif attack == "fill_disk":
        block = b"x" * (1 << 20)
        for i in range(100_000):
            with open(os.path.join(workdir, f"fill-{i}"), "wb") as f:
                f.write(block)
            time.sleep(0.01)
        print("fill_disk: UNLIMITED")
    elif attack == "survivor":
        # A detached process that keeps re-forking (a new pid every generation), so one
        # scan of /proc never catches it, and notes every generation in a file.
        if os.fork() == 0:
            os.setsid()
            marker = os.open(job["marker"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            while True:
                try:
                    if os.fork():
                        os._exit(0)
                except OSError:
                    continue
                os.write(marker, b"x")
        print("survivor: detached", flush=True)
        if job.get("stay"):
            time.sleep(120)      # the job runs on until it is cancelled
    elif attack == "fill_scratch":
        for d in job["dirs"]:
            written, why = 0, "UNLIMITED"
            try:
                with open(os.path.join(d, "left-behind"), "wb") as f:
                    for _ in range(job["mib"]):
                        f.write(b"x" * (1 << 20))
                        f.flush()
                        written += 1
            except OSError as exc:
                why = exc.strerror
            print(f"fill_scratch: {d} took {written} MiB ({why})")
    elif attack == "look_scratch":
        for d in job["dirs"]:
            print(f"look_scratch: {d} holds {sorted(os.listdir(d))}")
    elif attack == "memory":
        # Several processes, each under any per-process limit, together over the job's.
        children = []
        for _ in range(job["processes"]):
            pid = os.fork()
            if pid == 0:
                block = bytearray(job["mib_each"] << 20)
                for i in range(0, len(block), 4096):
                    block[i] = 1
                time.sleep(5)
                os._exit(0)
            children.append(pid)
        codes = [os.waitpid(pid, 0)[1] for pid in children]
        print(f"memory: children ended {codes}")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
