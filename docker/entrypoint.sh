#!/usr/bin/env bash
# Entry point of the loraplex image.
#
#   entrypoint.sh [SERVE OPTIONS...]   wait for the registry database, migrate it, prepare
#                                      the demo model when no model is given, then become
#                                      `loraplex serve --host 0.0.0.0 --port 8000 OPTIONS...`
#   entrypoint.sh COMMAND [ARGS...]    run COMMAND instead, e.g. `loraplex tenants list`
#
# Reads what `loraplex` reads (LORAPLEX_DATABASE_URL, LORAPLEX_REDIS_URL, LORAPLEX_MODEL,
# LORAPLEX_ADAPTER_DIR, LORAPLEX_HOME, LORAPLEX_ADMIN_KEY, ...) plus:
#   LORAPLEX_DB_WAIT_S   seconds to wait for the database to accept connections (60)
# Later options win: `entrypoint.sh --port 9000` serves on 9000.
set -euo pipefail

log() { printf 'entrypoint: %s\n' "$*" >&2; }

# Anything that is not an option is a command of its own.
if [[ $# -gt 0 && "$1" != -* ]]; then
  exec "$@"
fi

# Options given to serve that the steps before it must honour too (the CLI prefers a flag
# to the environment variable; so do we).
model="${LORAPLEX_MODEL:-}"
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  case "${args[i]}" in
    --model) model="${args[i + 1]:-}" ;;
    --model=*) model="${args[i]#--model=}" ;;
    --database-url) export LORAPLEX_DATABASE_URL="${args[i + 1]:-}" ;;
    --database-url=*) export LORAPLEX_DATABASE_URL="${args[i]#--database-url=}" ;;
  esac
done

wait_for_database() {
  # Compose starts us once PostgreSQL reports healthy; a plain `docker run` (or a database
  # restarting) may not have it yet. SQLite (the default) needs no wait.
  python - <<'PY'
import os
import sys
import time

import sqlalchemy as sa

from loraplex.registry.db import make_engine

url = os.environ.get("LORAPLEX_DATABASE_URL", "")
if not url or sa.engine.make_url(url).get_backend_name() == "sqlite":
    sys.exit(0)
wait_s = float(os.environ.get("LORAPLEX_DB_WAIT_S", "60"))
deadline = time.monotonic() + wait_s
connect_args = {"connect_timeout": 5} if url.startswith("postgresql") else {}
engine = make_engine(url, connect_args=connect_args)
last = None
try:
    while True:
        try:
            with engine.connect():
                break
        except sa.exc.OperationalError as exc:
            last = str(exc.orig or exc).strip().splitlines()[0]
        if time.monotonic() >= deadline:
            safe = sa.engine.make_url(url).render_as_string(hide_password=True)
            print(f"entrypoint: database {safe} not reachable after {wait_s:g}s: {last}",
                  file=sys.stderr)
            sys.exit(1)
        time.sleep(1)
finally:
    engine.dispose()
PY
}

log "waiting for the registry database"
wait_for_database
log "migrating the registry database"
loraplex db upgrade
if [[ -z "$model" ]]; then
  log "no LORAPLEX_MODEL: preparing the demo model (downloads it on the first start)"
  loraplex demo prepare >/dev/null
fi
log "starting loraplex serve"
exec loraplex serve --host 0.0.0.0 --port 8000 "$@"
