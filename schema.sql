-- walletsvc schema. Applied by WalletService on first use, idempotently, in one
-- BEGIN IMMEDIATE transaction. Times are epoch milliseconds (UTC); money is
-- integer minor units of the row's currency (ISO 4217 exponent), never a float.
-- Bump schema_version with every change (walletsvc reads the version it expects from here).

CREATE TABLE IF NOT EXISTS schema_version (
    version INTEGER NOT NULL
);
INSERT INTO schema_version (version)
    SELECT 7 WHERE NOT EXISTS (SELECT 1 FROM schema_version);

-- The ledger's clock (docs/contract.md): the time of the last write transaction,
-- so that times never go backwards within a database (a write waiting for the
-- lock, a clock set back, another process), and the last id issued in one, so
-- that ids increase in commit order. One row.
CREATE TABLE IF NOT EXISTS ledger_clock (
    last_ms  INTEGER NOT NULL,
    last_id  TEXT NOT NULL
);
INSERT INTO ledger_clock (last_ms, last_id)
    SELECT 0, '' WHERE NOT EXISTS (SELECT 1 FROM ledger_clock);

-- A deleted workspace keeps its row (deleted_at set) so that its keys answer
-- GA2032 instead of GA2011 (docs/contract.md, the validation pipeline, step 3).
CREATE TABLE IF NOT EXISTS workspaces (
    id          TEXT PRIMARY KEY,
    name        TEXT NOT NULL CHECK (length(name) BETWEEN 1 AND 200),
    created_at  INTEGER NOT NULL,
    deleted_at  INTEGER
);

-- A removed member keeps its row (removed_at set): its keys answer GA2034.
CREATE TABLE IF NOT EXISTS members (
    id            TEXT PRIMARY KEY,
    workspace_id  TEXT NOT NULL REFERENCES workspaces (id),
    name          TEXT NOT NULL CHECK (length(name) BETWEEN 1 AND 200),
    role          TEXT NOT NULL CHECK (role IN ('OWNER', 'MEMBER')),
    created_at    INTEGER NOT NULL,
    removed_at    INTEGER
);
CREATE INDEX IF NOT EXISTS members_by_workspace ON members (workspace_id, created_at);

-- The secret is kept as issued: HMAC verification needs it (it is never
-- returned again after creation). scopes is a space-separated list;
-- ip_whitelist a JSON array of addresses and CIDR blocks, or NULL.
CREATE TABLE IF NOT EXISTS api_keys (
    id            TEXT PRIMARY KEY,
    secret        TEXT NOT NULL,
    workspace_id  TEXT NOT NULL REFERENCES workspaces (id),
    member_id     TEXT NOT NULL REFERENCES members (id),
    scopes        TEXT NOT NULL,
    ip_whitelist  TEXT,
    enabled       INTEGER NOT NULL DEFAULT 1 CHECK (enabled IN (0, 1)),
    created_at    INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS api_keys_by_workspace ON api_keys (workspace_id, created_at);

-- Replay protection (docs/contract.md, "Replay protection"): every nonce recorded, per key, with
-- the second it was signed in (its X-Timestamp), in the order recorded (seq). Records are kept
-- exactly, whatever the clock does, up to a count (the newest 100,000 by default); past it
-- the oldest become digests (nonce_digests), and past those each forgotten record's key and
-- second go to nonces_forgotten, as runs of consecutive seconds: a request of that key signed in such a
-- second may be a replay and is refused. api_key '*' stands for every key (spans kept by schema
-- version 3). (Version 4.)
CREATE TABLE IF NOT EXISTS nonce_records (
    seq      INTEGER PRIMARY KEY,
    api_key  TEXT NOT NULL,
    nonce    TEXT NOT NULL,
    ts       INTEGER NOT NULL,
    UNIQUE (api_key, nonce)
);
CREATE TABLE IF NOT EXISTS nonces_forgotten (
    api_key  TEXT NOT NULL,
    lo       INTEGER NOT NULL,  -- a run of consecutive forgotten seconds, lo to hi; runs of a key
    hi       INTEGER NOT NULL,  -- never overlap nor touch
    CHECK (lo <= hi)
);
CREATE INDEX IF NOT EXISTS nonces_forgotten_by_key ON nonces_forgotten (api_key, lo);

-- Past the count, the oldest records become digests before they are forgotten (a frozen clock
-- puts every request in one second: forgetting its records at once would refuse every fresh
-- request of that second): 64 bits of (key, nonce), still refused as used, kept in record order
-- (seq) up to ten times the count. Each batch made digests notes its keys' seconds (upto: the
-- batch's last digest); they join nonces_forgotten when the batch's digests are dropped. (Version 5.)
CREATE TABLE IF NOT EXISTS nonce_digests (
    seq     INTEGER PRIMARY KEY,
    digest  INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS nonce_digests_by_digest ON nonce_digests (digest);
CREATE TABLE IF NOT EXISTS nonce_digest_seconds (
    upto     INTEGER NOT NULL,
    api_key  TEXT NOT NULL,
    ts       INTEGER NOT NULL,
    PRIMARY KEY (upto, api_key, ts)
) WITHOUT ROWID;

-- What controls the sandbox (docs/sandbox.md), shared by every process on this
-- file: the clock (frozen at an epoch second, or real time plus an offset),
-- the id sequence (a seed and how many ids and secrets were drawn from it) and
-- the fault rules' count and version (bumped on every change, so that a
-- process knows when its copy of the rules is stale). One row. (Version 3.)
CREATE TABLE IF NOT EXISTS sandbox (
    clock_frozen_at  REAL,
    clock_offset     REAL NOT NULL,
    id_seed          INTEGER,
    id_drawn         INTEGER NOT NULL,
    fault_rules      INTEGER NOT NULL,
    fault_version    INTEGER NOT NULL,
    fault_next       INTEGER NOT NULL,
    has_start        INTEGER NOT NULL,
    journal_floor    INTEGER NOT NULL
);
INSERT INTO sandbox (clock_frozen_at, clock_offset, id_seed, id_drawn, fault_rules, fault_version,
                     fault_next, has_start, journal_floor)
    SELECT NULL, 0, NULL, 0, 0, 0, 0, 0, 0 WHERE NOT EXISTS (SELECT 1 FROM sandbox);

-- The admin token of a sandbox served from a scenario without --admin-token
-- (docs/sandbox.md): drawn at random once per database, never derived from
-- anything a key holder knows, so that every process and restart on this file
-- agrees. One row at most. (Version 5.)
CREATE TABLE IF NOT EXISTS admin_token (
    token  TEXT NOT NULL CHECK (length(token) BETWEEN 1 AND 256)
);

-- The console's sessions (docs/sandbox.md, The console), until they expire or log
-- out: kept here, so that a logout holds in every process serving the file.
-- (Version 5.)
CREATE TABLE IF NOT EXISTS console_sessions (
    nonce    TEXT PRIMARY KEY,
    expires  INTEGER NOT NULL
) WITHOUT ROWID;

-- Fault rules in force, in the order they are tried; rule is the rule as JSON.
CREATE TABLE IF NOT EXISTS fault_rules (
    id     INTEGER PRIMARY KEY,
    rule   TEXT NOT NULL,
    times  INTEGER,
    fired  INTEGER NOT NULL DEFAULT 0
);

-- The request journal: one row per request to /api/, oldest first by seq.
-- Each field a client controls is capped when written, so a row is bounded.
-- seq only grows: emptied, the journal goes on from sandbox.journal_floor.
CREATE TABLE IF NOT EXISTS journal (
    seq            INTEGER PRIMARY KEY,
    at             INTEGER NOT NULL,
    method         TEXT NOT NULL,
    path           BLOB NOT NULL,
    query          TEXT NOT NULL,
    api_key        TEXT,
    status         INTEGER NOT NULL,
    code           TEXT,
    canonical      BLOB,
    signature      TEXT NOT NULL,
    replayed       INTEGER NOT NULL,
    headers        TEXT NOT NULL,
    body           BLOB NOT NULL,
    response_body  BLOB NOT NULL,
    elapsed_ms     REAL NOT NULL,
    diagnosis      TEXT
);

-- pending is the money held by PENDING outgoing transfers; the last line of
-- defence against an overdraft is here: available = balance - pending >= 0.
CREATE TABLE IF NOT EXISTS wallets (
    id            TEXT PRIMARY KEY,
    workspace_id  TEXT NOT NULL REFERENCES workspaces (id),
    name          TEXT NOT NULL CHECK (length(name) <= 200),
    currency      TEXT NOT NULL CHECK (length(currency) = 3),
    status        TEXT NOT NULL CHECK (status IN ('ACTIVE', 'FROZEN', 'CLOSED')),
    balance       INTEGER NOT NULL DEFAULT 0 CHECK (typeof(balance) = 'integer' AND balance >= 0),
    pending       INTEGER NOT NULL DEFAULT 0 CHECK (typeof(pending) = 'integer' AND pending >= 0 AND pending <= balance),
    created_at    INTEGER NOT NULL,
    updated_at    INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS wallets_by_created ON wallets (workspace_id, created_at, id);
CREATE INDEX IF NOT EXISTS wallets_by_updated ON wallets (workspace_id, updated_at, id);
CREATE INDEX IF NOT EXISTS wallets_by_name ON wallets (workspace_id, name, id);
CREATE INDEX IF NOT EXISTS wallets_by_currency ON wallets (workspace_id, currency, id);
CREATE INDEX IF NOT EXISTS wallets_by_status ON wallets (workspace_id, status, id);
CREATE INDEX IF NOT EXISTS wallets_by_balance ON wallets (workspace_id, balance, id);

-- biz_id is the caller's idempotency key, unique per workspace.
CREATE TABLE IF NOT EXISTS transfers (
    id                TEXT PRIMARY KEY,
    workspace_id      TEXT NOT NULL REFERENCES workspaces (id),
    biz_id            TEXT NOT NULL,
    source_wallet_id  TEXT NOT NULL REFERENCES wallets (id),
    target_wallet_id  TEXT NOT NULL REFERENCES wallets (id),
    amount            INTEGER NOT NULL CHECK (amount > 0),
    currency          TEXT NOT NULL CHECK (length(currency) = 3),
    status            TEXT NOT NULL CHECK (status IN ('PENDING', 'COMPLETED', 'FAILED')),
    description       TEXT CHECK (description IS NULL OR length(description) <= 255),
    created_at        INTEGER NOT NULL,
    updated_at        INTEGER NOT NULL,
    completed_at      INTEGER,
    settle_at         INTEGER,
    CHECK (source_wallet_id <> target_wallet_id),
    UNIQUE (workspace_id, biz_id)
);
CREATE INDEX IF NOT EXISTS transfers_by_created ON transfers (workspace_id, created_at, id);
CREATE INDEX IF NOT EXISTS transfers_by_updated ON transfers (workspace_id, updated_at, id);
CREATE INDEX IF NOT EXISTS transfers_by_amount ON transfers (workspace_id, amount, id);
CREATE INDEX IF NOT EXISTS transfers_by_status ON transfers (workspace_id, status, created_at, id);
CREATE INDEX IF NOT EXISTS transfers_by_source ON transfers (source_wallet_id, created_at, id);
CREATE INDEX IF NOT EXISTS transfers_by_target ON transfers (target_wallet_id, created_at, id);
CREATE INDEX IF NOT EXISTS transfers_due ON transfers (settle_at) WHERE settle_at IS NOT NULL;

-- One immutable row per balance change; the sum of a wallet's signed flows
-- equals its balance.
CREATE TABLE IF NOT EXISTS flows (
    id                      TEXT PRIMARY KEY,
    wallet_id               TEXT NOT NULL REFERENCES wallets (id),
    type                    TEXT NOT NULL CHECK (type IN ('DEPOSIT', 'WITHDRAWAL', 'TRANSFER_OUT', 'TRANSFER_IN')),
    direction               TEXT NOT NULL CHECK (direction IN ('DEBIT', 'CREDIT')),
    amount                  INTEGER NOT NULL CHECK (amount > 0),
    balance_after           INTEGER NOT NULL CHECK (balance_after >= 0),
    transfer_id             TEXT REFERENCES transfers (id),
    biz_id                  TEXT,
    counterparty_wallet_id  TEXT,
    created_at              INTEGER NOT NULL,
    CHECK ((direction = 'CREDIT') = (type IN ('DEPOSIT', 'TRANSFER_IN')))
);
CREATE INDEX IF NOT EXISTS flows_by_created ON flows (wallet_id, created_at, id);
CREATE INDEX IF NOT EXISTS flows_by_amount ON flows (wallet_id, amount, id);
CREATE INDEX IF NOT EXISTS flows_by_type ON flows (wallet_id, type, created_at, id);

-- Row counts kept in step with the rows by triggers, so that a list's
-- totalElements costs one lookup instead of a scan of a million rows.
-- owner_id is a workspace or a wallet; name is 'transfers',
-- 'transfers:<STATUS>', 'flows' or 'flows:<TYPE>'.
CREATE TABLE IF NOT EXISTS counters (
    owner_id  TEXT NOT NULL,
    name      TEXT NOT NULL,
    n         INTEGER NOT NULL CHECK (n >= 0),
    PRIMARY KEY (owner_id, name)
) WITHOUT ROWID;

CREATE TRIGGER IF NOT EXISTS transfers_counted AFTER INSERT ON transfers BEGIN
    INSERT INTO counters VALUES (NEW.workspace_id, 'transfers', 1)
        ON CONFLICT DO UPDATE SET n = n + 1;
    INSERT INTO counters VALUES (NEW.workspace_id, 'transfers:' || NEW.status, 1)
        ON CONFLICT DO UPDATE SET n = n + 1;
    INSERT INTO counters VALUES (NEW.source_wallet_id, 'transfers', 1)
        ON CONFLICT DO UPDATE SET n = n + 1;
    INSERT INTO counters VALUES (NEW.source_wallet_id, 'transfers:' || NEW.status, 1)
        ON CONFLICT DO UPDATE SET n = n + 1;
    INSERT INTO counters VALUES (NEW.target_wallet_id, 'transfers', 1)
        ON CONFLICT DO UPDATE SET n = n + 1;
    INSERT INTO counters VALUES (NEW.target_wallet_id, 'transfers:' || NEW.status, 1)
        ON CONFLICT DO UPDATE SET n = n + 1;
END;

CREATE TRIGGER IF NOT EXISTS transfers_recounted AFTER UPDATE OF status ON transfers
WHEN OLD.status <> NEW.status BEGIN
    UPDATE counters SET n = n - 1
        WHERE owner_id IN (OLD.workspace_id, OLD.source_wallet_id, OLD.target_wallet_id)
          AND name = 'transfers:' || OLD.status;
    INSERT INTO counters VALUES (NEW.workspace_id, 'transfers:' || NEW.status, 1)
        ON CONFLICT DO UPDATE SET n = n + 1;
    INSERT INTO counters VALUES (NEW.source_wallet_id, 'transfers:' || NEW.status, 1)
        ON CONFLICT DO UPDATE SET n = n + 1;
    INSERT INTO counters VALUES (NEW.target_wallet_id, 'transfers:' || NEW.status, 1)
        ON CONFLICT DO UPDATE SET n = n + 1;
END;

CREATE TRIGGER IF NOT EXISTS flows_counted AFTER INSERT ON flows BEGIN
    INSERT INTO counters VALUES (NEW.wallet_id, 'flows', 1)
        ON CONFLICT DO UPDATE SET n = n + 1;
    INSERT INTO counters VALUES (NEW.wallet_id, 'flows:' || NEW.type, 1)
        ON CONFLICT DO UPDATE SET n = n + 1;
END;

-- The starting state that reset returns to (docs/sandbox.md): a copy of every row
-- of the sandbox's world, taken by WalletService.save_start(). (Version 3.)
CREATE TABLE IF NOT EXISTS start_workspaces AS SELECT * FROM workspaces WHERE 0;
CREATE TABLE IF NOT EXISTS start_members AS SELECT * FROM members WHERE 0;
CREATE TABLE IF NOT EXISTS start_api_keys AS SELECT * FROM api_keys WHERE 0;
CREATE TABLE IF NOT EXISTS start_wallets AS SELECT * FROM wallets WHERE 0;
CREATE TABLE IF NOT EXISTS start_transfers AS SELECT * FROM transfers WHERE 0;
CREATE TABLE IF NOT EXISTS start_flows AS SELECT * FROM flows WHERE 0;
CREATE TABLE IF NOT EXISTS start_counters AS SELECT * FROM counters WHERE 0;
CREATE TABLE IF NOT EXISTS start_ledger_clock AS SELECT * FROM ledger_clock WHERE 0;
CREATE TABLE IF NOT EXISTS start_sandbox AS
    SELECT clock_frozen_at, clock_offset, id_seed, id_drawn FROM sandbox WHERE 0;

-- Each workspace's rows as they were when its world began (a scenario
-- instantiated, or the starting state saved), as JSON {table: [row, ...]}:
-- WalletService.reset_workspace restores them. (Version 3.)
CREATE TABLE IF NOT EXISTS world_starts (
    workspace_id  TEXT PRIMARY KEY,
    rows          TEXT NOT NULL
);

-- The scenario the sandbox started from (JSON), so that every process makes the
-- same world again for POST /_admin/scenarios. One row at most. (Version 3.)
CREATE TABLE IF NOT EXISTS start_scenario (
    body  TEXT NOT NULL
);
