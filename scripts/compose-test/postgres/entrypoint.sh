#!/usr/bin/env bash
# The official postgres image's contract, for the compose test: on an empty PGDATA, initdb
# with POSTGRES_USER (default postgres) as the superuser and POSTGRES_PASSWORD as its
# password (scram-sha-256 over TCP), create POSTGRES_DB (default: the user's name); then
# run the command (`postgres [OPTIONS]`) as the postgres user.
set -euo pipefail

if [[ "${1:-}" == -* ]]; then
  set -- postgres "$@"
fi
if [[ "${1:-}" != postgres ]]; then
  exec "$@"
fi

: "${PGDATA:=/var/lib/postgresql/data}"
: "${POSTGRES_USER:=postgres}"
: "${POSTGRES_DB:=$POSTGRES_USER}"
export PGDATA

if [[ "$(id -u)" == 0 ]]; then
  mkdir -p "$PGDATA" /var/run/postgresql
  chown postgres:postgres "$PGDATA" /var/run/postgresql
  chmod 0700 "$PGDATA"
  exec setpriv --reuid=postgres --regid=postgres --init-groups "$0" "$@"
fi

if [[ ! -s "$PGDATA/PG_VERSION" ]]; then
  if [[ -z "${POSTGRES_PASSWORD:-}" ]]; then
    echo "postgres: POSTGRES_PASSWORD is not set" >&2
    exit 1
  fi
  pwfile="$(mktemp)"
  printf '%s\n' "$POSTGRES_PASSWORD" > "$pwfile"
  initdb --username="$POSTGRES_USER" --pwfile="$pwfile" --auth-local=trust \
    --auth-host=scram-sha-256 --encoding=UTF8 >/dev/null
  rm -f "$pwfile"
  printf '%s\n' "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
  if [[ "$POSTGRES_DB" != postgres ]]; then
    # A server on the socket only, for the setup.
    pg_ctl -D "$PGDATA" -o "-c listen_addresses=''" -w start >/dev/null
    createdb --username="$POSTGRES_USER" --owner="$POSTGRES_USER" "$POSTGRES_DB"
    pg_ctl -D "$PGDATA" -m fast -w stop >/dev/null
  fi
  echo "postgres: initialised $PGDATA (user $POSTGRES_USER, database $POSTGRES_DB)" >&2
fi
exec "$@"
