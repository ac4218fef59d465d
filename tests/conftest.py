from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest

from tests import helpers
from tests.helpers import LEASE_ARGS, Marketplace

# grpcio logs this when the server stops while it is still finishing a stream whose client
# has just gone: a CancelledError inside grpc's own cython scheduler, not in gpumarket code.
GRPC_SHUTDOWN_NOISE = re.compile(
    r"(Traceback \(most recent call last\):\n"
    r"  File \"src/python/grpcio/grpc/_cython/_cygrpc/aio/server\.pyx\.pxi\", line \d+, "
    r"in grpc\._cython\.cygrpc\._schedule_rpc_coro\n"
    r"asyncio\.exceptions\.CancelledError\n)+")

# Fixtures that start real broker or provider processes: a test that uses one (directly or
# through another fixture) is marked e2e without saying so.
PROCESS_FIXTURES = {"market"}


def own_tracebacks(log: str) -> bool:
    return "Traceback" in GRPC_SHUTDOWN_NOISE.sub("", log)


def pytest_configure(config):
    # torch in the test processes and in what they start directly (an engine, a runner) runs
    # one thread: its default, a thread per core, spin-waits wherever processes outnumber the
    # cores (xdist's workers, the providers beside them) and makes small ops many times
    # slower (tests/helpers.py one_cpu has the figures). Providers' jobs get a clean
    # environment; one_cpu gives them one core each.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # One directory of tiny models for the whole run, shared by xdist's workers (they are
    # started after this and inherit the environment); the controller removes it at the end.
    if not hasattr(config, "workerinput") and "TESTS_MODEL_CACHE" not in os.environ:
        config._model_cache = tempfile.mkdtemp(prefix="gpumarket-test-models-")
        os.environ["TESTS_MODEL_CACHE"] = config._model_cache


def pytest_unconfigure(config):
    made = getattr(config, "_model_cache", None)
    if made:
        shutil.rmtree(made, ignore_errors=True)
        os.environ.pop("TESTS_MODEL_CACHE", None)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.e2e)
    if hasattr(config, "workerinput"):
        # Under xdist, the long real-process and slow tests first and the many short ones
        # after, to fill the workers at the end (every worker sorts alike: a stable sort of
        # the same collection).
        items.sort(key=lambda item: item.get_closest_marker("e2e") is None
                   and item.get_closest_marker("slow") is None)


@pytest.fixture(autouse=True)
def _processes_need_the_e2e_mark(request):
    """A test that starts a broker or a provider (tests/helpers.py Marketplace) without the
    e2e mark fails at once, naming the mark: the fast lane (-m "not e2e") stays fast."""
    helpers.E2E_TEST = request.node.get_closest_marker("e2e") is not None
    yield
    helpers.E2E_TEST = None


@pytest.fixture
def market(tmp_path, request):
    """A running broker and a client key; tests start the providers they need (warm, unless
    the test's module sets WARM_PROVIDERS = False: see Marketplace.warm)."""
    m = Marketplace(tmp_path)
    m.warm = getattr(request.module, "WARM_PROVIDERS", True)
    m.start_broker(*LEASE_ARGS)
    m.identity()    # the client's key (what `gpumarket keys init` makes; credit made it too)
    yield m
    m.close()
    for name, proc in m.providers.items():
        text = proc.text()
        assert "Traceback" not in text, f"{name} logged a traceback:\n{text}"
    if m.broker is not None:
        assert not own_tracebacks(m.broker.text()), m.broker.text()


@pytest.fixture(scope="session")
def pg_cluster():
    """One throwaway PostgreSQL cluster for this test session (xdist: per worker), started
    when a test first needs one (tests/pg.py); skips where PostgreSQL is not installed."""
    from tests import pg

    why = pg.missing()
    if why:
        pytest.skip(why)
    cluster = pg.Cluster()
    try:
        cluster.template = _migrated_template(cluster)
        yield cluster
    finally:
        cluster.stop()


def _migrated_template(cluster) -> str:
    """A database with the broker's migrations applied, that each test's database copies
    (CREATE DATABASE … TEMPLATE: milliseconds, where migrating is half a second)."""
    from gpumarket.broker.store import postgres
    from gpumarket.broker.store.schema import migrations

    url = cluster.database()
    db = postgres.connect(url)
    postgres.migrate(db, migrations)
    db.conn.close()
    return url.split("@/", 1)[1].split("?")[0]


@pytest.fixture(params=["sqlite", "postgresql"])
def store_location(request, tmp_path):
    """Where a domain test's store is: a fresh SQLite file, or a fresh database (the
    broker's schema already applied) on the session's PostgreSQL cluster."""
    if request.param == "sqlite":
        return str(tmp_path / "broker.db")
    cluster = request.getfixturevalue("pg_cluster")
    return cluster.database(template=cluster.template)


@pytest.fixture
def store(store_location):
    """A broker's store, opened on a fresh database: SQLite, then PostgreSQL (the domain
    tests' database; each test runs on both)."""
    from gpumarket.broker.store.store import Store, is_postgres, open_store

    s = open_store(store_location, None) if is_postgres(store_location) \
        else Store(Path(store_location))
    s.open()
    yield s
    s.close()


@pytest.fixture
def pg_store(pg_cluster):
    """A broker's store on a fresh database of the session's PostgreSQL cluster (the
    broker's schema already applied): for the tests of what only PostgreSQL does."""
    from gpumarket.broker.store.store import open_store

    s = open_store(pg_cluster.database(template=pg_cluster.template), None)
    s.open()
    yield s
    s.close()


@pytest.fixture(autouse=True, scope="session")
def broker_reactions():
    """The state machine's reactions (broker/jobs/reactions.py), installed as the broker
    installs them when it starts: the domain tests call its transitions directly."""
    from gpumarket.broker.server import install_reactions

    install_reactions()
