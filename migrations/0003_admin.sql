-- The admin console: tenant lifecycle, key expiry and rotation, tenant policy, admin users and
-- sessions, the audit log (which is also the change feed every gateway and node follows), and
-- counts of refused requests per limit.

-- A suspended tenant's keys are refused (403) until it is resumed. A deleted tenant keeps its
-- ledger rows; its keys are revoked and its cache purged. A deleted tenant's name may be
-- used again by a new tenant.
ALTER TABLE tenants ADD COLUMN suspended_at TIMESTAMPTZ;
ALTER TABLE tenants DROP CONSTRAINT tenants_name_key;
CREATE UNIQUE INDEX tenants_live_name ON tenants (name) WHERE deleted_at IS NULL;

-- Keys: an optional expiry (a rotated key's expiry is the end of its grace period), when the
-- key was last used (written in batches, to within a minute), and the key a rotation made.
ALTER TABLE api_keys ADD COLUMN expires_at TIMESTAMPTZ;
ALTER TABLE api_keys ADD COLUMN last_used_at TIMESTAMPTZ;
ALTER TABLE api_keys ADD COLUMN rotated_to UUID REFERENCES api_keys (id);

-- One row per rotation request. Retrying a rotation with the same idempotency key returns the
-- same new key: its secret is derived again from `secret_seed` (HMAC under the server's admin
-- secret) and checked against the new key's hash, so no secret is ever stored. The seed is
-- erased after the replay window (24 h); a retry after that gets the key id without its secret.
CREATE TABLE api_key_rotations (
    old_key_id       UUID NOT NULL REFERENCES api_keys (id),
    idempotency_key  TEXT NOT NULL CHECK (length(idempotency_key) BETWEEN 1 AND 255),
    new_key_id       UUID NOT NULL REFERENCES api_keys (id),
    grace_until      TIMESTAMPTZ NOT NULL,
    secret_seed      BYTEA CHECK (length(secret_seed) = 32),
    created_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    created_by       TEXT NOT NULL,
    PRIMARY KEY (old_key_id, idempotency_key)
);

-- Tenant policy beside the rate limits: a monthly spend budget (minor units of the tenant's
-- currency; NULL = none) with the share of it at which an alert is raised, whether `1h` cache
-- TTLs may be written, and how many fabric nodes hold each block (NULL = the cluster's
-- default). Reserved cache bytes are part of the tenant's plan (billed), see tenant_plans.
ALTER TABLE tenant_quotas ADD COLUMN monthly_budget_minor BIGINT CHECK (monthly_budget_minor >= 0);
ALTER TABLE tenant_quotas ADD COLUMN budget_alert_percent SMALLINT NOT NULL DEFAULT 80
    CHECK (budget_alert_percent BETWEEN 1 AND 100);
ALTER TABLE tenant_quotas ADD COLUMN allow_1h_ttl BOOLEAN NOT NULL DEFAULT true;
ALTER TABLE tenant_quotas ADD COLUMN replication_factor SMALLINT
    CHECK (replication_factor BETWEEN 1 AND 16);

-- People who administer Cachet. Passwords are argon2id PHC strings; there is no default user
-- and no default password (`cachet admin user create` makes the first one). A tenant_admin
-- administers exactly one tenant; the other roles none.
CREATE TABLE admin_users (
    id              UUID PRIMARY KEY,
    username        TEXT NOT NULL UNIQUE CHECK (username ~ '^[A-Za-z0-9._@+-]{1,128}$'),
    password_hash   TEXT NOT NULL,
    role            TEXT NOT NULL CHECK (role IN ('platform_admin', 'tenant_admin', 'finance')),
    tenant_id       UUID REFERENCES tenants (id),
    created_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    created_by      TEXT NOT NULL,
    disabled_at     TIMESTAMPTZ,
    -- Consecutive failed logins, reset by a successful one; past a threshold the user is
    -- locked until locked_until, and every failure pushes the next allowed attempt back.
    failed_logins   INTEGER NOT NULL DEFAULT 0,
    last_failed_at  TIMESTAMPTZ,
    locked_until    TIMESTAMPTZ,
    last_login_at   TIMESTAMPTZ,
    CHECK ((role = 'tenant_admin') = (tenant_id IS NOT NULL))
);

-- A login: its refresh token is stored as SHA-256 only and replaced at every refresh; the
-- short-lived access tokens name the session (`sid`), which logout revokes.
CREATE TABLE admin_sessions (
    id              UUID PRIMARY KEY,
    user_id         UUID NOT NULL REFERENCES admin_users (id),
    refresh_sha256  BYTEA NOT NULL UNIQUE CHECK (length(refresh_sha256) = 32),
    created_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    refreshed_at    TIMESTAMPTZ NOT NULL DEFAULT now(),
    expires_at      TIMESTAMPTZ NOT NULL,
    revoked_at      TIMESTAMPTZ
);
CREATE INDEX admin_sessions_user ON admin_sessions (user_id);

-- Every administrative change (and every login, logout and lockout): who, what, the object
-- before and after, when. Never a secret. Append-only. Gateways and nodes follow it by id
-- (about once a second) to apply changes without a restart.
CREATE TABLE admin_audit (
    id          BIGSERIAL PRIMARY KEY,
    at          TIMESTAMPTZ NOT NULL DEFAULT now(),
    actor       TEXT NOT NULL,
    actor_role  TEXT,
    tenant_id   UUID,
    action      TEXT NOT NULL,
    target      TEXT,
    before      JSONB,
    after       JSONB,
    request_id  TEXT
);
CREATE INDEX admin_audit_tenant ON admin_audit (tenant_id, id);
CREATE INDEX admin_audit_at ON admin_audit (at);
CREATE FUNCTION admin_audit_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'admin_audit is append-only';
END;
$$;
CREATE TRIGGER admin_audit_append_only BEFORE UPDATE OR DELETE ON admin_audit
    FOR EACH ROW EXECUTE FUNCTION admin_audit_append_only();

-- Requests refused at admission, per tenant, hour, key and limit (requests_per_minute,
-- key_input_tokens_per_minute, monthly_budget, ...). Gateways add their counts every few
-- seconds.
CREATE TABLE admission_refusals (
    tenant_id     UUID NOT NULL,
    bucket_start  TIMESTAMPTZ NOT NULL,
    api_key_id    UUID NOT NULL,
    limit_name    TEXT NOT NULL,
    refusals      BIGINT NOT NULL CHECK (refusals >= 0),
    PRIMARY KEY (tenant_id, bucket_start, limit_name, api_key_id)
);
