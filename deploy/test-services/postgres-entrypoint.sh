#!/bin/sh
# The official postgres image's start in short: a cluster made on first start with the
# superuser's password from POSTGRES_PASSWORD, password logins from anywhere, then postgres
# in the foreground. Any other command runs as given (redis-server, …).
set -eu
if [ "${1:-}" != postgres ]; then
  exec "$@"
fi
D=/var/lib/postgresql/data
mkdir -p "$D" /run/postgresql
chown postgres:postgres "$D" /run/postgresql
chmod 700 "$D"
if [ ! -s "$D/PG_VERSION" ]; then
  : "${POSTGRES_PASSWORD:?POSTGRES_PASSWORD must be set}"
  pw=$(mktemp)
  printf '%s\n' "$POSTGRES_PASSWORD" >"$pw"
  chown postgres "$pw"
  su postgres -c "initdb -D $D --username=postgres --pwfile=$pw --auth-local=trust --auth-host=scram-sha-256" >/dev/null
  rm -f "$pw"
  echo "host all all all scram-sha-256" >>"$D/pg_hba.conf"
  echo "listen_addresses = '*'" >>"$D/postgresql.conf"
fi
exec su postgres -c "exec postgres -D $D"
