-- Cachet's first schema: tenants, workspaces, API keys, quotas, and the usage ledger.
-- Migrations are never edited once applied; changes come as new files.

-- A customer organisation: the unit of billing and quotas.
CREATE TABLE tenants (
    id          UUID PRIMARY KEY,
    name        TEXT NOT NULL UNIQUE CHECK (length(name) BETWEEN 1 AND 200),
    created_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    deleted_at  TIMESTAMPTZ
);

-- The isolation scope inside a tenant: caches are never shared across workspaces.
CREATE TABLE workspaces (
    id          UUID PRIMARY KEY,
    tenant_id   UUID NOT NULL REFERENCES tenants (id),
    name        TEXT NOT NULL CHECK (length(name) BETWEEN 1 AND 200),
    created_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    UNIQUE (tenant_id, name)
);

-- API keys. The secret is shown once at creation; only its SHA-256 is stored, plus a short
-- visible prefix so people can tell keys apart.
CREATE TABLE api_keys (
    id              UUID PRIMARY KEY,
    tenant_id       UUID NOT NULL REFERENCES tenants (id),
    workspace_id    UUID NOT NULL REFERENCES workspaces (id),
    name            TEXT NOT NULL CHECK (length(name) BETWEEN 1 AND 200),
    secret_sha256   BYTEA NOT NULL UNIQUE CHECK (length(secret_sha256) = 32),
    visible_prefix  TEXT NOT NULL,
    created_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    revoked_at      TIMESTAMPTZ
);
CREATE INDEX api_keys_tenant ON api_keys (tenant_id);

-- Per-tenant limits. NULL means unlimited. The key_* limits apply to each key of the tenant;
-- the others to the whole tenant. Cache reads never count toward input tokens per minute.
CREATE TABLE tenant_quotas (
    tenant_id                     UUID PRIMARY KEY REFERENCES tenants (id),
    requests_per_minute           BIGINT CHECK (requests_per_minute > 0),
    input_tokens_per_minute       BIGINT CHECK (input_tokens_per_minute > 0),
    output_tokens_per_minute      BIGINT CHECK (output_tokens_per_minute > 0),
    key_requests_per_minute       BIGINT CHECK (key_requests_per_minute > 0),
    key_input_tokens_per_minute   BIGINT CHECK (key_input_tokens_per_minute > 0),
    key_output_tokens_per_minute  BIGINT CHECK (key_output_tokens_per_minute > 0),
    -- Hard cap on KV bytes the tenant may keep resident in the cache fabric.
    cache_resident_bytes          BIGINT CHECK (cache_resident_bytes >= 0),
    updated_at                    TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- The usage ledger: exactly one row per request, keyed by the request id, append-only.
-- The five token classes are separate columns and each token is counted in exactly one:
--   input_tokens           uncached input (after the last cache read or write)
--   cache_write_5m_tokens  tokens written to the cache at 5-minute breakpoints
--   cache_write_1h_tokens  tokens written to the cache at 1-hour breakpoints
--   cache_read_tokens      tokens served from the cache
--   output_tokens          generated tokens
-- No foreign keys: the ledger must accept a row even while admin data changes, and ingest
-- speed matters. Rows are immutable (see the trigger below).
CREATE TABLE usage_events (
    request_id             UUID PRIMARY KEY,
    tenant_id              UUID NOT NULL,
    workspace_id           UUID NOT NULL,
    api_key_id             UUID NOT NULL,
    model                  TEXT NOT NULL,
    input_tokens           BIGINT NOT NULL CHECK (input_tokens >= 0),
    cache_write_5m_tokens  BIGINT NOT NULL CHECK (cache_write_5m_tokens >= 0),
    cache_write_1h_tokens  BIGINT NOT NULL CHECK (cache_write_1h_tokens >= 0),
    cache_read_tokens      BIGINT NOT NULL CHECK (cache_read_tokens >= 0),
    output_tokens          BIGINT NOT NULL CHECK (output_tokens >= 0),
    -- completed | client_disconnected | failed
    status                 TEXT NOT NULL CHECK (status IN ('completed', 'client_disconnected', 'failed')),
    started_at             TIMESTAMPTZ NOT NULL,
    finished_at            TIMESTAMPTZ NOT NULL,
    recorded_at            TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX usage_events_tenant_started ON usage_events (tenant_id, started_at);

CREATE FUNCTION usage_events_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'usage_events is append-only';
END;
$$;
CREATE TRIGGER usage_events_no_update_or_delete
    BEFORE UPDATE OR DELETE ON usage_events
    FOR EACH ROW EXECUTE FUNCTION usage_events_append_only();
