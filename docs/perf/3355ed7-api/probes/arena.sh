#!/bin/bash
# usage: arena.sh BEFORE_WORKTREE AFTER_WORKTREE  (each a checkout with its own .venv: ccf932e and a4602ef's code);
# needs a network namespace kpt-probe with lo up. Runs the probe twice per tree, alternately.
probe="$(cd "$(dirname "$0")" && pwd)/daemonprobe.py"
for i in 1 2; do
for d in "$1" "$2"; do
  cd "$d"
  echo "== $d run $i $(date +%T)"
  ip netns exec kpt-probe .venv/bin/python -P "$probe" 100000 nftables 2>&1 | grep "healthy\|final"
done; done
