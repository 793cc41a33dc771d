-- Ceilings and per-key limits (issue 48, decision 0036).
--
-- A platform admin's limits for a tenant are ceilings: the tenant's own limits (which its
-- tenant admins change) stay at or below them, and NULL is no ceiling. Lowering a ceiling
-- lowers the tenant's own value to it in the same transaction (a tenant value of none, no
-- limit, becomes the ceiling), and so on down: a workspace's limits stay within the
-- tenant's, a key's within its workspace's and the tenant's. The stored value of every
-- level is the one in force.
ALTER TABLE tenant_quotas
    ADD COLUMN ceiling_requests_per_minute      BIGINT CHECK (ceiling_requests_per_minute > 0),
    ADD COLUMN ceiling_input_tokens_per_minute  BIGINT CHECK (ceiling_input_tokens_per_minute > 0),
    ADD COLUMN ceiling_output_tokens_per_minute BIGINT CHECK (ceiling_output_tokens_per_minute > 0),
    ADD COLUMN ceiling_monthly_budget_minor     BIGINT CHECK (ceiling_monthly_budget_minor >= 0),
    -- false: the tenant may not allow 1h TTLs.
    ADD COLUMN ceiling_allow_1h_ttl             BOOLEAN NOT NULL DEFAULT true,
    ADD COLUMN ceiling_max_cache_ttl_secs       INTEGER
        CHECK (ceiling_max_cache_ttl_secs BETWEEN 300 AND 2592000),
    ADD COLUMN ceiling_max_concurrent           INTEGER CHECK (ceiling_max_concurrent > 0);

-- A key's own rate limits (NULL: the tenant's per-key default, key_* in tenant_quotas).
-- A key has no budget of its own: budgets are the tenant's and its workspaces'.
ALTER TABLE api_keys
    ADD COLUMN requests_per_minute       BIGINT CHECK (requests_per_minute > 0),
    ADD COLUMN input_tokens_per_minute   BIGINT CHECK (input_tokens_per_minute > 0),
    ADD COLUMN output_tokens_per_minute  BIGINT CHECK (output_tokens_per_minute > 0);
