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
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
