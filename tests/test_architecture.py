"""The layering docs/architecture.md describes, checked on the source: roles import
gpumarket.proto, gpumarket.kinds and gpumarket.link, never each other; grpc stubs are used
only in the link layer and the broker's servicers; proto and kinds import no grpc."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROLES = ("broker", "provider", "client")
SERVICERS = {"broker/api/admin.py", "broker/api/artifacts.py", "broker/api/gateway.py",
             "broker/api/marketplace.py", "broker/server.py"}


def imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def sources(package: str) -> list[Path]:
    return [p for p in (ROOT / package).rglob("*.py") if "_pb2" not in p.name]


def test_no_role_imports_another():
    for role in ROLES:
        for path in sources(role):
            others = {i for i in imports(path) for other in ROLES if other != role
                      and i.startswith(f"gpumarket.{other}")}
            assert not others, f"{path.relative_to(ROOT)} imports {sorted(others)}"


def test_grpc_stubs_only_in_the_link_layer_and_the_servicers():
    for package in (*ROLES, "proto", "kinds", "link"):
        for path in sources(package):
            rel = str(path.relative_to(ROOT))
            stubs = {i for i in imports(path) if i.endswith("_pb2_grpc")}
            if stubs and package != "link" and rel not in SERVICERS:
                raise AssertionError(f"{rel} uses grpc stubs {sorted(stubs)}")


def test_the_shared_layers_import_no_grpc_and_no_role():
    for package in ("proto", "kinds"):
        for path in sources(package):
            bad = {i for i in imports(path) if i == "grpc" or i.startswith("grpc.")
                   or any(i.startswith(f"gpumarket.{r}") for r in ROLES + ("link",))}
            assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


BROKER_ROOMS = {"api", "jobs", "market", "money", "checks", "serving", "store"}
BROKER_PROCESS = {"__init__.py", "cli.py", "admin_cli.py", "config.py", "server.py", "state.py",
                  "metrics.py"}


def test_the_broker_is_in_rooms():
    """Each subsystem of the broker is a package named for it (docs/architecture.md, The
    broker's rooms); only the process itself (its CLI, config, wiring, shared state and
    metrics) sits at the top."""
    top = {p.name for p in (ROOT / "broker").glob("*.py")}
    assert top <= BROKER_PROCESS, f"broker/ modules outside a room: {sorted(top - BROKER_PROCESS)}"
    rooms = {p.name for p in (ROOT / "broker").iterdir()
             if p.is_dir() and (p / "__init__.py").exists()}
    assert rooms == BROKER_ROOMS, sorted(rooms ^ BROKER_ROOMS)


def test_no_broker_or_provider_module_over_600_lines():
    for path in [*sources("broker"), *sources("provider")]:
        lines = len(path.read_text().splitlines())
        assert lines <= 600, f"{path.relative_to(ROOT)} has {lines} lines (at most 600)"


def _names_job_json(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Constant) and isinstance(n.value, str)
               and "job.json" in n.value for n in ast.walk(node))


def test_runners_read_job_json_only_through_runner_job():
    """job.json is what the daemon writes (kinds.runner_job.RunnerJob.to_json): every runner
    reads it with runners/base.read_job (RunnerJob.from_json), never as a dict of its own."""
    for path in sources("provider/runners"):
        rel = str(path.relative_to(ROOT))
        tree = ast.parse(path.read_text())
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef,
                                        ast.ClassDef))
                      and n.body and isinstance(n.body[0], ast.Expr)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in ("load", "loads") and _names_job_json(node):
                raise AssertionError(f"{rel}:{node.lineno} parses job.json itself")
            if rel != "provider/runners/base.py" and isinstance(node, ast.Constant) \
                    and id(node) not in docstrings and isinstance(node.value, str) \
                    and "job.json" in node.value:
                raise AssertionError(f"{rel}:{node.lineno} opens job.json (use read_job)")


def test_the_runner_job_loads_nothing_but_the_standard_library():
    """Runners import kinds.runner_job in the job's own process: it brings no grpc, no
    protobuf, no role."""
    path = ROOT / "kinds" / "runner_job.py"
    top = {i for node in ast.parse(path.read_text()).body
           if isinstance(node, (ast.Import, ast.ImportFrom))
           for i in imports_of(node)}
    assert not {i for i in top if i.startswith(("gpumarket", "grpc", "google"))}, top


def imports_of(node: ast.Import | ast.ImportFrom) -> set[str]:
    if isinstance(node, ast.Import):
        return {a.name for a in node.names}
    return {node.module or ""}


SQL_WORDS = re.compile(r"^\s*(SELECT\s|INSERT\s|UPDATE\s+\w+\s+SET|DELETE\s+FROM|CREATE\s|"
                       r"DROP\s|ALTER\s|PRAGMA\s|VACUUM\b|WITH\s+\w+\s+AS)")


ROWS_LAYER = "broker/jobs/job.py"
# A write of the jobs table or its events table, in SQL or through sqlite-utils' API.
JOB_TABLE_WRITE = re.compile(
    r"""\[["'](jobs|events)["']\]\.(insert|upsert|update|delete)"""
    r"""|\.table\(\s*["'](jobs|events)["']"""
    r"|(INSERT|REPLACE)\s+(OR\s+\w+\s+)?INTO\s+(jobs|events)\b"
    r"|UPDATE\s+(OR\s+\w+\s+)?(jobs|events)\s+SET\b"
    r"|DELETE\s+FROM\s+(jobs|events)\b", re.IGNORECASE)


def test_jobs_and_their_events_are_written_only_by_the_rows_layer():
    """The bottom layer of rows and events (jobs/job.py: ``insert_job``, ``update_job``,
    ``add_to_job``, ``start_billing``, ``set_queue_reasons``, ``insert_event``) is the only
    code that writes the ``jobs`` and ``events`` tables; the state machine above it decides
    what a change causes. (broker/store/ is left out: its migrations and a store's copy own
    the tables' shape, not what a row means.)"""
    writers = {str(p.relative_to(ROOT)) for p in sources("broker")
               if p.relative_to(ROOT).parts[1] != "store"
               and JOB_TABLE_WRITE.search(p.read_text())}
    assert writers == {ROWS_LAYER}, writers
    # The check sees a write where there is one.
    assert JOB_TABLE_WRITE.search('db.conn.execute("UPDATE jobs SET log_lines = 1")')
    assert JOB_TABLE_WRITE.search("db['events'].insert(row)")
    assert not JOB_TABLE_WRITE.search("SELECT * FROM jobs WHERE id = ?")


def test_the_rows_layer_has_no_side_effects():
    """What the rows layer does is write a row or an event: it imports nothing of the broker
    (so it cannot react, post money or notify anyone), and its SQL names no other table."""
    path = ROOT / ROWS_LAYER
    broker = {i for i in imports(path) if i.startswith("gpumarket.broker")}
    assert not broker, f"{ROWS_LAYER} imports {sorted(broker)}"
    tables = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and SQL_WORDS.match(node.value):
            tables |= {m.lower() for m in re.findall(
                r"\b(?:INTO|UPDATE|FROM|JOIN)\s+(\w+)", node.value, re.IGNORECASE)}
    assert tables <= {"jobs", "events"}, tables


def test_a_job_row_is_made_in_one_place():
    """A job row is made by the state machine only (jobs/transitions: ``submit``, and
    ``spawn`` for a part, a batch, a replica or a check), through the rows layer's
    ``insert_job``: what a child inherits is decided once."""
    callers = set()
    for path in sources("broker"):
        rel = str(path.relative_to(ROOT))
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Call) and "insert_job" in (
                        getattr(node.func, "id", None), getattr(node.func, "attr", None)):
                    callers.add(f"{rel}:{fn.name}")
    assert callers == {"broker/jobs/transitions.py:submit",
                       "broker/jobs/transitions.py:spawn"}, callers


def test_no_sql_in_the_servicers():
    """broker/api/ decodes, makes one domain call, encodes: it reads and writes the database
    only through the rooms' functions (jobs/, market/, money/, checks/, serving/, store/),
    never with SQL of its own or a raw ``execute``."""
    found = []
    for path in sorted((ROOT / "broker" / "api").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and SQL_WORDS.match(node.value):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value[:40]!r}")
            if isinstance(node, ast.Attribute) and node.attr in ("execute", "executemany",
                                                                  "executescript"):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}")
    assert not found, "SQL in the servicers:\n" + "\n".join(found)



def test_a_submission_is_one_domain_call():
    """The servicer does not choose how a job is stored (one job, parts, an array's batches,
    an endpoint's replicas): admission decides its shape and ``jobs/submit`` writes it; the
    api/ modules call none of the writers of a shape themselves."""
    writers = {("transitions", "submit"), ("jobs", "submit"), ("arrays", "submit"),
               ("endpoints", "submit")}
    found = []
    for path in sorted((ROOT / "broker" / "api").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and (node.value.id, node.attr) in writers:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value.id}.submit")
    assert not found, "shapes chosen in the servicers:\n" + "\n".join(found)

def _kind_test(node: ast.Compare, names: set[str]) -> str:
    """What a comparison says about a particular kind, if anything: a JobKind constant, or
    a kind's name against a ``.name``/``kind_name(...)``."""
    sides = [node.left, *node.comparators]
    for side in sides:
        for sub in ast.walk(side):
            if isinstance(sub, ast.Attribute) and sub.attr.startswith("JOB_KIND_") \
                    and sub.attr != "JOB_KIND_UNSPECIFIED":
                return sub.attr
    named = any(isinstance(s, ast.Attribute) and s.attr == "name" or isinstance(s, ast.Call)
                and getattr(s.func, "id", getattr(s.func, "attr", "")) == "kind_name"
                for s in sides)
    strings = {s.value for s in sides if isinstance(s, ast.Constant)}
    return next(iter(strings & names), "") if named else ""


def test_no_comparison_of_a_kinds_name_outside_kinds():
    """What differs between kinds is said by the kind (kinds/: its attributes and methods,
    e.g. ``Kind.serves``), not by a test of which kind a job is elsewhere."""
    from gpumarket import kinds

    names = {k.name for k in kinds.all_kinds()}
    found = []
    for role in ("broker", "provider", "client", "link", "proto"):
        for path in sources(role):
            if "_pb2" in path.name:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Compare) and (what := _kind_test(node, names)):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {what}")
    assert not found, "kind tests outside kinds/:\n" + "\n".join(found)


def _broker_import_graph() -> dict[str, set[str]]:
    modules = {".".join(p.relative_to(ROOT / "broker").with_suffix("").parts): p
               for p in sources("broker") if p.name != "__init__.py"}
    return {name: {i.removeprefix("gpumarket.broker.") for i in imports(path)} & set(modules)
            - {name} for name, path in modules.items()}


def _circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_in_the_broker():
    """No two broker modules import each other, even through others or inside a function:
    the state machine (jobs/transitions, jobs/endings) calls job arrays and spot checks
    through the reactions the broker installs when it starts (jobs/reactions.py), and they
    import it."""
    circles = _circles(_broker_import_graph())
    assert circles == [], circles
    # The check finds a circle where there is one.
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]


JOB_READERS = ("broker/jobs/transitions.py", "broker/jobs/endings.py",
               "broker/jobs/arrays.py", "broker/jobs/views.py", "broker/jobs/preemption.py",
               "broker/jobs/submit.py", "broker/market/scheduler.py",
               "broker/market/placement.py", "broker/market/admission.py",
               "broker/market/calibration.py", "broker/market/deadlines.py",
               "broker/money/ledger.py", "broker/money/credit_holds.py",
               "broker/api/gateway.py", "broker/api/marketplace.py", "broker/jobs/logs.py",
               "broker/serving/endpoints.py", "broker/serving/autoscaler.py",
               "broker/serving/router.py", "broker/serving/openai_api.py",
               "broker/serving/request_shares.py")


def test_the_domain_reads_a_job_by_attribute():
    """A job row is read into a typed ``jobs.job.Job`` in one place (``Job.from_row``); the
    state machine, job arrays, the views, the scheduler, placement, admission, calibration,
    the ledger, the provider gateway, the marketplace's views and serving read its fields
    by name (``job.state``), never by key (``job["state"]``), so that a column renamed or
    gone fails where the Job is made. (checks/ still reads by key; serving's rows and the
    ledger's postings are typed values of their own: tests/test_typed_rows.py.)"""
    names = {"job", "parent", "p", "part", "failed", "top", "replica"}
    found = []
    for rel in JOB_READERS:
        for node in ast.walk(ast.parse((ROOT / rel).read_text())):
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) \
                    and node.value.id in names and isinstance(node.slice, ast.Constant) \
                    and isinstance(node.slice.value, str):
                found.append(f"{rel}:{node.lineno}: {node.value.id}[{node.slice.value!r}]")
    assert not found, "jobs read by key:\n" + "\n".join(found)
