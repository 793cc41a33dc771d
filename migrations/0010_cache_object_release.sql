-- Deleting a cache object frees its blocks on every node and tier (issue 27, decision 0027).
--
-- An object keeps the hashes of its prefix's blocks (its chain, 32 bytes each, in order, the
-- tail of a partial last block included): what every node releases when the object is
-- deleted, without rendering its content again, and how the other live objects of a scope
-- say which of those blocks they still hold. Objects made before this column are NULL: a
-- deletion leaves their blocks to expire, and as "other objects" they are taken to hold
-- every block of their model in their scope.
ALTER TABLE cache_objects
    ADD COLUMN block_hashes BYTEA
        CHECK (block_hashes IS NULL OR (length(block_hashes) > 0 AND length(block_hashes) % 32 = 0));

-- The tombstones are the deleted rows themselves: a node that was down when an object was
-- deleted releases, at start and before it serves, every deleted object not yet expired.
CREATE INDEX cache_objects_deleted_unexpired ON cache_objects (expires_at)
    WHERE deleted_at IS NOT NULL;

-- One row per deleted object and node that released it: what it freed and what other
-- entries of the scope still hold there. The deletion's answer sums them once every live
-- node has written its row. A node that applies a release again (after a restart, whose disk
-- tier brought blocks back) adds what it freed then.
CREATE TABLE cache_object_releases (
    object_id       TEXT NOT NULL REFERENCES cache_objects (id),
    node            TEXT NOT NULL CHECK (length(node) BETWEEN 1 AND 256),
    blocks_freed    BIGINT NOT NULL CHECK (blocks_freed >= 0),
    bytes_freed     BIGINT NOT NULL CHECK (bytes_freed >= 0),
    blocks_held     BIGINT NOT NULL CHECK (blocks_held >= 0),
    bytes_held      BIGINT NOT NULL CHECK (bytes_held >= 0),
    released_at     TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (object_id, node)
);
