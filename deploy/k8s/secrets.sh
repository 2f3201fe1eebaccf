#!/bin/sh
# Makes the Secrets the manifests in deploy/k8s mount, in namespace pdserve:
#   pdserve-certs       the CA certificate and one certificate per service identity
#   pdserve-node-certs  the CA certificate and one certificate per Kubernetes node (the storage
#                       nodes' identities: a node's id is its Kubernetes node's name)
#   pdserve-api-key     the router's API key, from $PDSERVE_API_KEY
#   pdserve-metrics-key the key every metrics port takes (Prometheus sends it: the PodMonitor),
#                       from $PDSERVE_METRICS_KEY, else the API key
#
#   export PDSERVE_API_KEY=$(openssl rand -hex 16)
#   deploy/k8s/secrets.sh [DIR]
#
# DIR (default ./pdserve-certs) keeps the CA: ca.key signs identities, so keep it off the
# cluster and safe; run the script again (same DIR) to re-issue certificates from the same CA,
# e.g. after Kubernetes nodes joined. Needs `pdserve` (or $PDSERVE) and kubectl. In production,
# issue the same subjects (OU = role, CN = name; `pdserve certs --help`) from your own CA.
set -eu
: "${PDSERVE_API_KEY:?set PDSERVE_API_KEY to the router's API key (e.g. openssl rand -hex 16)}"
DIR=${1:-pdserve-certs}
NS=pdserve
PDSERVE=${PDSERVE:-pdserve}

certs() { "$PDSERVE" certs --out "$DIR" "$@" >/dev/null; }
apply_secret() { kubectl -n "$NS" create secret generic "$@" --dry-run=client -o yaml | kubectl apply -f -; }

# Each identity is valid for the names its peers dial: the Service name (and <name>.<namespace>);
# the workers' and the KV masters' pods for <pod>.<service>.<namespace>, their StatefulSet's DNS
# names (both masters hold one identity: meta lets only it register the master a leader is).
certs --host meta.pdserve meta:meta
certs --host kvstore-master.pdserve --host "*.kvstore-master.pdserve" master:kvstore-master
certs --host "*.prefill.pdserve" worker:prefill
certs --host "*.decode.pdserve" worker:decode
certs --host router.pdserve router:router
certs admin:admin  # for you: `pdserve health` and `pdserve status` through kubectl port-forward

# One storage node identity per Kubernetes node, valid for the node's InternalIP (the storage
# node binds it: hostNetwork).
kubectl get nodes -o jsonpath='{range .items[*]}{.metadata.name}{" "}{.status.addresses[?(@.type=="InternalIP")].address}{"\n"}{end}' >"$DIR/nodes.txt"
node_files=""
while read -r node ip; do
  certs --host "$ip" "node:$node"
  node_files="$node_files --from-file=$DIR/$node.crt --from-file=$DIR/$node.key"
done <"$DIR/nodes.txt"

apply_secret pdserve-certs --from-file="$DIR/ca.crt" \
  --from-file="$DIR/meta.crt" --from-file="$DIR/meta.key" \
  --from-file="$DIR/kvstore-master.crt" --from-file="$DIR/kvstore-master.key" \
  --from-file="$DIR/prefill.crt" --from-file="$DIR/prefill.key" \
  --from-file="$DIR/decode.crt" --from-file="$DIR/decode.key" \
  --from-file="$DIR/router.crt" --from-file="$DIR/router.key"
# shellcheck disable=SC2086 # one word per flag
apply_secret pdserve-node-certs --from-file="$DIR/ca.crt" $node_files
printf %s "$PDSERVE_API_KEY" | apply_secret pdserve-api-key --from-file=api-key=/dev/stdin
printf %s "${PDSERVE_METRICS_KEY:-$PDSERVE_API_KEY}" |
  apply_secret pdserve-metrics-key --from-file=metrics-key=/dev/stdin
