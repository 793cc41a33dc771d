-- Workspaces become something a tenant manages. A workspace is the cache-isolation scope
-- inside a tenant (every block hash carries it) and, from here on, a unit of limits and usage:
--   * renamed, and archived: archiving revokes its keys in the same transaction and keeps
--     its name taken; its usage stays in the ledger;
--   * limits of its own, on top of the tenant's (NULL is none).
-- The default workspace (the one every tenant is created with, named 'default') can be
-- neither renamed nor archived: keys created without a workspace go there.
ALTER TABLE workspaces
    ADD COLUMN archived_at               TIMESTAMPTZ,
    ADD COLUMN requests_per_minute       BIGINT CHECK (requests_per_minute > 0),
    ADD COLUMN input_tokens_per_minute   BIGINT CHECK (input_tokens_per_minute > 0),
    ADD COLUMN output_tokens_per_minute  BIGINT CHECK (output_tokens_per_minute > 0),
    -- Spend per calendar month (UTC) in minor units of the tenant's currency.
    ADD COLUMN monthly_budget_minor      BIGINT CHECK (monthly_budget_minor >= 0);

CREATE INDEX api_keys_workspace ON api_keys (workspace_id);
-- Exports and dashboards filtered by workspace read the ledger by it.
CREATE INDEX usage_events_workspace_started ON usage_events (workspace_id, started_at);
