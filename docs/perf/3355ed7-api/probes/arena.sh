#!/bin/bash
for i in 1 2; do
for d in /work/wt/b-ccf932e /work/main; do
  cd $d
  echo "== $d run $i $(date +%T)"
  ip netns exec kpt-probe .venv/bin/python -P /work/bench/s14/daemonprobe.py 100000 nftables 2>&1 | grep "healthy\|final"
done; done
