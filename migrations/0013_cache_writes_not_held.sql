-- Cache writes the fabric did not hold (issue 48): a breakpoint whose entry was refused is
-- not billed as a write (its tokens are charged as plain input) and says why in the response's
-- `cachet` field; these counts let the console say it too. Per tenant, hour and reason
-- (`quota`: the tenant's resident-bytes quota; `capacity`, `not_admitted`, `unavailable`,
-- `kv_budget`, ...). Gateways add their counts every few seconds.
CREATE TABLE cache_writes_not_held (
    tenant_id     UUID NOT NULL,
    bucket_start  TIMESTAMPTZ NOT NULL,
    reason        TEXT NOT NULL,
    -- Breakpoints not held, and the prompt tokens they would have written.
    breakpoints   BIGINT NOT NULL CHECK (breakpoints >= 0),
    tokens        BIGINT NOT NULL CHECK (tokens >= 0),
    PRIMARY KEY (tenant_id, bucket_start, reason)
);
