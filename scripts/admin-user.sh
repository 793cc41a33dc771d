#!/usr/bin/env bash
# The admin console's first user for `make run`: a platform admin named `admin` whose password
# is generated once (24 random characters) and kept in .cachet/admin-password (mode 600).
# There is no default password: each checkout gets its own. Usage: admin-user.sh <cachet binary>
set -euo pipefail
bin="$1"
f=.cachet/admin-password
if [ ! -s "$f" ]; then
  mkdir -p .cachet
  umask 077
  python3 -c 'import secrets; print(secrets.token_urlsafe(18))' > "$f"
fi
if ! "$bin" admin user list | grep -q '^admin '; then
  "$bin" admin user create --username admin --role platform_admin --password-file "$f" >/dev/null
fi
