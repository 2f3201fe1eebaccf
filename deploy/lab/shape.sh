#!/usr/bin/env bash
# Shapes the links between the lab's containers like a datacenter's: a qdisc on each container's
# eth0 (its egress), set from the host inside the container's network namespace (nsenter; the
# images carry no tc): `netem` for a delay or loss (with the rate), `tbf` for a rate alone.
# A container-to-container packet crosses the sender's: a delay of D ms adds D per direction,
# 2*D per round trip. Kernels without sch_netem (some VMs) take --rate alone only.
#
#   deploy/lab/shape.sh [--delay MS] [--rate RATE] [--loss PCT] [SERVICE...]
#   deploy/lab/shape.sh --clear [SERVICE...]
#   deploy/lab/shape.sh --show [SERVICE...]
#
# RATE as tc writes it (e.g. 1gbit, 100mbit); SERVICE compose names (default: every running
# container of the lab). A restarted container comes back unshaped: run it again. Root only.
set -euo pipefail
PROJECT=pdserve-lab
DOCKER=${DOCKER:-/usr/bin/docker}
delay="" rate="" loss="" mode=set services=()
while (($#)); do
  case $1 in
    --delay) delay=$2; shift 2 ;;
    --rate) rate=$2; shift 2 ;;
    --loss) loss=$2; shift 2 ;;
    --clear) mode=clear; shift ;;
    --show) mode=show; shift ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    -*) echo "shape: unknown option $1" >&2; exit 2 ;;
    *) services+=("$1"); shift ;;
  esac
done
qdisc=()
[[ -n $delay ]] && qdisc+=(delay "${delay}ms")
[[ -n $loss ]] && qdisc+=(loss "${loss}%")
if ((${#qdisc[@]})); then
  qdisc=(netem "${qdisc[@]}")
  [[ -n $rate ]] && qdisc+=(rate "$rate")
elif [[ -n $rate ]]; then
  qdisc=(tbf rate "$rate" burst 256kb latency 100ms)
elif [[ $mode == set ]]; then
  echo "shape: give --delay, --rate and/or --loss (or --clear, --show)" >&2
  exit 2
fi

filter=(--filter "label=com.docker.compose.project=$PROJECT")
if ((${#services[@]})); then
  ids=()
  for s in "${services[@]}"; do
    id=$("$DOCKER" ps -q "${filter[@]}" --filter "label=com.docker.compose.service=$s")
    [[ -n $id ]] || { echo "shape: no running lab container for $s" >&2; exit 1; }
    ids+=("$id")
  done
else
  mapfile -t ids < <("$DOCKER" ps -q "${filter[@]}")
fi
((${#ids[@]})) || { echo "shape: the lab runs no container (make lab)" >&2; exit 1; }

for id in "${ids[@]}"; do
  name=$("$DOCKER" inspect -f '{{index .Config.Labels "com.docker.compose.service"}}' "$id")
  pid=$("$DOCKER" inspect -f '{{.State.Pid}}' "$id")
  tc=(nsenter -t "$pid" -n tc)
  case $mode in
    set)
      if ! err=$("${tc[@]}" qdisc replace dev eth0 root "${qdisc[@]}" 2>&1); then
        [[ $err == *"qdisc kind is unknown"* ]] &&
          err="$err (this kernel has no sch_${qdisc[0]}: --delay and --loss need netem; --rate alone uses tbf)"
        echo "shape: $name: $err" >&2
        exit 1
      fi
      ;;
    clear)
      if "${tc[@]}" qdisc show dev eth0 | grep -qE 'qdisc (netem|tbf)'; then
        "${tc[@]}" qdisc del dev eth0 root
      fi
      ;;
  esac
  echo "$name: $("${tc[@]}" qdisc show dev eth0 | head -1)"
done
