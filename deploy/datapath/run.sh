#!/usr/bin/env bash
# The data-path probe on a real cluster (see README.md beside this file):
#   deploy/datapath/run.sh [OUTDIR]
# applies deploy/datapath (echo server + ClusterIP Service + probe Job on another node), waits for the Job, saves its
# JSON, and saves every node's kproxy /metrics (read inside each kproxy pod, which is on the host network, from
# 127.0.0.1:10249). Needs kubectl pointed at the cluster and kproxy running there (kubectl apply -k
# deploy/overlays/<mode>). The namespace kproxy-datapath is left in place; remove it with
#   kubectl delete namespace kproxy-datapath
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
ns=kproxy-datapath
mode="$(kubectl -n kube-system get ds kproxy -o jsonpath='{.metadata.labels.kproxy\.io/mode}' 2>/dev/null || true)"
out="${1:-datapath-${mode:-unknown}-$(date -u +%Y%m%dT%H%M%SZ)}"
mkdir -p "$out"

kubectl apply -k "$here" --dry-run=client -o yaml >/dev/null
kubectl delete job -n "$ns" dp-client --ignore-not-found --wait=true
kubectl apply -k "$here"
kubectl -n "$ns" rollout status deploy/dp-server --timeout=180s
kubectl -n "$ns" wait --for=condition=complete job/dp-client --timeout=660s \
  || { kubectl -n "$ns" describe job/dp-client >&2; kubectl -n "$ns" logs job/dp-client >&2 || true; exit 1; }
kubectl -n "$ns" logs job/dp-client >"$out/probe.json"

# every node's kproxy metrics, from inside its pod (127.0.0.1:10249 is the node's own loopback there)
fetch='import sys, urllib.request; sys.stdout.write(urllib.request.urlopen("http://127.0.0.1:10249/metrics", timeout=10).read().decode())'
kubectl -n kube-system get pods -l k8s-app=kproxy \
  -o jsonpath='{range .items[*]}{.metadata.name}{" "}{.spec.nodeName}{"\n"}{end}' |
while read -r pod node; do
  [ -n "$pod" ] || continue
  kubectl -n kube-system exec "$pod" -c kproxy -- python -c "$fetch" >"$out/metrics-$node.txt" \
    || echo "run.sh: could not read /metrics of $pod on $node" >&2
done
kubectl -n kube-system get ds kproxy -o yaml >"$out/kproxy-daemonset.yaml"
echo "run.sh: mode ${mode:-unknown}: wrote $out/probe.json and $(ls "$out" | grep -c '^metrics-') metrics files"
python3 - "$out/probe.json" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
print(f"client on {doc['client_node']}, server {doc['server']['pod']} on {doc['server']['pod_node']}")
print("ClusterIP / pod IP (1.0 = no cost over the pod IP; latencies inverted):")
for k, v in doc["clusterip_over_podip"].items():
    print(f"  {k:12s} {v:.2f}   clusterip {doc['medians']['clusterip'][k]:,.1f}   podip {doc['medians']['podip'][k]:,.1f}")
PY
