"""Each role installs as docs/deploy.md says: a fresh virtual environment, the package installed
(not editable) from a copy of this tree — ``pip install .`` for a broker or a client, then
torch (this environment's, linked in: see torch_as_installed) and ``pip install '.[provider]'``
over it for a provider, as deploy.md's upgrade does — and each program started: every
command's --help, a broker serving, and a provider from that environment connecting to that
broker and offering its CPU.

One environment serves both tests (module fixtures): a second fresh environment re-installed
every dependency of the base package that the first had just installed (about 11 s of this
module's 49 s of CPU at load 10-15). The broker's environment is looked at before the
provider's extra is added (what it held then is kept), and the tests run in file order; under
xdist, a worker that gets the provider's test alone builds both layers itself.

pip resolves the dependencies from its index: where that index cannot be reached (no
network) the module is skipped, saying so, rather than failing after pip's retries."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.helpers import ROOT, Marketplace, wait_until

pytestmark = pytest.mark.e2e

TORCH = "torch==2.13.0"     # the CPU build these machines hold (see the Makefile)


def run(*args, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run([str(a) for a in args], capture_output=True, text=True,
                       timeout=kw.pop("timeout", 900), **kw)
    assert r.returncode == 0, f"{args}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def index_unreachable() -> str:
    """Why pip's index (PIP_INDEX_URL, else pip's configured global.index-url, else PyPI)
    cannot be reached from here — through HTTPS_PROXY where one is set — or "" where it can:
    a local file index counts as reachable."""
    url = os.environ.get("PIP_INDEX_URL") or subprocess.run(
        [sys.executable, "-m", "pip", "config", "get", "global.index-url"],
        capture_output=True, text=True).stdout.strip() or "https://pypi.org/simple"
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        return ""
    proxy = os.environ.get(f"{parts.scheme}_proxy") or os.environ.get(
        f"{parts.scheme.upper()}_PROXY")
    where = urlsplit(proxy) if proxy else parts
    port = where.port or (443 if where.scheme == "https" else 80)
    try:
        socket.create_connection((where.hostname, port), timeout=10).close()
    except OSError as e:
        return (f"no network: pip's index {url} cannot be reached ({e}), and pip install "
                f"resolves the package's dependencies from it")
    return ""


@pytest.fixture(scope="module")
def index() -> None:
    """Skips the module, with its reason, where pip's index cannot be reached."""
    why = index_unreachable()
    if why:
        pytest.skip(why)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """The tracked files of this tree (pip builds in the tree it installs from)."""
    target = tmp_path_factory.mktemp("src") / "gpumarket"
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    for name in files:
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target / name)
    return target


def venv(where: Path, *install: str) -> Path:
    run(sys.executable, "-m", "venv", where)
    pip = where / "bin" / "pip"
    for spec in install:
        # --no-compile: no .pyc for torch's and transformers' thousands of files (most of
        # the install's CPU time; the programs compile what they import when they run)
        run(pip, "install", "-q", "--no-compile", spec)
    return where / "bin"


# Every command path's --help, in one process of the environment's own Python (a process per
# path cost ~0.4 s of CPU each, 52 of them): the installed package's click group, walked
# through its --help pages as a user would.
WALK = """
import importlib, json, sys
from importlib.metadata import entry_points
from click.testing import CliRunner

name = sys.argv[1]
cli = importlib.import_module(entry_points(group="console_scripts")[name].module).cli
out, todo = [], [[]]
while todo:
    path = todo.pop()
    r = CliRunner().invoke(cli, [*path, "--help"], prog_name=name)
    if r.exit_code != 0:
        sys.exit(f"{name} {' '.join(path)} --help: exit {r.exit_code}: {r.output}{r.exception!r}")
    out.append(path)
    if "Commands:" in r.output:
        for line in r.output.split("Commands:", 1)[1].splitlines():
            if line.startswith("  ") and line.split():
                todo.append(path + [line.split()[0]])
print(json.dumps(out))
"""


def commands(program: Path) -> list[list[str]]:
    """Every command path of a click program, from its --help pages: the program itself
    run once (its entry point), the rest asked in one process of its environment."""
    assert "Commands:" in run(program, "--help").stdout
    r = run(program.parent / "python", "-c", WALK, program.name, cwd=program.parent)
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def environment(index, source, tmp_path_factory) -> dict:
    """A broker's or a client's environment (``pip install .``): its bin directory, the
    names in its site-packages as pip left them, and whether the provider's extra has been
    added to it since (provider_bin)."""
    bin_ = venv(tmp_path_factory.mktemp("env") / "venv", str(source))
    site = next((bin_.parent / "lib").glob("python*/site-packages"))
    return {"bin": bin_, "site": site, "installed": {p.name for p in site.iterdir()},
            "provider": False}


def test_a_broker_and_a_client_install_with_pip_install_dot(environment, tmp_path):
    bin_ = environment["bin"]
    assert not environment["provider"], "the provider's extra was added before this test ran"
    assert "torch" not in environment["installed"], "torch is not needed by a broker or a client"
    assert not (environment["site"] / "torch").exists()
    for program in ("gpumarket-broker", "gpumarket"):
        paths = commands(bin_ / program)
        assert len(paths) > 5, paths
    data = tmp_path / "broker"
    broker = subprocess.Popen([bin_ / "gpumarket-broker", "serve", "--listen", "127.0.0.1:0",
                               "--data-dir", data], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: (data / "broker.json").exists() or broker.poll() is not None,
                   "the broker to start", timeout=60)
        assert broker.poll() is None, broker.stdout.read()
        info = json.loads((data / "broker.json").read_text())
        env = {**os.environ, "GPUMARKET_HOME": str(tmp_path / "home")}
        run(bin_ / "gpumarket", "keys", "init", env=env)
        r = run(bin_ / "gpumarket", "--broker", info["address"], "--broker-key",
                info["broker_id"], "list", env=env)
        assert "job" in r.stdout
    finally:
        broker.terminate()
        broker.wait(30)


def torch_as_installed(bin_: Path) -> None:
    """torch put in a fresh environment as ``pip install torch==2.13.0`` leaves it, from the
    copy this test's own environment installed: each file its RECORD lists, hard-linked (a
    copy across file systems), its console scripts left out. Unpacking the 192 MB wheel was
    most of this module's time (pip reads, checks and writes 14,600 files); torch's own
    install is pip's, and what this test proves is what follows it: ``pip install
    '.[provider]'`` resolving the rest (torch's own requirements included) and the provider
    running from that environment. Falls back to pip where this environment has no such
    torch."""
    import importlib.metadata as md

    try:
        dist = md.distribution("torch")
    except md.PackageNotFoundError:
        dist = None
    if dist is None or dist.version.split("+")[0] != TORCH.split("==")[1] or not dist.files:
        run(bin_ / "pip", "install", "-q", "--no-compile", TORCH)
        return
    here = Path(dist.locate_file(""))
    there = next((bin_.parent / "lib").glob("python*/site-packages"))
    for name in dist.files:
        if name.parts[0] == "..":                    # bin/torchrun: a script of this venv's
            continue
        src, dst = here / name, there / name
        if not src.exists():
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)


@pytest.fixture(scope="module")
def provider_bin(environment, source) -> Path:
    """The module's environment made a provider's: torch, then deploy.md's upgrade,
    ``pip install --upgrade '.[provider]'``, resolving what the extra adds."""
    bin_ = environment["bin"]
    environment["provider"] = True
    torch_as_installed(bin_)
    run(bin_ / "pip", "install", "-q", "--no-compile", "--upgrade", f"{source}[provider]")
    return bin_


def test_a_provider_installs_with_its_extra_and_offers_its_cpu(provider_bin, tmp_path):
    # The broker and the client it talks to run from this environment too: a provider's
    # environment holds every program.
    bin_ = provider_bin
    site = next((bin_.parent / "lib").glob("python*/site-packages"))
    assert not list(site.glob("__editable__*")) and (site / "gpumarket" / "provider").is_dir()
    assert (site / "transformers").is_dir() and (site / "safetensors").is_dir()
    assert len(commands(bin_ / "gpumarket-provider")) > 5
    data = tmp_path / "broker"
    broker = subprocess.Popen([bin_ / "gpumarket-broker", "serve", "--listen",
                               "127.0.0.1:0", "--data-dir", data],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    provider = None
    try:
        wait_until(lambda: (data / "broker.json").exists(), "the broker to start", 60)
        info = json.loads((data / "broker.json").read_text())
        log = tmp_path / "provider.log"
        provider = subprocess.Popen(
            [bin_ / "gpumarket-provider", "run", "--broker", info["address"],
             "--broker-key", info["broker_id"], "--data-dir", tmp_path / "p1", "--no-warm"],
            stdout=open(log, "w"), stderr=subprocess.STDOUT)
        env = {**os.environ, "GPUMARKET_HOME": str(tmp_path / "home")}
        # Polled in-process (a CLI process a second while the provider starts cost ~0.4 s
        # of CPU each), then asked once through the CLI, as a user would.
        market = Marketplace(tmp_path)
        market.address, market.broker_id = info["address"], info["broker_id"]
        began = time.monotonic()
        try:
            wait_until(market.offers, "the provider's offer", timeout=180, interval=0.5)
        finally:
            market.close()
        print(f"provider offered its CPU {time.monotonic() - began:.1f}s after starting")
        r = run(bin_ / "gpumarket", "--broker", info["address"], "--broker-key",
                info["broker_id"], "offers", "--json", env=env, timeout=60)
        offers = json.loads(r.stdout)
        assert offers and offers[0]["accelerator"] == "cpu", offers
        assert "Traceback" not in log.read_text()
    finally:
        if provider is not None:
            provider.terminate()
            provider.wait(60)
        broker.terminate()
        broker.wait(30)
