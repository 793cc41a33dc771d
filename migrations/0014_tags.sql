-- Tags on workspaces and keys for chargeback (issue 48): a small map of names to values
-- (`team` = `search`, `project` = `atlas`) that exports and dashboards group usage by. A key's
-- usage carries its workspace's tags with its own on top (the key's value wins). Tags are
-- read as they are now: changing a tag re-attributes past usage in later exports.
ALTER TABLE workspaces ADD COLUMN tags JSONB NOT NULL DEFAULT '{}'
    CHECK (jsonb_typeof(tags) = 'object');
ALTER TABLE api_keys ADD COLUMN tags JSONB NOT NULL DEFAULT '{}'
    CHECK (jsonb_typeof(tags) = 'object');
