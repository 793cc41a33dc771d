-- Retiring a scheduled price, and budget alerts that reach people.
--
-- Prices stay append-only. Retiring a list-price version withdraws it before it takes effect
-- (a version already in force is replaced by a newer one instead, so every rated line stays
-- reproducible); the retirement is its own row, and rating reads `price_book`, the versions
-- not retired.
CREATE TABLE price_retirements (
    model           TEXT NOT NULL,
    effective_from  TIMESTAMPTZ NOT NULL,
    retired_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    retired_by      TEXT NOT NULL,
    PRIMARY KEY (model, effective_from),
    FOREIGN KEY (model, effective_from) REFERENCES prices (model, effective_from)
);

CREATE VIEW price_book AS
    SELECT p.* FROM prices p
    WHERE NOT EXISTS (SELECT 1 FROM price_retirements r
                      WHERE r.model = p.model AND r.effective_from = p.effective_from);

-- Where a tenant's alerts are sent: an HTTP(S) endpoint and the secret its deliveries are
-- signed with (HMAC-SHA-256; shown once at creation, kept because every delivery signs with
-- it).
CREATE TABLE webhook_endpoints (
    id           UUID PRIMARY KEY,
    tenant_id    UUID NOT NULL REFERENCES tenants (id),
    url          TEXT NOT NULL CHECK (length(url) BETWEEN 8 AND 2000),
    secret       TEXT NOT NULL,
    created_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
    created_by   TEXT NOT NULL,
    disabled_at  TIMESTAMPTZ
);
CREATE INDEX webhook_endpoints_tenant ON webhook_endpoints (tenant_id);

-- A budget threshold crossed: once per tenant (or workspace), month and threshold. The id
-- is the event's (`budget:<tenant>:<workspace or tenant>:<YYYY-MM>:<percent>`), so however
-- many processes notice the crossing, it is recorded (and sent) once.
CREATE TABLE budget_alerts (
    event_id        TEXT PRIMARY KEY,
    tenant_id       UUID NOT NULL,
    workspace_id    UUID,
    period_start    DATE NOT NULL,
    percent         INTEGER NOT NULL CHECK (percent BETWEEN 1 AND 100),
    spent_minor     BIGINT NOT NULL,
    limit_minor     BIGINT NOT NULL,
    currency        TEXT NOT NULL,
    at              TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX budget_alerts_tenant ON budget_alerts (tenant_id, at);

-- One delivery of one event to one endpoint, retried with backoff until the endpoint answers
-- 2xx or the attempts run out. The delivery log of the console reads this table.
CREATE TABLE webhook_deliveries (
    id               BIGSERIAL PRIMARY KEY,
    endpoint_id      UUID NOT NULL REFERENCES webhook_endpoints (id),
    tenant_id        UUID NOT NULL,
    event_id         TEXT NOT NULL,
    event_type       TEXT NOT NULL,
    payload          JSONB NOT NULL,
    created_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    -- pending | delivered | failed (attempts ran out)
    state            TEXT NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'delivered', 'failed')),
    attempts         INTEGER NOT NULL DEFAULT 0,
    next_attempt_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    last_status      INTEGER,
    last_error       TEXT,
    delivered_at     TIMESTAMPTZ,
    UNIQUE (endpoint_id, event_id)
);
CREATE INDEX webhook_deliveries_due ON webhook_deliveries (next_attempt_at) WHERE state = 'pending';
CREATE INDEX webhook_deliveries_tenant ON webhook_deliveries (tenant_id, created_at);
