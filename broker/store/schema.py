"""The broker's tables, as registered sqlite-utils migrations."""

from __future__ import annotations

from sqlite_utils import Database
from sqlite_utils.migrations import Migrations

from gpumarket.broker.store import schema_later

migrations = Migrations("gpumarket.broker")


@migrations()
def m001_initial(db: Database) -> None:
    db.execute("""
        CREATE TABLE providers (
            id TEXT PRIMARY KEY,
            public_key BLOB NOT NULL,
            first_seen_ms INTEGER NOT NULL,
            last_seen_ms INTEGER NOT NULL,
            online INTEGER NOT NULL DEFAULT 0,
            banned INTEGER NOT NULL DEFAULT 0
        )"""
    )
    db.execute("""
        CREATE TABLE offers (
            provider_id TEXT PRIMARY KEY REFERENCES providers(id),
            envelope BLOB NOT NULL,
            price_per_gpu_hour REAL NOT NULL,
            device_count INTEGER NOT NULL,
            created_at_ms INTEGER NOT NULL
        )"""
    )
    db.execute("""
        CREATE TABLE jobs (
            id TEXT PRIMARY KEY,
            client_id TEXT NOT NULL,
            name TEXT NOT NULL,
            kind INTEGER NOT NULL,
            state INTEGER NOT NULL,
            spec BLOB NOT NULL,
            spec_sha256 TEXT NOT NULL,
            gpus INTEGER NOT NULL,
            min_memory_bytes INTEGER NOT NULL,
            accelerator INTEGER NOT NULL,
            max_price_per_gpu_hour REAL NOT NULL,
            expires_at_ms INTEGER NOT NULL,
            attempt INTEGER NOT NULL DEFAULT 1,
            max_attempts INTEGER NOT NULL,
            epoch INTEGER NOT NULL DEFAULT 0,
            provider_id TEXT,
            lease_id TEXT,
            progress_step INTEGER NOT NULL DEFAULT 0,
            progress_total INTEGER NOT NULL DEFAULT 0,
            progress_metrics TEXT NOT NULL DEFAULT '{}',
            error TEXT NOT NULL DEFAULT '',
            queue_reason TEXT NOT NULL DEFAULT '',
            receipt BLOB,
            resume_from TEXT,
            created_at_ms INTEGER NOT NULL,
            updated_at_ms INTEGER NOT NULL
        )"""
    )
    db.execute("CREATE INDEX jobs_by_state ON jobs(state, created_at_ms)")
    db.execute("CREATE INDEX jobs_by_client ON jobs(client_id, created_at_ms)")
    db.execute("""
        CREATE TABLE leases (
            id TEXT PRIMARY KEY,
            job_id TEXT NOT NULL REFERENCES jobs(id),
            attempt INTEGER NOT NULL,
            epoch INTEGER NOT NULL,
            provider_id TEXT NOT NULL,
            device_indices TEXT NOT NULL,
            price_per_gpu_hour REAL NOT NULL,
            state TEXT NOT NULL,
            issued_at_ms INTEGER NOT NULL,
            renewed_at_ms INTEGER NOT NULL,
            started_at_ms INTEGER,
            ended_at_ms INTEGER,
            reason TEXT NOT NULL DEFAULT '',
            envelope BLOB NOT NULL,
            UNIQUE (job_id, epoch)
        )"""
    )
    db.execute("CREATE INDEX leases_by_provider ON leases(provider_id, state)")
    db.execute("""
        CREATE TABLE events (
            seq INTEGER PRIMARY KEY AUTOINCREMENT,
            job_id TEXT NOT NULL REFERENCES jobs(id),
            at_ms INTEGER NOT NULL,
            type TEXT NOT NULL,
            state INTEGER NOT NULL,
            attempt INTEGER NOT NULL,
            provider_id TEXT NOT NULL DEFAULT '',
            message TEXT NOT NULL DEFAULT '',
            progress TEXT
        )"""
    )
    db.execute("CREATE INDEX events_by_job ON events(job_id, seq)")
    db.execute("""
        CREATE TABLE artifacts (
            sha256 TEXT PRIMARY KEY,
            size_bytes INTEGER NOT NULL,
            created_at_ms INTEGER NOT NULL
        )"""
    )
    db.execute(
        """
        CREATE TABLE nonces (
            signer_id TEXT NOT NULL,
            nonce TEXT NOT NULL,
            expires_at_ms INTEGER NOT NULL,
            job_id TEXT NOT NULL,
            PRIMARY KEY (signer_id, nonce)
        )"""
    )


@migrations()
def m002_checkpoints_and_sessions(db: Database) -> None:
    db.execute("ALTER TABLE jobs ADD COLUMN checkpoint_step INTEGER NOT NULL DEFAULT 0")
    db.execute("ALTER TABLE jobs ADD COLUMN checkpoint_seconds REAL NOT NULL DEFAULT 0")
    db.execute(
        """
        CREATE TABLE artifact_refs (
            sha256 TEXT NOT NULL,
            job_id TEXT NOT NULL REFERENCES jobs(id),
            role TEXT NOT NULL,
            PRIMARY KEY (sha256, job_id, role)
        )"""
    )
    db.execute("CREATE INDEX artifact_refs_by_job ON artifact_refs(job_id, role)")
    db.execute(
        """
        CREATE TABLE provider_sessions (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            provider_id TEXT NOT NULL REFERENCES providers(id),
            started_ms INTEGER NOT NULL,
            ended_ms INTEGER,
            end_reason TEXT NOT NULL DEFAULT ''
        )"""
    )
    db.execute("CREATE INDEX provider_sessions_by_provider ON provider_sessions(provider_id, id)")


@migrations()
def m003_matching(db: Database) -> None:
    for column in (
        "objective TEXT NOT NULL DEFAULT 'cheapest'",
        "deadline_s INTEGER NOT NULL DEFAULT 0",
        "min_reliability REAL NOT NULL DEFAULT 0",
        "min_compute_capability REAL NOT NULL DEFAULT 0",
        "gpu_models TEXT NOT NULL DEFAULT '[]'",
        "work_flops REAL NOT NULL DEFAULT 0",
        "est_memory_bytes INTEGER NOT NULL DEFAULT 0",
        "max_runtime_s INTEGER NOT NULL DEFAULT 0",
    ):
        db.execute(f"ALTER TABLE jobs ADD COLUMN {column}")
    db.execute(
        """
        CREATE TABLE throughput (
            provider_id TEXT NOT NULL,
            kind INTEGER NOT NULL,
            flops_per_device REAL NOT NULL,
            samples INTEGER NOT NULL,
            updated_ms INTEGER NOT NULL,
            PRIMARY KEY (provider_id, kind)
        )"""
    )


@migrations()
def m004_logs(db: Database) -> None:
    db.execute(
        """
        CREATE TABLE job_logs (
            seq INTEGER PRIMARY KEY AUTOINCREMENT,
            job_id TEXT NOT NULL REFERENCES jobs(id),
            attempt INTEGER NOT NULL,
            at_ms INTEGER NOT NULL,
            text TEXT NOT NULL
        )"""
    )
    db.execute("CREATE INDEX job_logs_by_job ON job_logs(job_id, seq)")
    db.execute("ALTER TABLE jobs ADD COLUMN log_lines INTEGER NOT NULL DEFAULT 0")


@migrations()
def m005_engine(db: Database) -> None:
    db.execute("ALTER TABLE jobs ADD COLUMN engine TEXT NOT NULL DEFAULT ''")


@migrations()
def m006_parts(db: Database) -> None:
    # A split job is a parent row (parts = N, part = 0) that is never leased itself, and N
    # part rows (parent_id set, part = 1..N) that are leased like any job.
    db.execute("ALTER TABLE jobs ADD COLUMN parent_id TEXT REFERENCES jobs(id)")
    db.execute("ALTER TABLE jobs ADD COLUMN part INTEGER NOT NULL DEFAULT 0")
    db.execute("ALTER TABLE jobs ADD COLUMN parts INTEGER NOT NULL DEFAULT 0")
    db.execute("CREATE INDEX jobs_by_parent ON jobs(parent_id, part)")


@migrations()
def m007_models(db: Database) -> None:
    db.execute("ALTER TABLE jobs ADD COLUMN model_name TEXT NOT NULL DEFAULT ''")
    db.execute("ALTER TABLE jobs ADD COLUMN model_sha256 TEXT NOT NULL DEFAULT ''")
    db.execute("ALTER TABLE jobs ADD COLUMN remote_code INTEGER NOT NULL DEFAULT 0")


@migrations()
def m008_security(db: Database) -> None:
    # Nonces of call tokens, kept until the token has expired (so a replay after a restart
    # is still refused).
    db.execute(
        """
        CREATE TABLE call_nonces (
            key_id TEXT NOT NULL,
            nonce TEXT NOT NULL,
            keep_until_ms INTEGER NOT NULL,
            PRIMARY KEY (key_id, nonce)
        )"""
    )
    db.execute("CREATE INDEX call_nonces_by_expiry ON call_nonces(keep_until_ms)")
    db.execute(
        """
        CREATE TABLE revoked_keys (
            key_id TEXT PRIMARY KEY,
            reason TEXT NOT NULL DEFAULT '',
            revoked_at_ms INTEGER NOT NULL
        )"""
    )
    # Who uploaded a blob (each uploader proves it has the bytes): they may read it back,
    # and its size counts against their artifact quota.
    db.execute(
        """
        CREATE TABLE artifact_owners (
            sha256 TEXT NOT NULL,
            owner_id TEXT NOT NULL,
            size_bytes INTEGER NOT NULL,
            created_at_ms INTEGER NOT NULL,
            PRIMARY KEY (sha256, owner_id)
        )"""
    )
    db.execute("CREATE INDEX artifact_owners_by_owner ON artifact_owners(owner_id)")


@migrations()
def m009_upload_reservations(db: Database) -> None:
    # An upload in progress: its declared size is fixed when it begins and counts against
    # the uploader's quota until it finishes (or is dropped, unfinished, by the collector).
    db.execute(
        """
        CREATE TABLE artifact_uploads (
            sha256 TEXT NOT NULL,
            uploader_id TEXT NOT NULL,
            size_bytes INTEGER NOT NULL,
            started_at_ms INTEGER NOT NULL,
            updated_at_ms INTEGER NOT NULL,
            PRIMARY KEY (sha256, uploader_id)
        )"""
    )
    db.execute("CREATE INDEX artifact_uploads_by_uploader ON artifact_uploads(uploader_id)")


NEEDS_COLUMNS = ("gpus", "min_memory_bytes", "accelerator", "max_price_per_gpu_hour",
                 "min_compute_capability", "gpu_models", "min_reliability", "work_flops",
                 "objective", "deadline_s", "max_runtime_s", "engine", "model_name",
                 "model_sha256", "remote_code")


@migrations()
def m010_job_needs(db: Database) -> None:
    # What a job needs of a provider, stored once as JSON (broker/admission.Needs) instead
    # of a column each: no query filters on them, the matcher reads them all at once.
    import json

    from gpumarket.proto.v1 import types_pb2 as pb

    db.execute("ALTER TABLE jobs ADD COLUMN needs TEXT NOT NULL DEFAULT '{}'")
    cols = ", ".join(("id", "kind", "spec") + NEEDS_COLUMNS)
    for row in db.execute(f"SELECT {cols} FROM jobs").fetchall():
        values = dict(zip(("id", "kind", "spec") + NEEDS_COLUMNS, row))
        env = pb.Envelope.FromString(values.pop("spec"))
        spec = pb.JobSpec.FromString(env.payload)
        params = getattr(spec, spec.WhichOneof("params") or "training")
        values.update(kind=values["kind"], gpu_models=json.loads(values["gpu_models"]),
                      remote_code=bool(values["remote_code"]),
                      checkpoint_every=int(getattr(params, "checkpoint_every", 0)))
        job_id = values.pop("id")
        db.execute("UPDATE jobs SET needs = ? WHERE id = ?",
                   [json.dumps(values, sort_keys=True), job_id])
    for column in NEEDS_COLUMNS + ("est_memory_bytes",):
        db.execute(f"ALTER TABLE jobs DROP COLUMN {column}")


@migrations()
def m011_ledger(db: Database) -> None:
    """The ledger (broker/money/ledger.py): append-only postings whose entries sum to zero, the
    accounts they name, and what each job and lease needs to settle: the terms it was
    accepted under (fee, whether funds are enforced) and where its last settlement ended."""
    # Laid out for the single writer: a settlement writes one postings row (its entries also
    # as JSON in it), three entry rows clustered by account, each with the account's running
    # balance (so a balance is one index seek), and nothing else; accounts are registered
    # once, when first used.
    db.execute(
        """
        CREATE TABLE ledger_postings (
            seq INTEGER PRIMARY KEY,        -- never reused: postings are never deleted
            key TEXT NOT NULL UNIQUE,       -- idempotency: one posting per event, ever
            at_ms INTEGER NOT NULL,
            type TEXT NOT NULL,
            entries TEXT NOT NULL,          -- {account: amount}, as in ledger_entries
            job_id TEXT NOT NULL DEFAULT '',
            lease_id TEXT NOT NULL DEFAULT '',
            provider_id TEXT NOT NULL DEFAULT '',
            step_from INTEGER NOT NULL DEFAULT 0,
            step_to INTEGER NOT NULL DEFAULT 0,
            seconds REAL NOT NULL DEFAULT 0,
            memo TEXT NOT NULL DEFAULT '',
            actor TEXT NOT NULL DEFAULT ''  -- the operator key of a credit
        )"""
    )
    db.execute(
        """
        CREATE TABLE ledger_entries (
            account TEXT NOT NULL,
            posting_seq INTEGER NOT NULL,   -- a ledger_postings.seq (the audit checks)
            amount INTEGER NOT NULL,
            balance INTEGER NOT NULL,       -- the account's balance after this entry
            PRIMARY KEY (account, posting_seq)
        ) WITHOUT ROWID"""
    )
    db.execute(
        """
        CREATE TABLE ledger_accounts (
            account TEXT PRIMARY KEY,
            type TEXT NOT NULL,     -- deposits, client, escrow, provider, stake, fee, disputed
            owner TEXT NOT NULL DEFAULT ''  -- the client (client, escrow) or provider it is of
        )"""
    )
    db.execute("CREATE INDEX ledger_accounts_by_owner ON ledger_accounts(owner)")
    db.execute("CREATE INDEX ledger_accounts_by_type ON ledger_accounts(type)")
    for table in ("ledger_postings", "ledger_entries"):
        for action in ("UPDATE", "DELETE"):
            db.execute(f"CREATE TRIGGER {table}_append_only_{action.lower()}"
                       f" BEFORE {action} ON {table}"
                       f" BEGIN SELECT RAISE(ABORT, '{table} is append-only'); END")
    db.execute("ALTER TABLE jobs ADD COLUMN fee_ppm INTEGER NOT NULL DEFAULT 0")
    db.execute("ALTER TABLE jobs ADD COLUMN enforce_funds INTEGER NOT NULL DEFAULT 0")
    db.execute("ALTER TABLE jobs ADD COLUMN hold_basis TEXT NOT NULL DEFAULT ''")
    db.execute("ALTER TABLE jobs ADD COLUMN hold_needed INTEGER NOT NULL DEFAULT 0")
    db.execute("ALTER TABLE leases ADD COLUMN start_step INTEGER NOT NULL DEFAULT 0")
    # The current lease's settlement cursor, on the job's row (which a checkpoint writes anyway):
    # the time and step its last settlement reached (time NULL until the lease's job started).
    db.execute("ALTER TABLE jobs ADD COLUMN settled_to_ms INTEGER")
    db.execute("ALTER TABLE jobs ADD COLUMN settled_step INTEGER NOT NULL DEFAULT 0")
    db.execute("ALTER TABLE leases ADD COLUMN raw_runtime_s REAL NOT NULL DEFAULT 0")
    db.execute("ALTER TABLE leases ADD COLUMN accelerator INTEGER NOT NULL DEFAULT 0")
    db.execute(
        """
        CREATE TABLE runtime_samples (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            provider_id TEXT NOT NULL,
            kind INTEGER NOT NULL,
            accelerator INTEGER NOT NULL,
            raw_s REAL NOT NULL,            -- the work at the benchmark's speed (0: work unknown)
            seconds REAL NOT NULL,          -- the lease's wall time, started to receipt
            at_ms INTEGER NOT NULL
        )"""
    )
    db.execute("CREATE INDEX runtime_samples_by_provider ON runtime_samples(provider_id, kind, id)")
    db.execute("CREATE INDEX runtime_samples_by_class ON runtime_samples(accelerator, kind, id)")


@migrations()
def m012_verification(db: Database) -> None:
    """Spot checks (broker/checks/verification.py): each replays part of a provider's work on
    another provider. A check runs as a job row of its own (``check_of`` names the job it
    checks; ``pays_from`` the job whose hold pays for it) and has a row here."""
    db.execute(
        """
        CREATE TABLE checks (
            id TEXT PRIMARY KEY,            -- also the id of the job row that runs it
            job_id TEXT NOT NULL,           -- the job (or part) whose work is checked
            top_id TEXT NOT NULL,           -- the job whose hold pays (a split job, for a part)
            provider_id TEXT NOT NULL,      -- whose work is checked
            lease_id TEXT NOT NULL,         -- the lease that did it
            settle_seq INTEGER,             -- its settlement, held while the check runs
            step_from INTEGER NOT NULL,
            step_to INTEGER NOT NULL,
            scope TEXT NOT NULL,            -- JSON: rows / frames / batch_size
            start TEXT,                     -- JSON ArtifactRef: the checkpoint it resumes from
            expect TEXT NOT NULL,           -- JSON {name: ArtifactRef}: the provider's result
            role TEXT NOT NULL,             -- check, or tiebreak (after a disagreement)
            first_check TEXT,               -- a tiebreak: the check that disagreed
            checker_id TEXT,
            outputs TEXT,                   -- JSON {name: ArtifactRef}: the checker's result
            state TEXT NOT NULL,            -- queued, running, returned, passed, failed,
                                            -- disagreed, inconclusive, skipped, cancelled
            liar TEXT,                      -- the provider this check found wrong, if any
            detail TEXT NOT NULL DEFAULT '',
            created_at_ms INTEGER NOT NULL,
            ended_at_ms INTEGER
        )"""
    )
    db.execute("CREATE INDEX checks_by_job ON checks(job_id)")
    db.execute("CREATE INDEX checks_by_top ON checks(top_id)")
    db.execute("CREATE INDEX checks_by_provider ON checks(provider_id, created_at_ms)")
    db.execute("CREATE INDEX checks_by_liar ON checks(liar) WHERE liar IS NOT NULL")
    db.execute("CREATE INDEX checks_by_state ON checks(state)")
    db.execute("ALTER TABLE jobs ADD COLUMN check_of TEXT")
    db.execute("ALTER TABLE jobs ADD COLUMN pays_from TEXT")
    # Every checkpoint of an unfinished job, kept (its blob too) so that a check that finds a
    # provider's work wrong can send the job back to the last checkpoint not built on it.
    db.execute(
        """
        CREATE TABLE checkpoint_history (
            seq INTEGER PRIMARY KEY AUTOINCREMENT,
            job_id TEXT NOT NULL,
            step INTEGER NOT NULL,
            ref TEXT NOT NULL,              -- JSON ArtifactRef
            lease_id TEXT NOT NULL,
            provider_id TEXT NOT NULL,
            start_step INTEGER NOT NULL,    -- where that lease started (its resume point)
            dropped INTEGER NOT NULL DEFAULT 0
        )"""
    )
    db.execute("CREATE INDEX checkpoint_history_by_job ON checkpoint_history(job_id, seq)")


@migrations()
def m013_endpoints(db: Database) -> None:
    """Endpoints (broker/serving/endpoints.py): their API keys (only a sha256 of each secret) and the
    requests and tokens each replica lease served, the unit a ledger can bill."""
    db.execute(
        """
        CREATE TABLE endpoint_keys (
            key_id TEXT PRIMARY KEY,
            secret_sha256 TEXT NOT NULL UNIQUE,
            endpoint_id TEXT NOT NULL,
            client_id TEXT NOT NULL,
            created_at_ms INTEGER NOT NULL,
            revoked_at_ms INTEGER
        )"""
    )
    db.execute("CREATE INDEX endpoint_keys_by_endpoint ON endpoint_keys(endpoint_id)")
    db.execute(
        """
        CREATE TABLE endpoint_usage (
            lease_id TEXT PRIMARY KEY,
            endpoint_id TEXT NOT NULL,
            job_id TEXT NOT NULL,            -- the replica
            provider_id TEXT NOT NULL,
            requests INTEGER NOT NULL DEFAULT 0,
            errors INTEGER NOT NULL DEFAULT 0,
            prompt_tokens INTEGER NOT NULL DEFAULT 0,
            output_tokens INTEGER NOT NULL DEFAULT 0,
            updated_at_ms INTEGER NOT NULL
        )"""
    )
    db.execute("CREATE INDEX endpoint_usage_by_endpoint ON endpoint_usage(endpoint_id)")
    db.execute("CREATE INDEX jobs_by_kind ON jobs(kind, state) WHERE parent_id IS NULL")


@migrations()
def m014_arrays(db: Database) -> None:
    """Job arrays (broker/jobs/arrays.py): each task's state. The array is a job row whose
    batches are job rows under it (``parent_id``), each leased like any job and running the
    tasks that name it in ``batch_id``; ``tasks`` counts an array's tasks (a batch's)."""
    db.execute("ALTER TABLE jobs ADD COLUMN tasks INTEGER NOT NULL DEFAULT 0")
    db.execute(
        """
        CREATE TABLE array_tasks (
            array_id TEXT NOT NULL,
            task INTEGER NOT NULL,              -- 0-based: its line in the tasks input
            state INTEGER NOT NULL,             -- a JobState: QUEUED, LEASED (in a batch),
                                                -- SUCCEEDED, FAILED or CANCELLED
            attempts INTEGER NOT NULL DEFAULT 0,    -- runs that ended without success
            batch_id TEXT,                      -- the batch that runs (or ran) it last
            provider_id TEXT NOT NULL DEFAULT '',
            error TEXT NOT NULL DEFAULT '',
            outputs TEXT,                       -- JSON [ArtifactRef]: once its receipt is in
            seconds REAL NOT NULL DEFAULT 0,
            updated_at_ms INTEGER NOT NULL,
            PRIMARY KEY (array_id, task)
        ) WITHOUT ROWID"""
    )
    db.execute("CREATE INDEX array_tasks_by_batch ON array_tasks(batch_id)")


@migrations()
def m015_array_lanes_and_task_receipts(db: Database) -> None:
    """How many leases an array's tasks are spread over when its spec leaves that to the
    broker (kinds/arrays.py per_lease): the devices that could run it when it came. And a
    task's own receipt (a signed Envelope) where its outputs went up as it ended."""
    db.execute("ALTER TABLE jobs ADD COLUMN lanes INTEGER NOT NULL DEFAULT 0")
    db.execute("ALTER TABLE array_tasks ADD COLUMN receipt BLOB")


@migrations()
def m016_provider_reconnect(db: Database) -> None:
    """How long each provider said it takes to reconnect (its hello's reconnect_within_ms,
    bounded; 0 = not said): a restarted broker keeps its leases that long (providers.py)."""
    db.execute("ALTER TABLE providers ADD COLUMN reconnect_within_ms INTEGER NOT NULL DEFAULT 0")


@migrations()
def m017_failed_leases_confirmed(db: Database) -> None:
    """A lease its provider reported ``failed`` now weighs like a lost one until a second
    provider confirms the job's own failure (``crashed``: broker/jobs/transitions.py fail). Before, one
    report failed the job: those leases keep the meaning they had, the job's own failure."""
    db.execute("UPDATE leases SET state = 'crashed' WHERE state = 'failed'")


@migrations()
def m018_array_task_yields(db: Database) -> None:
    """An array task whose lease was asked to yield its device before the task ended
    (broker/jobs/arrays.py yield_lease): when that lease ends it goes back to the queue without
    counting an attempt. 1: asked to stop after its current task; 2: to split (STOP, SPLIT)."""
    db.execute("ALTER TABLE array_tasks ADD COLUMN yielded INTEGER NOT NULL DEFAULT 0")


@migrations()
def m019_lease_preemption(db: Database) -> None:
    """An interruptible lease asked to yield its devices to a job of a higher tier
    (broker/jobs/preemption.py): the job it yields to and when it was asked. It ends
    ``preempted``: neither lost nor failed."""
    db.execute("ALTER TABLE leases ADD COLUMN preempt_for TEXT")
    db.execute("ALTER TABLE leases ADD COLUMN preempt_at_ms INTEGER")


@migrations()
def m020_warmup_checks(db: Database) -> None:
    """Who pays a check's replays (broker/checks/verification.py): NULL, the job's client
    (a check its verify share, at least the floor rate, would have made); else the checked
    provider's id, for a warm-up check (one made only because the provider is new), charged
    to it when the job ends (broker/checks/disputes.py charge_warmups)."""
    db.execute("ALTER TABLE checks ADD COLUMN paid_by TEXT")


@migrations()
def m021_leadership(db: Database) -> None:
    """Which broker leads (broker/store/leadership.py) where several share one database: a
    row per role, its holder, its epoch (raised at each takeover, never reused: the fencing
    token its writes carry) and until when its lease runs."""
    db.execute(
        """
        CREATE TABLE leadership (
            role TEXT PRIMARY KEY,
            holder TEXT NOT NULL DEFAULT '',
            epoch INTEGER NOT NULL DEFAULT 0,
            expires_at_ms INTEGER NOT NULL DEFAULT 0,
            fenced_at_ms INTEGER NOT NULL DEFAULT 0   -- the last write its epoch let through
        )"""
    )


@migrations()
def m022_answer_samples(db: Database) -> None:
    """An endpoint's sampled answers, written as the router keeps them (broker/serving/
    answer_samples.py ``keep``) and taken by the autoscaler when it settles the window
    (``take_stored``): a broker restart or a new leader still checks the window. Bounded as
    the router bounds them (64 answers and 2 MiB a replica lease, 8 MiB an endpoint)."""
    db.execute(
        """
        CREATE TABLE answer_samples (
            id INTEGER PRIMARY KEY,
            lease_id TEXT NOT NULL,          -- the replica lease whose window kept it
            job_id TEXT NOT NULL,            -- the replica job row
            endpoint_id TEXT NOT NULL,
            provider_id TEXT NOT NULL,
            answers INTEGER NOT NULL,        -- answers the replica had given in the window
            drawn INTEGER NOT NULL,          -- 1: drawn at the rate; 0: a warm-up minimum
            sample TEXT NOT NULL,            -- {"request", "token_ids", "fingerprints"} (JSON)
            bytes INTEGER NOT NULL,          -- its size as the bounds count it
            kept_at_ms INTEGER NOT NULL
        )"""
    )
    db.execute("CREATE INDEX answer_samples_lease ON answer_samples (lease_id)")
    db.execute("CREATE INDEX answer_samples_endpoint ON answer_samples (endpoint_id)")


@migrations()
def m023_serving_brokers(db: Database) -> None:
    """Where several brokers share one database, each one's endpoints' API address and the
    endpoints it holds a ready replica of, renewed every second (broker/serving/relay.py): a
    broker asked for an endpoint it holds no replica of relays the request to one that does."""
    db.execute(
        """
        CREATE TABLE serving_brokers (
            holder TEXT PRIMARY KEY,         -- the broker process (leadership's holder)
            url TEXT NOT NULL,               -- its endpoints' API, http://HOST:PORT
            served TEXT NOT NULL DEFAULT '{}',  -- {endpoint id: ready replicas here} (JSON)
            seen_ms INTEGER NOT NULL         -- when it last said so
        )"""
    )


for _later in schema_later.LATER:       # after this module's own, in order
    migrations()(_later)
