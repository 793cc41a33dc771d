-- Cache objects: prefixes a customer holds by id (POST /v1/caches), kept for a TTL the
-- customer chooses up to the tenant's maximum, used by naming them in `cached_content`.
--
-- The KV itself lives in the cache fabric as a paid entry held until `expires_at`; this row
-- is what the API lists and what a request naming the object renders: the content as sent
-- (tools, system, messages; `cache_control` markers removed), so a later request that sends
-- only what follows renders into the same tokens and the same block keys.

-- The longest TTL a tenant's objects (and OpenAI's 24h retention) may ask for.
ALTER TABLE tenant_quotas
    ADD COLUMN max_cache_ttl_secs INTEGER NOT NULL DEFAULT 86400
        CHECK (max_cache_ttl_secs BETWEEN 300 AND 2592000);

CREATE TABLE cache_objects (
    -- `cache_` + 24 base62 characters.
    id              TEXT PRIMARY KEY CHECK (id ~ '^cache_[0-9A-Za-z]{24}$'),
    tenant_id       UUID NOT NULL REFERENCES tenants (id),
    -- The isolation scope: only keys of this workspace see or use the object.
    workspace_id    UUID NOT NULL REFERENCES workspaces (id),
    -- The key that created it (kept when the key is later revoked).
    api_key_id      UUID NOT NULL REFERENCES api_keys (id),
    model           TEXT NOT NULL,
    -- {"tools": [...]?, "system": ...?, "messages": [...]} as validated.
    content         JSONB NOT NULL,
    -- Prompt tokens up to the object's end: what a request naming it reads.
    input_tokens    BIGINT NOT NULL CHECK (input_tokens > 0),
    display_name    TEXT CHECK (length(display_name) <= 256),
    -- The request that computed it: its usage row bills the write.
    request_id      UUID NOT NULL,
    created_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    expires_at      TIMESTAMPTZ NOT NULL CHECK (expires_at > created_at),
    deleted_at      TIMESTAMPTZ
);
-- Lists page newest first within a scope.
CREATE INDEX cache_objects_scope ON cache_objects (workspace_id, created_at DESC, id DESC);
CREATE INDEX cache_objects_tenant ON cache_objects (tenant_id, created_at DESC);
