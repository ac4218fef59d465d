"""Shared test helpers: real broker and provider processes on loopback, the CLI as a user runs it."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.hand_provider import open_session, signed_offer  # noqa: F401 (tests import them from here)

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
EXAMPLES = ROOT / "examples"
# Short leases keep failover tests quick: a silent provider loses its leases after 4 s.
LEASE_ARGS = ("--lease-timeout", "4", "--heartbeat-interval", "0.5")
# Whether the running test is marked e2e (set by tests/conftest.py; None outside pytest).
E2E_TEST: bool | None = None


# Bounds are for a machine many times busier than a quiet one (CI runs 4 workers on 2
# cores; at load 17 here a provider took 25 s to offer its CPU, its forkserver 17 s more to
# be ready): a bound is only reached when the awaited event never comes.
def wait_until(check, what: str, timeout: float = 120.0, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def files_under(root: Path) -> list[tuple[Path, os.stat_result]]:
    """Each plain file under root with its lstat, read while a daemon may still be removing
    some of them (a finished job's directory, collected blobs): what vanishes mid-walk is
    skipped, never raised."""
    found = []
    for parent, _dirs, names in os.walk(root):          # os.walk skips a vanished directory
        for name in names:
            path = Path(parent) / name
            try:
                st = path.lstat()
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):
                found.append((path, st))
    return found


_measured: dict = {}
_measuring = threading.Lock()


def pin_benchmarks(data_dir: Path, extra: tuple[str, ...]) -> None:
    """Leave in a new provider's data dir the figures it would measure for its CPU devices,
    measured once by this process: every provider of a test then offers the same speed, so
    placement follows price as the tests say (measured each, on a loaded machine two
    providers' figures differed by more than their prices: CI placed a job on the dearer
    one), and no provider spends its start measuring. A provider restarted on its data dir
    keeps what it has; ``--cpu-devices N`` is read from ``extra``."""
    from gpumarket.provider import benchmark
    from gpumarket.provider.inventory import cpu_devices

    cache = data_dir / "benchmark.json"
    if cache.exists():
        return
    count = int(extra[extra.index("--cpu-devices") + 1]) if "--cpu-devices" in extra else 1
    with _measuring:
        if "figures" not in _measured:      # one CPU's figures, whatever it is cut into
            _measured["figures"] = benchmark.measure(cpu_devices(1)[0])
        original, figures = benchmark.measure, _measured["figures"]
        benchmark.measure = lambda device: figures
        try:
            benchmark.cached_benchmarks(cpu_devices(count), cache)
        finally:
            benchmark.measure = original
    cache.chmod(0o600)          # as the provider leaves its state: its own


def training_job(path: Path, *, steps: int = 30, checkpoint_every: int = 10,
                 config: Path | None = None, extra: str = "", max_price: float = 2.0,
                 accelerator: str = "any") -> Path:
    """Write a small training job file that uses the example model config and corpus."""
    config = config or EXAMPLES / "data" / "tiny-llama.json"
    path.write_text(f"""
name = "test-{path.stem}"
kind = "training"
max_price = {max_price}
{extra}
[resources]
gpus = 1
accelerator = "{accelerator}"

[training]
model_config = "{config}"
dataset = "{EXAMPLES / 'data' / 'tiny-corpus.jsonl'}"
steps = {steps}
batch_size = 4
seq_len = 32
learning_rate = 3e-3
seed = 7
checkpoint_every = {checkpoint_every}
""")
    return path


_turns = itertools.count()


def one_cpu() -> list[str]:
    """A command prefix (taskset) that gives a provider one of this machine's CPUs, each
    provider the next one in turn; none where there is one CPU or no taskset.

    A provider offers the cores it may run on, and its CPU jobs run that many threads. Tests
    run many providers on few cores (side by side under xdist, beside other work), and a job
    whose OpenMP threads outnumber the cores it gets spin-waits: 30 steps of the tiny Llama
    trained in 65.8 s with 2 threads and in 1.7 s with one on this 2-core machine at load 12.
    Set TESTS_PROVIDER_CPUS=all to start providers on every CPU."""
    cpus = sorted(os.sched_getaffinity(0))
    taskset = shutil.which("taskset")
    if len(cpus) < 2 or not taskset or os.environ.get("TESTS_PROVIDER_CPUS") == "all":
        return []
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    turn = next(_turns) + (int(worker) if worker.isdigit() else 0)
    return [taskset, "--cpu-list", str(cpus[turn % len(cpus)])]


class Process:
    def __init__(self, args: list[str], log: Path, env: dict[str, str]) -> None:
        if E2E_TEST is False:
            raise AssertionError("this test starts a broker or a provider: mark it "
                                 "@pytest.mark.e2e (or its module: pytestmark = "
                                 "pytest.mark.e2e) so that the fast lane leaves it out")
        self.log = log
        self.proc = subprocess.Popen(args, stdout=open(log, "a"), stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> None:
        if self.signal(sig):
            self.wait(timeout)

    def signal(self, sig: int) -> bool:
        """Send ``sig`` to the process's group; whether it was still running."""
        if self.proc.poll() is not None:
            return False
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            return False
        return True

    def wait(self, timeout: float = 20) -> None:
        """Wait for the process to end; SIGKILL its group after ``timeout`` seconds."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()

    def text(self) -> str:
        return self.log.read_text(errors="replace")


class Marketplace:
    """A broker, any number of providers, and a client home, all under one tmp dir."""

    def __init__(self, root: Path, extra_env: dict[str, str] | None = None) -> None:
        self.root = root
        self.extra_env = extra_env or {}    # for every process (GPUMARKET_* included)
        self.home = root / "client-home"
        self.broker: Process | None = None
        self.providers: dict[str, Process] = {}
        self.address = ""
        self.broker_id = ""
        # Providers keep a warm runner (a forkserver that has imported torch) for the kinds
        # that ask for one, as they do by default; a test module that runs none of those
        # kinds sets WARM_PROVIDERS = False (tests/conftest.py): each provider started then
        # saves the ~3 s of CPU its forkserver would spend importing for nothing.
        self.warm = True
        self._asking = threading.Lock()     # ask(): its loop, thread and client, made once
        self._loop = None
        self._clients: dict[tuple[str, str, str], object] = {}

    @property
    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMARKET_")}
        env.update({"GPUMARKET_HOME": str(self.home), "GPUMARKET_BROKER": self.address,
                    "COLUMNS": "200"})
        if self.broker_id:   # everyone pins the broker's key (test_security tries the rest)
            env["GPUMARKET_BROKER_KEY"] = self.broker_id
        env.update(self.extra_env)
        return env

    def start_broker(self, *extra: str, listen: str = "127.0.0.1:0",
                     credit: float = 1000, verify: bool = False) -> str:
        """Start the broker; ``credit``: credits its operator gives the client (as `make demo`
        does: billing is on), 0 for none; ``verify``: spot checks on (they are on by default,
        and off here so that other tests' jobs go where they expect; tests/test_verification
        turns them on)."""
        if not verify:
            extra = (*extra, "--no-verify")
        data = self.root / "broker"
        info = data / "broker.json"
        info.unlink(missing_ok=True)
        self.broker = Process([str(BIN / "gpumarket-broker"), "serve", "--listen",
                               listen, "--data-dir", str(data), *extra],
                              self.root / "broker.log", self.env)
        wait_until(lambda: info.exists() or not self.broker.alive(), "the broker to start")
        assert self.broker.alive(), self.broker.text()
        started = json.loads(info.read_text())
        self.address, self.broker_id = started["address"], started["broker_id"]
        if credit:
            self._credit_client(credit)
        return self.address

    def credit(self, key_id: str, amount: float, *extra: str) -> subprocess.CompletedProcess:
        """Credit ``key_id`` through the operator's door (the broker's own key)."""
        r = subprocess.run([str(BIN / "gpumarket-broker"), "admin", "credit", key_id,
                            str(amount), "--memo", "test funds", "--key",
                            str(self.root / "broker" / "broker.key"), *extra],
                           env=self.env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        return r

    def _credit_client(self, amount: float) -> None:
        """What `credit` does, from this process (no CLI process to start: the market
        fixture does this for nearly every real-process test)."""
        import asyncio

        from gpumarket.link.client import Broker
        from gpumarket.proto.envelope import seal
        from gpumarket.proto.identity import Identity
        from gpumarket.proto.jobspec import now_ms
        from gpumarket.proto.money import parse_credits
        from gpumarket.proto.v1 import admin_pb2 as ad

        operator = Identity.load(self.root / "broker" / "broker.key")
        order = seal(operator, ad.AdminOrder(
            method="Credit", at_ms=now_ms(), target=self.identity().id,
            amount=parse_credits(str(amount)), reason="test funds", nonce=os.urandom(16),
            account="client"))

        async def credit():
            async with Broker(self.address, self.trust()).client(operator, 120) as client:
                await client.admin_call("Credit", order)

        try:
            asyncio.get_running_loop()
        except RuntimeError:
            asyncio.run(credit())
        else:        # called from a coroutine: the CLI, as before
            self.credit(self.identity().id, amount)

    def identity(self):
        """The client's key (the one the CLI uses), made on first use."""
        from gpumarket.proto.identity import Identity

        return Identity.load_or_create(self.home / "client.key")

    def trust(self):
        from gpumarket.link.channel import Trust

        return Trust(pin=self.broker_id)

    async def channel(self, identity=None):
        """A raw gRPC channel to the broker, its calls signed by ``identity`` (default: the
        client's key; False: anonymous)."""
        from gpumarket.link.channel import open_channel

        if identity is None:
            identity = self.identity()
        opened = await open_channel(self.address, identity or None, self.trust())
        return opened.channel

    def start_provider(self, name: str = "p1", price: float = 1.0, *extra: str,
                       cheat: str = "", cheat_rate: float = 1.0) -> Process:
        """Start a provider; ``cheat``: a dishonest one (tests/cheating_provider.py) that
        doctors that share of its uploads: "weights", "text" or "blank"."""
        (self.root / name).mkdir(exist_ok=True)
        program = [str(BIN / "python"), "-m", "tests.cheating_provider"] if cheat \
            else [str(BIN / "gpumarket-provider")]
        env = {**self.env, "CHEAT_MODE": cheat, "CHEAT_RATE": str(cheat_rate),
               "PYTHONPATH": str(ROOT)} if cheat else self.env
        if not self.warm and "--no-warm" not in extra:
            extra = (*extra, "--no-warm")
        pin_benchmarks(self.root / name, extra)
        proc = Process([*one_cpu(), *program, "run", "--broker", self.address,
                        "--data-dir", str(self.root / name), "--price", str(price), *extra],
                       self.root / f"{name}.log", env)
        self.providers[name] = proc
        return proc

    def provider_id(self, name: str) -> str:
        from gpumarket.proto.identity import Identity

        path = self.root / name / "provider.key"
        wait_until(path.exists, f"{name}'s key")
        return Identity.load(path).id

    def ask(self, call):
        """``await call(client)`` on a BrokerClient signed by the client's key, from this
        process: what a CLI command would ask, without starting one (a CLI process costs
        about 0.4 s of CPU, a fresh channel 30 ms; tests poll every 0.1-0.3 s, four of them
        at once on two cores). One channel per broker and key, kept on an event loop of its
        own thread (so a test's running loop is no obstacle), opened again after any error
        (a broker that restarted: gRPC's own reconnect would back off)."""
        import asyncio

        from gpumarket.link.client import Broker

        with self._asking:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=_serve_loop, args=(self._loop,), daemon=True,
                                 name="marketplace-client").start()
        loop = self._loop
        # A client per broker and key: a test may copy this Marketplace for a second client
        # (its __dict__, this dict included), and a broker may come back on another port.
        where = (self.address, self.broker_id, str(self.home))

        async def go():
            client = self._clients.get(where)
            if client is None:
                client = Broker(self.address, self.trust()).client(self.identity(), 60)
                await client.connect()
                self._clients[where] = client
            try:
                return await call(client)
            except BaseException:
                await self._drop_client(where)
                raise

        return asyncio.run_coroutine_threadsafe(go(), loop).result()

    async def _drop_client(self, where=None) -> None:
        for key in [where] if where is not None else list(self._clients):
            client = self._clients.pop(key, None)
            if client is not None:
                await client.close()

    def _stop_asking(self) -> None:
        import asyncio

        loop, self._loop = self._loop, None
        if loop is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self._drop_client(), loop).result(30)
        finally:
            loop.call_soon_threadsafe(loop.stop)

    @property
    def _in_process(self) -> bool:
        """Whether this process names kinds as the CLI would: not where the CLI loads kinds
        of its own ($GPUMARKET_KINDS, tests/test_kinds.py), which this process may not
        have registered (it would print their numbers' names as "unspecified")."""
        return "GPUMARKET_KINDS" not in self.env

    def offers(self) -> list[dict]:
        """What `gpumarket offers --json` prints (signatures checked), asked in-process."""
        if not self._in_process:
            r = self.cli("offers", "--json")
            assert r.returncode == 0, r.stderr
            return json.loads(r.stdout)
        from google.protobuf.json_format import MessageToDict

        from gpumarket.client.offers import offer_row
        from gpumarket.proto.envelope import open_envelope
        from gpumarket.proto.v1 import marketplace_pb2 as mp
        from gpumarket.proto.v1 import types_pb2 as pb

        rows = []
        for listing in self.ask(lambda b: b.search_offers(mp.SearchOffersRequest(limit=1000))):
            offer, signer = open_envelope(listing.offer, pb.Offer)
            if signer == offer.provider_id:
                rows.append({**offer_row(listing, offer),
                             "offer": MessageToDict(offer, preserving_proto_field_name=True)})
        return json.loads(json.dumps(rows))

    def wait_for_offers(self, n: int, timeout: float = 240) -> list[dict]:
        return wait_until(lambda: len(rows := self.offers()) >= n and rows, f"{n} offers",
                          timeout, interval=0.3)

    def cli(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN / "gpumarket"), *args], env=self.env, capture_output=True,
                              text=True, timeout=timeout)

    def job(self, job_id: str) -> dict:
        """What `gpumarket status JOB --json` prints, asked in-process (see ``ask``)."""
        from gpumarket.proto.present import job_dict

        if not self._in_process:
            r = self.cli("status", job_id, "--json")
            assert r.returncode == 0, r.stderr
            return json.loads(r.stdout)

        async def get(b):
            return job_dict(await b.get_job(await b.job_id(job_id)))

        return json.loads(json.dumps(self.ask(get), sort_keys=True))

    def endpoint(self, name: str, events: int = 200) -> dict:
        """What `gpumarket endpoint show NAME --json --events N` prints, asked in-process."""
        from gpumarket.client.endpoints import as_dict

        if not self._in_process:
            r = self.cli("endpoint", "show", name, "--json", "--events", str(events))
            assert r.returncode == 0, r.stderr
            return json.loads(r.stdout)

        async def get(b):
            return as_dict(await b.endpoint(name, events))

        return json.loads(json.dumps(self.ask(get), sort_keys=True))

    def wait_state(self, job_id: str, *states: str, timeout: float = 240) -> dict:
        try:
            return wait_until(lambda: (j := self.job(job_id))["state"] in states and j,
                              f"job {job_id} to reach {states}", timeout, interval=0.3)
        except AssertionError as exc:     # say where it stood: its status and events
            status = self.cli("status", job_id)
            raise AssertionError(f"{exc}\n{status.stdout[-4000:]}{status.stderr[-1000:]}") \
                from None

    def close(self) -> None:
        """Stop every provider (all draining at once, the broker still up to take their
        leases back), then the broker, then any job process still running under this
        marketplace's directory (a provider killed mid-job leaves its jobs running: on a
        shared machine they would slow every test after this one)."""
        self._stop_asking()
        draining = [p for p in self.providers.values() if p.signal(signal.SIGTERM)]
        deadline = time.monotonic() + 20
        for p in draining:
            try:
                p.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        # A drain still waiting after that is an endpoint replica with nowhere to move (every
        # provider drains at once; it would serve on for drain_timeout_s): a second SIGTERM
        # stops a provider at once.
        for p in draining:
            p.signal(signal.SIGTERM)
        for p in draining:
            p.wait(30)
        if self.broker is not None:
            self.broker.stop(timeout=60)
        for pid in job_processes(str(self.root)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _serve_loop(loop) -> None:
    """Run ``loop`` until stopped, then close it (its selector and self-pipe: a worker runs
    hundreds of tests)."""
    try:
        loop.run_forever()
    finally:
        loop.close()


def job_processes(marker: str) -> list[int]:
    """Pids of job processes for ``marker`` (a job's work dir, or a jobs dir): started for it
    (its path is in their command line) or working in it (a forkserver's child)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            cwd = os.readlink(entry / "cwd")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if "gpumarket.provider.runners" not in cmd or state == "Z":
            continue
        if "runners.forkserver" in cmd and cwd != marker and not cwd.startswith(marker + "/"):
            continue  # a forkserver waits in the jobs dir: no job of ours (its children move)
        if marker in cmd or cwd == marker or cwd.startswith(marker + "/"):
            pids.append(int(entry.name))
    return pids


def events(market: Marketplace, job_id: str, quiet_s: float = 1.0) -> list[dict]:
    """The job's events so far (WatchJob): an ended job's all, to the stream's end; a running
    job's until quiet for ``quiet_s`` after its first (a loaded machine is slow to connect
    and answer: a quiet second is no end of an ended job's events)."""
    import asyncio

    import grpc
    from google.protobuf.json_format import MessageToDict

    from gpumarket.proto.v1 import marketplace_pb2 as mp
    from gpumarket.proto.v1 import marketplace_pb2_grpc

    ended = market.job(job_id)["state"] in ("SUCCEEDED", "FAILED", "CANCELLED")

    async def read():
        out = []
        async with await market.channel() as channel:
            stream = marketplace_pb2_grpc.MarketplaceStub(channel).WatchJob(
                mp.WatchJobRequest(job_id=job_id))
            try:
                while True:
                    resp = await asyncio.wait_for(stream.read(),
                                                  120.0 if ended or not out else quiet_s)
                    if resp is grpc.aio.EOF:
                        break
                    out.append(MessageToDict(resp.event, preserving_proto_field_name=True))
            except TimeoutError:
                if ended or not out:
                    raise AssertionError(f"job {job_id}'s events stopped after {len(out)}"
                                         " for 120 s, its stream not ended") from None
            finally:
                stream.cancel()
        return out

    return asyncio.run(read())


def free_port() -> int:
    """A loopback port that is free now, for a server that must come back on the same port.
    Chosen at random below the kernel's ephemeral range: a port that port 0 handed out is
    free again once the test has closed it, and any process binding port 0 or opening a
    connection (tests run side by side under xdist) may take it before the server does."""
    import random
    import socket

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(200 if low > 11_000 else 0):
        port = random.SystemRandom().randrange(10_000, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def first_event(market: Marketplace, job_id: str, match, timeout: float = 300.0,
                after_seq: int = 0) -> dict:
    """The first event of the job (after ``after_seq``) for which ``match(event)`` holds."""
    import asyncio

    from google.protobuf.json_format import MessageToDict

    from gpumarket.proto.v1 import marketplace_pb2 as mp
    from gpumarket.proto.v1 import marketplace_pb2_grpc

    async def read():
        async with await market.channel() as channel:
            stream = marketplace_pb2_grpc.MarketplaceStub(channel).WatchJob(
                mp.WatchJobRequest(job_id=job_id, after_seq=after_seq))
            try:
                async for resp in stream:
                    event = MessageToDict(resp.event, preserving_proto_field_name=True)
                    if match(event):
                        return event
            finally:
                stream.cancel()
        raise AssertionError(f"job {job_id} ended without the awaited event")

    return asyncio.run(asyncio.wait_for(read(), timeout))
