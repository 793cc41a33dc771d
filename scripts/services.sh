#!/usr/bin/env bash
# Make sure PostgreSQL and Redis answer on their default local ports.
#
# - If DATABASE_URL / REDIS_URL are set, they are used as given and nothing is started.
# - Otherwise, if nothing answers on 127.0.0.1:5432 / :6379, a local server is started from
#   the installed Debian packages (installing them with apt-get when running as root), with
#   its data in .cachet/ of this checkout. The machine's own clusters are used when they
#   answer, or are started when they exist but are stopped.
set -euo pipefail
cd "$(dirname "$0")/.."
STATE="$PWD/.cachet"
mkdir -p "$STATE"

say() { printf 'services: %s\n' "$*" >&2; }

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

apt_install() {
  if [ "$(id -u)" -ne 0 ]; then
    say "missing packages: $* (install them with: sudo apt-get install -y $*)"
    return 1
  fi
  say "installing $*"
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

ensure_postgres() {
  if [ -n "${DATABASE_URL:-}" ]; then say "using DATABASE_URL"; return; fi
  if port_open 5432; then return; fi
  if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then apt_install postgresql; fi
  # The machine's own cluster, if it has one.
  if command -v pg_ctlcluster >/dev/null && [ -n "$(ls /etc/postgresql 2>/dev/null)" ]; then
    say "starting the installed postgresql cluster"
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | sort -V | tail -1)" main start || true
    for _ in $(seq 50); do port_open 5432 && return; sleep 0.2; done
  fi
  # A project-local cluster with trust auth on 127.0.0.1.
  local bin; bin=$(dirname "$(ls /usr/lib/postgresql/*/bin/initdb | sort -V | tail -1)")
  local data="$STATE/pg"
  local run_as=()
  if [ "$(id -u)" -eq 0 ]; then run_as=(runuser -u postgres --); chown postgres "$STATE" 2>/dev/null || true; fi
  if [ ! -f "$data/PG_VERSION" ]; then
    say "initializing a local postgres in $data"
    mkdir -p "$data"; [ "$(id -u)" -eq 0 ] && chown postgres "$data"
    "${run_as[@]}" "$bin/initdb" -D "$data" -U postgres --auth=trust >/dev/null
  fi
  say "starting local postgres (data in $data)"
  "${run_as[@]}" "$bin/pg_ctl" -D "$data" -l "$data/server.log" -o "-c listen_addresses=127.0.0.1 -p 5432 -k /tmp" -w start >/dev/null
}

ensure_redis() {
  if [ -n "${REDIS_URL:-}" ]; then say "using REDIS_URL"; return; fi
  if port_open 6379; then return; fi
  command -v redis-server >/dev/null || apt_install redis-server
  mkdir -p "$STATE/redis"
  say "starting local redis"
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
    --dir "$STATE/redis" --logfile "$STATE/redis/redis.log" >/dev/null
  for _ in $(seq 50); do port_open 6379 && return; sleep 0.1; done
  say "redis did not start; see $STATE/redis/redis.log"; return 1
}

ensure_postgres
ensure_redis
