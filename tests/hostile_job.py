"""A job that tries to break out of its sandbox; the isolation tests run it as a runner.

    python -m tests.hostile_job WORKDIR      (reads WORKDIR/job.json: {"attack": ..., ...})

Prints one line per attempt, "<attack>: <what happened>", and exits 0 unless noted.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import socket
import sys
import time

# keyctl(2) and add_key(2), by hand: what any job can call (x86_64, aarch64).
SYS_ADD_KEY, SYS_KEYCTL = {"x86_64": (248, 250), "aarch64": (217, 219)}.get(
    platform.machine(), (-1, -1))
KEY_SPEC = {"@s": -3, "@u": -4, "@us": -5}
KEYCTL_GET_KEYRING_ID, KEYCTL_SEARCH, KEYCTL_READ, KEYCTL_GET_PERSISTENT = 0, 10, 11, 22


def _syscall(number: int, *args) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    wire = [ctypes.c_char_p(a) if isinstance(a, bytes) else ctypes.c_long(a) for a in args]
    result = libc.syscall(ctypes.c_long(number), *wire)
    if result < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return result


def _keyrings() -> dict[str, int]:
    """The keyrings a job can name: its session keyring, its uid's user, user session and
    persistent keyrings (by id)."""
    out = {name: _syscall(SYS_KEYCTL, KEYCTL_GET_KEYRING_ID, spec, 1)
           for name, spec in KEY_SPEC.items()}
    out["persistent"] = _syscall(SYS_KEYCTL, KEYCTL_GET_PERSISTENT, -1, KEY_SPEC["@s"])
    return out


def _find_key(keyring: int, description: bytes) -> bytes | None:
    try:
        key = _syscall(SYS_KEYCTL, KEYCTL_SEARCH, keyring, b"user", description, 0)
    except OSError:
        return None
    buf = ctypes.create_string_buffer(4096)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    n = libc.syscall(ctypes.c_long(SYS_KEYCTL), ctypes.c_long(KEYCTL_READ), ctypes.c_long(key),
                     buf, ctypes.c_long(len(buf)))
    return buf.raw[:n] if n >= 0 else b"?"


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
        deadline = time.monotonic() + 30
        while job.get("until_running") and not os.path.exists(job["marker"]):
            if time.monotonic() > deadline:      # it is running once it wrote its marker
                break
            time.sleep(0.01)
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
    elif attack == "keys_plant":
        # Leave a secret in every keyring the job can name, for the next job of its uid.
        for name, keyring in _keyrings().items():
            payload = f"{job['secret']} in {name}".encode()
            _syscall(SYS_ADD_KEY, b"user", job["description"].encode(), payload, len(payload),
                     keyring)
            print(f"keys_plant: planted in {name}")
    elif attack == "keys_look":
        # Look for what an earlier job, or the daemon, left in any keyring this one can name.
        for description in job["descriptions"]:
            for name, keyring in _keyrings().items():
                found = _find_key(keyring, description.encode())
                print(f"keys_look: {description} in {name}: "
                      + (f"FOUND {found.decode(errors='replace')}" if found else "none"))
    elif attack == "look_around":
        # What a job can see of the host: its processes, the provider's data and jobs
        # directories, and another job's work directory by its name.
        pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
        print(f"look_around: /proc shows {len(pids)} processes: {pids[:20]}")
        for pid in job.get("host_pids", []):
            print(f"look_around: host pid {pid} " + ("SEEN" if os.path.exists(f"/proc/{pid}")
                                                     else "not seen"))
        for what, path in job["dirs"].items():
            try:
                print(f"look_around: {what} LISTED {sorted(os.listdir(path))}")
            except OSError as exc:
                print(f"look_around: {what} not listed ({exc.strerror})")
        for path in job["others"]:
            print(f"look_around: other job's {path} " + ("FOUND" if os.path.lexists(path)
                                                         else "not there"))
        # Its control groups: what the directory holding its own shows (the groups beside
        # it are named by their jobs' work directories).
        with open("/proc/self/cgroup") as f:
            for line in f.read().splitlines():
                controllers, path = line.split(":", 2)[1:]
                roots = [f"/sys/fs/cgroup/{c}" for c in controllers.split(",") if c] \
                    or ["/sys/fs/cgroup/unified", "/sys/fs/cgroup"]
                for root in roots:
                    where = os.path.dirname(root + path)
                    if path.strip("/") and os.path.isfile(root + path + "/cgroup.procs"):
                        print(f"look_around: beside its group {os.path.basename(path)}:"
                              f" {sorted(os.listdir(where))}")
                        break
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
