-- Storage of cache objects, billed by the token-hour.
--
-- A cache object (0008) holds its prefix's KV for as long as the customer asked, read or not;
-- that holding is billed by the hour it lasts, at a price per token-hour. The price is a
-- multiplier of the model's base input price, in basis points per hour, like every other
-- cache price of the book: 10000 = one input token's price per token per hour held. The
-- column's default gives every version already in the book (list and custom) that price, so
-- no object's storage is ever unpriced where its model has a price.
ALTER TABLE prices
    ADD COLUMN cache_storage_hour_bp INTEGER NOT NULL DEFAULT 10000 CHECK (cache_storage_hour_bp >= 0);
ALTER TABLE tenant_prices
    ADD COLUMN cache_storage_hour_bp INTEGER NOT NULL DEFAULT 10000 CHECK (cache_storage_hour_bp >= 0);

-- A view's columns are fixed when it is made: recreated to carry the new one (0007).
CREATE OR REPLACE VIEW price_book AS
    SELECT p.* FROM prices p
    WHERE NOT EXISTS (SELECT 1 FROM price_retirements r
                      WHERE r.model = p.model AND r.effective_from = p.effective_from);

-- The storage ledger: one row per object per UTC hour it was held, with the seconds of that
-- hour it was (a whole hour, or less in its first and last). Written by whichever process's
-- storage meter gets to it first (rows of objects are claimed with SKIP LOCKED); the key makes
-- a second write of the same hour a no-op, so a replay or a race never bills it twice. Rows
-- are never changed; like `usage_events`, this is append-only.
CREATE TABLE cache_storage_events (
    object_id       TEXT NOT NULL REFERENCES cache_objects (id),
    hour_start      TIMESTAMPTZ NOT NULL CHECK (date_trunc('hour', hour_start, 'UTC') = hour_start),
    tenant_id       UUID NOT NULL REFERENCES tenants (id),
    workspace_id    UUID NOT NULL,
    api_key_id      UUID NOT NULL,
    model           TEXT NOT NULL,
    -- The object's tokens (its `input_tokens`) and the seconds of the hour it was held.
    tokens          BIGINT NOT NULL CHECK (tokens > 0),
    seconds         INTEGER NOT NULL CHECK (seconds BETWEEN 1 AND 3600),
    recorded_at     TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (object_id, hour_start)
);
CREATE INDEX cache_storage_events_tenant ON cache_storage_events (tenant_id, hour_start);
CREATE TRIGGER cache_storage_events_append_only BEFORE UPDATE OR DELETE ON cache_storage_events
    FOR EACH ROW EXECUTE FUNCTION billing_append_only();

-- How far each object's storage is metered (the end of the last hour written, or the
-- object's end once its last hour is): the meter starts from here, so it never rescans an
-- object's past.
ALTER TABLE cache_objects ADD COLUMN storage_metered_until TIMESTAMPTZ;
CREATE INDEX cache_objects_storage_due ON cache_objects ((coalesce(storage_metered_until, created_at)))
    WHERE storage_metered_until IS NULL
       OR storage_metered_until < least(expires_at, coalesce(deleted_at, 'infinity'));

-- Invoices bill storage as its own kind of line (token_class `cache_storage`, quantity in
-- token-seconds).
ALTER TABLE invoice_lines DROP CONSTRAINT invoice_lines_kind_check;
ALTER TABLE invoice_lines ADD CONSTRAINT invoice_lines_kind_check
    CHECK (kind IN ('usage', 'storage', 'reserved', 'adjustment'));
