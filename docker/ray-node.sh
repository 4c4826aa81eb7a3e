#!/usr/bin/env bash
# A Ray node of compose.yaml's `ray` profile (the loraplex image built with EXTRAS=ray).
#
#   ray-node.sh head                      the head: Ray's GCS on LORAPLEX_RAY_PORT, no CPUs
#                                         of its own (replicas go to the workers); blocks
#   ray-node.sh worker                    a worker: joins LORAPLEX_RAY_ADDRESS with
#                                         RAY_WORKER_CPUS CPUs for engine replicas; blocks
#   ray-node.sh gateway [SERVE OPTIONS]   joins as a node without CPUs (a Ray driver needs a
#                                         raylet of its own), then becomes the image's entry
#                                         point: `loraplex serve ... SERVE OPTIONS`
#
# Environment: RAY_AUTH_TOKEN (required: every node of the cluster authenticates with it),
# LORAPLEX_RAY_ADDRESS (the head, host:port), LORAPLEX_RAY_PORT (the head's GCS port, 6380),
# RAY_WORKER_CPUS (1), RAY_OBJECT_STORE_BYTES (256 MiB: only control messages cross it),
# LORAPLEX_RAY_NODE_IP (empty: Ray's own choice, this container's address on the compose
# network), LORAPLEX_RAY_CLIENT_PORT (the head's Ray Client port, 10001).
# Every other port a node opens is chosen free at random: the nodes may share one network
# namespace (the compose test runs them all on the host's loopback).
set -euo pipefail

log() { printf 'ray-node: %s\n' "$*" >&2; }

role=${1:?usage: ray-node.sh head|worker|gateway [SERVE OPTIONS...]}
shift
if [[ -z "${RAY_AUTH_TOKEN:-}" ]]; then
  log "RAY_AUTH_TOKEN is not set: set it in .env (see .env.example)"
  exit 2
fi
# Token authentication on every node. (Not RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, which keeps
# a single-node Ray on loopback: it refuses worker nodes.)
export RAY_AUTH_MODE=token

port=${LORAPLEX_RAY_PORT:-6380}
address=${LORAPLEX_RAY_ADDRESS:-ray-head:$port}
common=(--disable-usage-stats --object-store-memory="${RAY_OBJECT_STORE_BYTES:-268435456}"
        --dashboard-agent-listen-port=0 --min-worker-port=0 --max-worker-port=0)
[[ -n "${LORAPLEX_RAY_NODE_IP:-}" ]] && common+=(--node-ip-address="$LORAPLEX_RAY_NODE_IP")

wait_for_head() {  # the GCS port answers (compose starts the nodes together)
  local host=${address%:*} head_port=${address##*:} deadline=$((SECONDS + ${LORAPLEX_RAY_WAIT_S:-120}))
  until (exec 3<>"/dev/tcp/$host/$head_port") 2>/dev/null; do
    if (( SECONDS >= deadline )); then log "the Ray head $address does not answer"; exit 1; fi
    sleep 1
  done
}

case $role in
  head)
    exec ray start --head --block --port="$port" --num-cpus=0 --include-dashboard=false \
      --ray-client-server-port="${LORAPLEX_RAY_CLIENT_PORT:-10001}" "${common[@]}"
    ;;
  worker)
    wait_for_head
    exec ray start --block --address="$address" --num-cpus="${RAY_WORKER_CPUS:-1}" "${common[@]}"
    ;;
  gateway)
    wait_for_head
    log "joining the Ray cluster at $address (no CPUs: the replicas run on the workers)"
    ray start --address="$address" --num-cpus=0 "${common[@]}" >/dev/null
    export LORAPLEX_RAY_ADDRESS=$address
    exec /app/docker/entrypoint.sh "$@"
    ;;
  *)
    log "unknown role $role (head, worker or gateway)"
    exit 2
    ;;
esac
