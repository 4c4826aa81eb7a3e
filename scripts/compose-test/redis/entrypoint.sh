#!/usr/bin/env bash
# The official redis image's contract, for the compose test: options alone are given to
# redis-server; redis-server runs as the redis user; any other command runs as given.
set -euo pipefail
if [[ "${1:-}" == -* ]]; then
  set -- redis-server "$@"
fi
if [[ "${1:-}" == redis-server && "$(id -u)" == 0 ]]; then
  exec setpriv --reuid=redis --regid=redis --init-groups "$@"
fi
exec "$@"
