-- Fair engines: how a tenant shares a model's engine workers with other tenants. Requests of
-- one model wait in per-tenant queues served by weighted fair queuing; a tenant with weight 2
-- gets twice the worker turns of a tenant with weight 1 while both wait. `max_concurrent`
-- caps the tenant's generations running at once per model (NULL: no cap beyond the workers).
-- The weight is the platform's to set (it is capacity); a tenant admin may cap their own
-- concurrency.
ALTER TABLE tenant_quotas
    ADD COLUMN engine_weight SMALLINT NOT NULL DEFAULT 1
        CHECK (engine_weight BETWEEN 1 AND 100),
    ADD COLUMN max_concurrent INTEGER CHECK (max_concurrent >= 1);
