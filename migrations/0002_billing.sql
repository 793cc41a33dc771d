-- Billing: the price book, tenant plans, rollups, invoices and the audit of rating runs.
--
-- Money is never a float. Prices are integers: the base input and output price of a token in
-- nano-units of the currency (1e-9; $3 per million tokens = 3000), and the cache prices as
-- multipliers of the base input price in basis points (1.25x = 12500). A line's exact amount
-- is tokens x base x multiplier (NUMERIC, no rounding), discounted exactly; it is rounded once,
-- half away from zero, to the currency's minor unit (cents) when it becomes an invoice line.
-- Invoice totals are sums of rounded lines.

-- Versioned list prices per model: the row with the latest effective_from <= a request's
-- started_at prices it. Rows are never edited; a correction is a new version.
CREATE TABLE prices (
    model                TEXT NOT NULL,
    effective_from       TIMESTAMPTZ NOT NULL,
    currency             TEXT NOT NULL DEFAULT 'USD' CHECK (currency ~ '^[A-Z]{3}$'),
    input_nanos          BIGINT NOT NULL CHECK (input_nanos >= 0),
    output_nanos         BIGINT NOT NULL CHECK (output_nanos >= 0),
    cache_write_5m_bp    INTEGER NOT NULL DEFAULT 12500 CHECK (cache_write_5m_bp >= 0),
    cache_write_1h_bp    INTEGER NOT NULL DEFAULT 20000 CHECK (cache_write_1h_bp >= 0),
    cache_read_bp        INTEGER NOT NULL DEFAULT 1000 CHECK (cache_read_bp >= 0),
    created_at           TIMESTAMPTZ NOT NULL DEFAULT now(),
    created_by           TEXT NOT NULL,
    PRIMARY KEY (model, effective_from)
);

-- Custom rates for one tenant: in force from effective_from, they replace the list price of
-- that model for that tenant.
CREATE TABLE tenant_prices (
    tenant_id            UUID NOT NULL REFERENCES tenants (id),
    model                TEXT NOT NULL,
    effective_from       TIMESTAMPTZ NOT NULL,
    input_nanos          BIGINT NOT NULL CHECK (input_nanos >= 0),
    output_nanos         BIGINT NOT NULL CHECK (output_nanos >= 0),
    cache_write_5m_bp    INTEGER NOT NULL CHECK (cache_write_5m_bp >= 0),
    cache_write_1h_bp    INTEGER NOT NULL CHECK (cache_write_1h_bp >= 0),
    cache_read_bp        INTEGER NOT NULL CHECK (cache_read_bp >= 0),
    created_at           TIMESTAMPTZ NOT NULL DEFAULT now(),
    created_by           TEXT NOT NULL,
    PRIMARY KEY (tenant_id, model, effective_from)
);

-- A tenant's plan, versioned the same way: a discount on usage (basis points off every
-- usage line) and committed reserved cache bytes, billed per GB-hour whether used or not.
CREATE TABLE tenant_plans (
    tenant_id                    UUID NOT NULL REFERENCES tenants (id),
    effective_from               TIMESTAMPTZ NOT NULL,
    discount_bp                  INTEGER NOT NULL DEFAULT 0 CHECK (discount_bp BETWEEN 0 AND 10000),
    reserved_cache_bytes         BIGINT NOT NULL DEFAULT 0 CHECK (reserved_cache_bytes >= 0),
    reserved_nanos_per_gb_hour   BIGINT NOT NULL DEFAULT 0 CHECK (reserved_nanos_per_gb_hour >= 0),
    created_at                   TIMESTAMPTZ NOT NULL DEFAULT now(),
    created_by                   TEXT NOT NULL,
    PRIMARY KEY (tenant_id, effective_from)
);

-- Usage rolled up per hour and per day, per tenant x model x API key. Derived from the
-- ledger only: recomputing a window deletes and re-inserts its rows in one transaction, so it
-- always gives the same rows.
CREATE TABLE usage_rollups (
    granularity            TEXT NOT NULL CHECK (granularity IN ('hour', 'day')),
    bucket_start           TIMESTAMPTZ NOT NULL,
    tenant_id              UUID NOT NULL,
    model                  TEXT NOT NULL,
    api_key_id             UUID NOT NULL,
    requests               BIGINT NOT NULL,
    input_tokens           BIGINT NOT NULL,
    cache_write_5m_tokens  BIGINT NOT NULL,
    cache_write_1h_tokens  BIGINT NOT NULL,
    cache_read_tokens      BIGINT NOT NULL,
    output_tokens          BIGINT NOT NULL,
    computed_at            TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (granularity, bucket_start, tenant_id, model, api_key_id)
);
CREATE INDEX usage_rollups_tenant ON usage_rollups (tenant_id, granularity, bucket_start);

-- Monthly invoices. A draft is recomputed from the ledger while its month is open; once
-- finalized neither it nor its lines change (triggers below). A correction after that is an
-- adjustment, billed as a line of the tenant's next invoice.
CREATE TABLE invoices (
    id                UUID PRIMARY KEY,
    tenant_id         UUID NOT NULL REFERENCES tenants (id),
    period_start      DATE NOT NULL CHECK (extract(day FROM period_start) = 1),
    currency          TEXT NOT NULL,
    status            TEXT NOT NULL CHECK (status IN ('draft', 'finalized')),
    total_minor       BIGINT NOT NULL,
    computed_at       TIMESTAMPTZ NOT NULL,
    finalized_at      TIMESTAMPTZ,
    finalized_by      TEXT,
    UNIQUE (tenant_id, period_start)
);

CREATE TABLE invoice_lines (
    invoice_id        UUID NOT NULL REFERENCES invoices (id),
    line_no           INTEGER NOT NULL,
    -- usage | reserved | adjustment
    kind              TEXT NOT NULL CHECK (kind IN ('usage', 'reserved', 'adjustment')),
    model             TEXT,
    -- input | cache_write_5m | cache_write_1h | cache_read | output (usage lines)
    token_class       TEXT,
    price_from        TIMESTAMPTZ,
    quantity          BIGINT NOT NULL,
    -- The exact amount before rounding, in nano-units, and the rounded line amount.
    exact_nanos       NUMERIC NOT NULL,
    amount_minor      BIGINT NOT NULL,
    description       TEXT NOT NULL,
    PRIMARY KEY (invoice_id, line_no)
);

CREATE TABLE adjustments (
    id                UUID PRIMARY KEY,
    tenant_id         UUID NOT NULL REFERENCES tenants (id),
    corrects_invoice  UUID REFERENCES invoices (id),
    amount_minor      BIGINT NOT NULL,
    reason            TEXT NOT NULL,
    created_at        TIMESTAMPTZ NOT NULL DEFAULT now(),
    created_by        TEXT NOT NULL,
    -- The invoice that bills it (set when a draft takes it in; fixed once that is finalized).
    billed_on         UUID REFERENCES invoices (id)
);

-- Every price change and every (re-)rating of a period, who and when.
CREATE TABLE billing_audit (
    id          BIGSERIAL PRIMARY KEY,
    at          TIMESTAMPTZ NOT NULL DEFAULT now(),
    actor       TEXT NOT NULL,
    action      TEXT NOT NULL,
    details     JSONB NOT NULL
);

CREATE FUNCTION invoices_finalized_are_immutable() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_TABLE_NAME = 'invoices' THEN
        IF OLD.status = 'finalized' THEN
            RAISE EXCEPTION 'invoice % is finalized and cannot change', OLD.id;
        END IF;
        RETURN CASE WHEN TG_OP = 'DELETE' THEN OLD ELSE NEW END;
    END IF;
    IF EXISTS (SELECT 1 FROM invoices WHERE id = COALESCE(OLD.invoice_id, NEW.invoice_id)
               AND status = 'finalized') THEN
        RAISE EXCEPTION 'lines of a finalized invoice cannot change';
    END IF;
    RETURN CASE WHEN TG_OP = 'DELETE' THEN OLD ELSE NEW END;
END;
$$;
CREATE TRIGGER invoices_immutable BEFORE UPDATE OR DELETE ON invoices
    FOR EACH ROW EXECUTE FUNCTION invoices_finalized_are_immutable();
CREATE TRIGGER invoice_lines_immutable BEFORE INSERT OR UPDATE OR DELETE ON invoice_lines
    FOR EACH ROW EXECUTE FUNCTION invoices_finalized_are_immutable();
CREATE FUNCTION billing_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '% is append-only: add a new version instead', TG_TABLE_NAME;
END;
$$;
CREATE TRIGGER prices_append_only BEFORE UPDATE OR DELETE ON prices
    FOR EACH ROW EXECUTE FUNCTION billing_append_only();
CREATE TRIGGER tenant_prices_append_only BEFORE UPDATE OR DELETE ON tenant_prices
    FOR EACH ROW EXECUTE FUNCTION billing_append_only();
CREATE TRIGGER tenant_plans_append_only BEFORE UPDATE OR DELETE ON tenant_plans
    FOR EACH ROW EXECUTE FUNCTION billing_append_only();
CREATE TRIGGER billing_audit_append_only BEFORE UPDATE OR DELETE ON billing_audit
    FOR EACH ROW EXECUTE FUNCTION billing_append_only();
