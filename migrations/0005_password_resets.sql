-- Accounts keep their passwords current: a user changes its own password (with the current
-- one), and a platform admin issues a one-time reset secret for a user who lost theirs. The
-- secret is shown once, stored as SHA-256 only, valid for a day and for one use; redeeming it
-- sets the new password, ends every session of the user and clears its lockout. Issuing a new
-- secret retires the user's earlier unused ones.
CREATE TABLE admin_password_resets (
    id              UUID PRIMARY KEY,
    user_id         UUID NOT NULL REFERENCES admin_users (id),
    secret_sha256   BYTEA NOT NULL UNIQUE CHECK (length(secret_sha256) = 32),
    created_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    created_by      TEXT NOT NULL,
    expires_at      TIMESTAMPTZ NOT NULL,
    -- Redeemed, or retired by a newer secret.
    used_at         TIMESTAMPTZ
);
CREATE INDEX admin_password_resets_user ON admin_password_resets (user_id);

-- When the password last changed (creation counts).
ALTER TABLE admin_users ADD COLUMN password_changed_at TIMESTAMPTZ NOT NULL DEFAULT now();
