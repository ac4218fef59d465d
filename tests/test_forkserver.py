"""The forkserver a job kind's jobs are forked from (provider/runners/forkserver.py) and the
daemon's side of it (provider/forkservers.py): its protocol spoken by hand, jobs forked
through the executor into their sandboxes, and the isolation attacks of
tests/test_isolation.py run again with every job forked instead of started cold."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpumarket.provider.executor import ForkedChild, JobProcess, job_env, pid_runs_in
from gpumarket.provider.forkservers import ForkServers
from tests import isolation_kit, test_isolation
# base, groups and reaper are tests/isolation_kit.py's fixtures: a jobs dir job uids can reach, a
# control-group directory, and the end of whatever a job of these uids left behind.
from tests.isolation_kit import (  # noqa: F401
    FEATURES, JOB_UID, base, box, groups, needs_root, reaper,
)

ROOT = Path(__file__).resolve().parent.parent
RUNNER = "tests.forked_job"


def write_job(workdir: Path, **job) -> Path:
    (workdir / "tmp").mkdir(parents=True, exist_ok=True)
    (workdir.parent / "tmp").mkdir(exist_ok=True)     # the forkserver's own $TMPDIR
    (workdir / "job.json").write_text(json.dumps(job))
    return workdir


def publish(path: Path, text: str) -> None:
    """Write ``path`` whole at once (a job that waits for it to appear reads it at once: a
    file written in place can be seen created but still empty)."""
    part = path.with_name(path.name + ".part")
    part.write_text(text)
    part.rename(path)


def open_log(workdir: Path) -> int:
    return os.open(workdir / "job.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC,
                   0o644)


def env_of(workdir: Path) -> dict[str, str]:
    return {**job_env(workdir, "", None), "PYTHONPATH": str(ROOT)}


def wait_file(path: Path, timeout_s: float = 120.0) -> None:     # a fork's start, loaded
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


# -- the forkserver's protocol, spoken by hand ---------------------------------------------

class RawServer:
    """A forkserver started as the daemon starts one, with the test as its daemon."""

    def __init__(self, jobs: Path, module: str = RUNNER) -> None:
        self.jobs = jobs
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpumarket.provider.runners.forkserver", module, str(jobs)],
            stdin=theirs, stdout=subprocess.DEVNULL, cwd=jobs, env=env_of(jobs),
            start_new_session=True)
        theirs.close()
        self.sock = ours
        self.sock.settimeout(60)
        self.ids = 0
        assert self.next() == {"ready": True}

    def next(self) -> dict:
        return json.loads(self.sock.recv(1 << 16))

    def send(self, data: bytes, fds: list[int]) -> None:
        socket.send_fds(self.sock, [data], fds)

    def order(self, workdir: Path, sandbox: str = "") -> dict:
        """Order a job in ``workdir``; the forkserver's answer."""
        self.ids += 1
        log = open_log(workdir)
        try:
            self.send(json.dumps({"id": self.ids, "workdir": str(workdir),
                                  "env": env_of(workdir), "sandbox": sandbox}).encode(), [log])
        finally:
            os.close(log)
        return self.next()

    def close(self) -> None:
        self.sock.close()
        try:
            self.proc.wait(10)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


@pytest.fixture
def raw(tmp_path):
    (tmp_path / "jobs").mkdir()
    server = RawServer(tmp_path / "jobs")
    yield server
    server.close()


def test_a_crashed_or_killed_child_is_reported_and_the_forkserver_serves_on(raw):
    jobs = raw.jobs
    sleeper = raw.order(write_job(jobs / "sleep.1", do="sleep", seconds=60))
    assert sleeper["id"] == 1 and sleeper["pid"] not in (raw.proc.pid, os.getpid())
    wait_file(jobs / "sleep.1" / "running")
    os.kill(sleeper["pid"], signal.SIGKILL)
    assert raw.next() == {"pid": sleeper["pid"], "exit": -signal.SIGKILL}

    for name, job, code in [("raise.1", {"do": "raise"}, 1),
                            ("crash.1", {"do": "crash"}, -signal.SIGSEGV),
                            ("exit.1", {"do": "exit", "code": 7}, 7),
                            ("hello.1", {"do": "hello"}, 0)]:
        answer = raw.order(write_job(jobs / name, **job))
        assert raw.next() == {"pid": answer["pid"], "exit": code}, name
    assert "RuntimeError: the job broke" in (jobs / "raise.1" / "job.log").read_text()
    hello = (jobs / "hello.1" / "job.log").read_text()
    # The job's own argv, work dir, temp dir, import path and environment, not the server's.
    workdir = str(jobs / "hello.1")
    assert f"argv ['{ROOT / 'tests' / 'forked_job.py'}', '{workdir}']" in hello, hello
    assert f"cwd {workdir} tmp {workdir}/tmp path0 {workdir} " in hello, hello
    assert "GPUMARKET_REPORT_FILE" in hello
    assert raw.proc.poll() is None


def test_eof_ends_the_forkserver_but_not_its_running_child(raw):
    workdir = write_job(raw.jobs / "sleep.1", do="sleep", seconds=60)
    pid = raw.order(workdir)["pid"]
    try:
        wait_file(workdir / "running")
        raw.sock.close()            # the daemon died
        assert raw.proc.wait(60) == 0
        assert pid_runs_in(pid, workdir), "the job died with its forkserver"
        # What a restarted daemon sees: a job process of its jobs dir, working in the job's.
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        assert b"gpumarket.provider.runners.forkserver" in cmdline
        assert str(raw.jobs).encode() in cmdline
        assert os.getsid(pid) == pid and os.getpgid(pid) == pid
    finally:
        os.killpg(pid, signal.SIGKILL)


def test_a_bad_order_is_refused_and_the_forkserver_serves_on(raw):
    workdir = write_job(raw.jobs / "hello.1", do="hello")
    log = open_log(workdir)
    good = {"id": 5, "workdir": str(workdir), "env": {}, "sandbox": ""}
    try:
        for data, fds, why in [
                (b"not json", [log], "JSON object"),
                (b"[1]", [log], "JSON object"),
                (json.dumps({**good, "id": "x"}).encode(), [log], "integer id"),
                (json.dumps({**good, "workdir": "/etc"}).encode(), [log], "jobs directory"),
                (json.dumps({**good, "workdir": str(raw.jobs / ".." / "x")}).encode(), [log],
                 "jobs directory"),
                (json.dumps({**good, "env": {"A": 1}}).encode(), [log], "strings"),
                (json.dumps(good).encode(), [], "the job's log"),
                (json.dumps(good).encode(), [log, log], "at most")]:
            raw.send(data, fds)
            answer = raw.next()
            assert why in answer["error"] and "pid" not in answer, (data, answer)
        try:                         # more than the kernel's default allows to be sent
            raw.sock.setsockopt(socket.SOL_SOCKET, getattr(socket, "SO_SNDBUFFORCE", 32), 4 << 20)
            raw.send(json.dumps({**good, "pad": "x" * (1 << 20)}).encode(), [log])
        except OSError:
            pass                     # not root: too large for the socket anyway
        else:
            assert "at most" in raw.next()["error"]
    finally:
        os.close(log)
    answer = raw.order(workdir)
    assert raw.next() == {"pid": answer["pid"], "exit": 0}


def test_a_forkserver_whose_imports_started_a_thread_refuses_to_serve(tmp_path):
    """Forking after a thread started (an OpenMP pool, CUDA) breaks the children: such a
    forkserver exits at once and its kind's jobs start cold."""
    mod = tmp_path / "threaded_runner.py"
    mod.write_text("import threading, time\n"
                   "def warm_up():\n"
                   "    threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
                   "def main():\n    return 0\n")
    r = subprocess.run([sys.executable, "-m", "gpumarket.provider.runners.forkserver",
                        "threaded_runner", str(tmp_path)], stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=60, check=False,
                       env={**env_of(tmp_path), "PYTHONPATH": f"{ROOT}:{tmp_path}"})
    assert r.returncode == 3 and "1 Python threads are running" in r.stderr, r.stderr


# -- the daemon's side: ForkServers ------------------------------------------------------

def test_twenty_forked_children_start_fast(tmp_path):
    jobs = tmp_path / "jobs"

    async def go():
        forks = ForkServers(jobs, True)
        await forks.start(RUNNER, (str(ROOT),))
        first = await forks.spawn(RUNNER, write_job(jobs / "first.1", do="hello"),
                                  env_of(jobs / "first.1"), "", open_log(jobs / "first.1"))
        assert await first.wait() == 0              # imports done: timing from here
        started = time.perf_counter()
        children = []
        for i in range(20):
            workdir = write_job(jobs / f"j.{i}", do="hello")
            log = open_log(workdir)
            try:
                children.append(await forks.spawn(RUNNER, workdir, env_of(workdir), "", log))
            finally:
                os.close(log)
        forked = time.perf_counter() - started
        codes = [await c.wait() for c in children]
        ended = time.perf_counter() - started
        await forks.close()
        return children, codes, forked, ended

    children, codes, forked, ended = asyncio.run(go())
    print(f"\n20 forked jobs: {forked * 1000:.1f} ms to fork, {ended * 1000:.1f} ms until all"
          f" ended ({forked / 20 * 1000:.2f} ms per fork)")
    assert codes == [0] * 20
    assert len({c.pid for c in children}) == 20
    for i in range(20):
        assert "hello: argv" in (jobs / f"j.{i}" / "job.log").read_text()


def test_a_forked_job_keeps_its_caches_in_its_own_directory(tmp_path):
    """What the forkserver's imports made of its own environment (Hugging Face's cache
    paths, taken at import) is the job's own in a forked job, as in a cold one."""
    (tmp_path / "hf_runner.py").write_text(
        "import os\n"
        "def warm_up():\n"
        "    import huggingface_hub.constants\n"
        "def main():\n"
        "    import huggingface_hub.constants as c\n"
        "    print('paths', c.HF_HOME, c.HF_HUB_CACHE, os.environ['HF_HOME'], flush=True)\n"
        "    return 0\n")
    jobs = tmp_path / "jobs"

    async def go():
        forks = ForkServers(jobs, True)
        await forks.start("hf_runner", (str(ROOT), str(tmp_path)))
        workdir = write_job(jobs / "j.1")
        child = await forks.spawn("hf_runner", workdir, env_of(workdir), "", open_log(workdir))
        assert isinstance(child, ForkedChild) and await child.wait() == 0
        await forks.close()
        return workdir

    workdir = asyncio.run(go())
    line = next(x for x in (workdir / "job.log").read_text().splitlines()
                if x.startswith("paths "))
    hf_home, hub_cache, env_home = line.split()[1:]
    assert hf_home == env_home == f"{workdir}/.cache/huggingface", line
    assert hub_cache == f"{workdir}/.cache/huggingface/hub", line


def test_a_forked_job_s_exit_runs_its_own_finalizers_not_the_forkserver_s(tmp_path):
    """What the forkserver's imports left to finalize at exit (torch's operator libraries:
    a tenth of a second of every lease's end) is the server's: a forked job's exit runs only
    the finalizers it registered itself."""
    (tmp_path / "final_runner.py").write_text(
        "import os, weakref\n"
        "class Held: pass\n"
        "def mark(who):\n"
        "    with open(os.path.join(os.environ['HOME'], 'finalized'), 'a') as f:\n"
        "        f.write(who + '\\n')\n"
        "def warm_up():\n"
        "    global server\n"
        "    server = Held(); weakref.finalize(server, mark, 'server')\n"
        "def main():\n"
        "    global job\n"
        "    job = Held(); weakref.finalize(job, mark, 'job')\n"
        "    return 0\n")
    jobs = tmp_path / "jobs"

    async def go():
        forks = ForkServers(jobs, True)
        await forks.start("final_runner", (str(ROOT), str(tmp_path)))
        workdir = write_job(jobs / "j.1")
        child = await forks.spawn("final_runner", workdir, env_of(workdir), "",
                                  open_log(workdir))
        assert isinstance(child, ForkedChild) and await child.wait() == 0
        await forks.close()
        return workdir

    workdir = asyncio.run(go())
    assert (Path(env_of(workdir)["HOME"]) / "finalized").read_text() == "job\n"


def test_without_forkservers_or_with_a_dead_one_a_job_starts_cold_or_on_a_new_one(tmp_path):
    jobs = tmp_path / "jobs"

    async def go():
        off = ForkServers(jobs, False)          # --no-warm
        await off.start(RUNNER, (str(ROOT),))
        workdir = write_job(jobs / "a.1", do="hello")
        assert await off.spawn(RUNNER, workdir, env_of(workdir), "", open_log(workdir)) is None
        forks = ForkServers(jobs, True)
        assert await forks.spawn("tests.no_forkserver", workdir, env_of(workdir), "",
                                 open_log(workdir)) is None
        await forks.start(RUNNER, (str(ROOT),))
        server = forks._servers[RUNNER]
        child = await forks.spawn(RUNNER, workdir, env_of(workdir), "", open_log(workdir))
        assert await child.wait() == 0
        # The forkserver dies while a job of it runs: the job is followed by pid, and the
        # next job gets a new forkserver.
        sleeper = write_job(jobs / "b.1", do="sleep", seconds=1)
        child = await forks.spawn(RUNNER, sleeper, env_of(sleeper), "", open_log(sleeper))
        os.killpg(server.proc.pid, signal.SIGKILL)
        while not server.gone:
            await asyncio.sleep(0.05)
        assert child.running()
        assert await asyncio.wait_for(child.wait(), 30) is None   # its exit went with it
        assert not child.running()
        again = await forks.spawn(RUNNER, workdir, env_of(workdir), "", open_log(workdir))
        assert again is not None and forks._servers[RUNNER] is not server
        assert await again.wait() == 0
        await forks.close()
        assert server.proc.returncode is not None

    asyncio.run(go())


def run_forked(workdir: Path, box_, forks: ForkServers):
    async def ignore(report):
        pass

    return JobProcess(RUNNER, workdir, env_of(workdir), ignore, 120, 2.0, forks, box_)


async def until(seen, runs, dirs, forks, timeout_s: float = 60.0) -> None:
    """Wait for ``seen()`` while both jobs run; fail with what each job and the forkserver
    came to if one ends first or it takes ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not seen():
        if any(r.done() for r in runs) or time.monotonic() > deadline:
            server = forks._servers[RUNNER]
            pytest.fail(f"forkserver gone {server.gone} exit {server.proc.returncode}; jobs "
                        f"{[r.result() if r.done() else 'running' for r in runs]}; logs "
                        f"{[(d / 'job.log').read_text()[-500:] for d in dirs]}")
        await asyncio.sleep(0.02)


@needs_root
def test_two_clients_jobs_never_share_a_process(base):  # noqa: F811
    """Two jobs at once, each in its own sandbox with its own uid: two processes, neither the
    forkserver, each of its own uid, and neither can signal the other."""
    jobs = base / "jobs"
    uids = (JOB_UID, JOB_UID + 1)
    dirs = [write_job(jobs / f"client{i}.1", do="peer") for i in (0, 1)]

    async def go():
        forks = ForkServers(jobs, True)
        await forks.start(RUNNER, (str(ROOT),))
        procs = [run_forked(d, box(uid=u, gid=u), forks) for d, u in zip(dirs, uids)]
        pids = [await p.start() for p in procs]
        runs = [asyncio.create_task(p.run()) for p in procs]
        server_pid = forks._servers[RUNNER].proc.pid
        for d in dirs:
            await until(lambda: (d / "running").exists(), runs, dirs, forks)
        status = [Path(f"/proc/{pid}/status").read_text() for pid in pids]
        for d, other in zip(dirs, reversed(pids)):
            publish(d / "peer", str(other))
        for d in dirs:
            await until(lambda: "peer:" in (d / "job.log").read_text(), runs, dirs, forks)
            (d / "stop").touch()
        outcomes = await asyncio.gather(*runs)
        await forks.close()
        return pids, server_pid, status, outcomes, procs

    pids, server_pid, status, outcomes, procs = asyncio.run(go())
    assert all(isinstance(p.proc, ForkedChild) for p in procs), "a job started cold"
    assert len(set(pids)) == 2 and server_pid not in pids and os.getpid() not in pids
    for text, uid in zip(status, uids):
        line = next(x for x in text.splitlines() if x.startswith("Uid:"))
        assert line.split()[1:] == [str(uid)] * 4, line
    for d, other, uid in zip(dirs, reversed(pids), uids):
        log = (d / "job.log").read_text()
        # In a PID namespace of its own, the other job's pid is not there to signal.
        seen = "ProcessLookupError" if FEATURES["pid_namespace"]["available"] \
            else "PermissionError"
        assert f"uid {uid} " in log and f"peer: {other} {seen}" in log, log
        assert "SIGNALLED" not in log
    assert [o.exit_code for o in outcomes] == [0, 0]


@needs_root
def test_a_forked_child_is_in_its_sandbox_before_the_job_runs(base, groups):  # noqa: F811
    jobs = base / "jobs"
    workdir = write_job(jobs / "j.1", do="sandbox")
    group = None
    if FEATURES["job_cgroup"]["available"]:
        group = groups.job("forked")
        from gpumarket.provider import cgroups
        group.limit(cgroups.Limits(memory_bytes=512 << 20, pids=64))
    box_ = box(cgroups=tuple(group.procs_files) if group is not None else ())

    async def go():
        forks = ForkServers(jobs, True)
        await forks.start(RUNNER, (str(ROOT),))
        proc = run_forked(workdir, box_, forks)
        outcome = await proc.run()
        await forks.close()
        return proc, outcome

    proc, outcome = asyncio.run(go())
    assert isinstance(proc.proc, ForkedChild) and outcome.exit_code == 0, outcome
    lines = (workdir / "job.log").read_text().splitlines()
    # The sandbox's own line comes first: it was entered before the runner ran at all.
    assert lines[0].startswith(f"sandbox: uid {JOB_UID}, "), lines
    assert lines[1].startswith("forked_job: ") and f" uid {JOB_UID} " in lines[1], lines
    assert f"sandbox: uid {JOB_UID} gid {JOB_UID} groups []" in lines
    if FEATURES["no_network"]["available"]:
        assert "sandbox: network Network is unreachable" in lines, lines
    if group is not None:
        cgroup = next(x for x in lines if x.startswith("sandbox: cgroup "))
        for procs in group.procs_files:
            where = Path(procs).parent
            assert f"{where.parent.name}/{where.name} " in cgroup + " ", (cgroup, procs)


def test_an_attempt_of_a_kind_with_a_forkserver_is_forked(tmp_path):
    """The daemon's path: an attempt (tests/test_provider_parts.py's, its host a fake
    daemon with real forkservers) forks its job and signs its receipt."""
    import hashlib

    from gpumarket import kinds
    from gpumarket.proto.envelope import open_envelope
    from gpumarket.proto.v1 import types_pb2 as pb
    from gpumarket.provider.attempt import Attempt
    from tests.kind_checksum import digest
    from tests.test_provider_parts import FakeHost, checksum_assignment

    if not any(k.name == "checksum" for k in kinds.all_kinds()):
        kinds.load_plugins("tests.kind_checksum")
    kind = kinds.get("checksum")
    data = os.urandom(1000)
    host = FakeHost(tmp_path, {hashlib.sha256(data).hexdigest(): data})
    job = Attempt(checksum_assignment(data, rounds=2), host.config.jobs_dir / "j.1", host)
    job.workdir.mkdir(parents=True)

    async def go():
        host.forks = ForkServers(host.config.jobs_dir, True)
        await host.forks.start(kind.runner, kind.runner_path)
        await job.run()
        await host.forks.close()

    asyncio.run(go())
    assert isinstance(job.process.proc, ForkedChild), "the job started cold"
    assert host.pid == job.process.proc.pid
    assert host.final.job_update.WhichOneof("update") == "receipt", host.final
    receipt, _ = open_envelope(host.final.job_update.receipt, pb.Receipt)
    assert digest(data, "sha256", 2) in host.blobs[receipt.outputs[0].sha256].decode()


# -- the isolation attacks, every job forked -----------------------------------------------

class ForkedJobProcess(JobProcess):
    """A JobProcess that forks its job from a forkserver of its own (as the daemon does for
    a kind with one) and fails if it did not."""

    async def start(self) -> int:
        self.forks = self._servers = ForkServers(self.workdir.parent, True)
        await self._servers.start(self.module, (str(ROOT),))
        pid = await super().start()
        assert isinstance(self.proc, ForkedChild), "the job started cold"
        return pid

    async def run(self):
        try:
            return await super().run()
        finally:
            await self._servers.close()


@pytest.fixture
def forked(monkeypatch):
    monkeypatch.setattr(isolation_kit, "JobProcess", ForkedJobProcess)     # run_hostile's
    monkeypatch.setattr(test_isolation, "JobProcess", ForkedJobProcess)


ATTACKS = ["test_a_job_runs_as_its_own_uid_with_a_clean_environment",
           "test_a_job_cannot_read_or_link_the_daemons_key",
           "test_a_job_cannot_open_a_connection",
           "test_a_fork_bomb_stops_at_the_process_limit",
           "test_a_job_that_fills_its_disk_is_stopped",
           "test_a_reforking_survivor_dies_with_its_job_group",
           "test_a_reforking_survivor_dies_with_its_uid_without_a_group",
           "test_a_reforking_survivor_dies_with_its_pid_namespace",
           "test_scratch_directories_are_private_bounded_and_gone_after_the_job",
           "test_memory_is_limited_per_job_not_per_process",
           "test_a_cancelled_job_leaves_no_process_behind"]


@pytest.mark.parametrize("attack", ATTACKS)
def test_an_isolation_attack_from_a_forked_job(attack, forked, request):
    """tests/test_isolation.py's attack, its job forked (skipped where that test is)."""
    test = getattr(test_isolation, attack)
    for mark in getattr(test, "pytestmark", []):
        if mark.name == "skipif" and mark.args[0]:
            pytest.skip(mark.kwargs.get("reason", ""))
    fixtures = {name: request.getfixturevalue(name)
                for name in test.__code__.co_varnames[:test.__code__.co_argcount]}
    test(**fixtures)


@pytest.mark.slow
@needs_root
def test_a_restarted_daemon_keeps_every_process_of_a_job_it_reattaches_to(base):  # noqa: F811
    """In its own PID namespace a forked job is three processes with the forkserver's
    command line (the one the daemon knows, the namespace's init, the job): a restarted
    daemon that re-attaches to it ends none of them as an orphan."""
    from gpumarket.provider.recovery import kill_orphans
    from tests.helpers import job_processes

    jobs = base / "jobs"
    workdir = write_job(jobs / "j.1", do="sleep", seconds=60)

    async def go():
        forks = ForkServers(jobs, True)
        await forks.start(RUNNER, (str(ROOT),))
        proc = run_forked(workdir, box(), forks)
        pid = await proc.start()
        follower = asyncio.create_task(proc.run())
        while not (workdir / "running").exists():
            assert not follower.done(), (workdir / "job.log").read_text()
            await asyncio.sleep(0.02)
        await forks.close()        # as when its daemon died: the job runs on
        mine = job_processes(str(workdir))
        killed = kill_orphans(jobs, {pid})
        alive = proc.alive()
        await proc.stop("the test is over")
        await asyncio.gather(follower, return_exceptions=True)
        return pid, mine, killed, alive

    pid, mine, killed, alive = asyncio.run(go())
    assert pid in mine and (len(mine) == 3 or not FEATURES["pid_namespace"]["available"]), mine
    assert killed == [] and alive
