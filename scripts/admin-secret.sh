#!/usr/bin/env bash
# The finance API's token secret for `make run`: made once (48 random bytes, base64url) and
# kept in .cachet/admin-jwt-secret (mode 600), then printed.
set -euo pipefail
f=.cachet/admin-jwt-secret
if [ ! -s "$f" ]; then
  mkdir -p .cachet
  umask 077
  python3 -c 'import secrets; print(secrets.token_urlsafe(48))' > "$f"
fi
cat "$f"
