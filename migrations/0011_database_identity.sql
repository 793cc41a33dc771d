-- The database's identity (issue 42, decision 0030): one row, made when the schema is first
-- applied. Every directory of usage files (journal, spool, open streams) records the identity
-- of the database it belongs to, and a meter refuses to replay files of another database into
-- this one: it keeps them aside instead. A dump restored elsewhere keeps its identity, as it
-- keeps its ledger.
CREATE TABLE database_identity (
    id         UUID        PRIMARY KEY DEFAULT gen_random_uuid(),
    created_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    -- Exactly one row.
    one        BOOLEAN     NOT NULL DEFAULT true UNIQUE CHECK (one)
);
INSERT INTO database_identity DEFAULT VALUES;
