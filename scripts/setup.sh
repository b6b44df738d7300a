#!/usr/bin/env bash
# Idempotent set-up of a fresh Debian 12 machine for kproxy: distro packages, the bcc headers link, bpffs, and a
# --system-site-packages venv (so Debian's bcc and libnftables bindings import) holding kproxy and its dev extras.
# Run as root. Every step checks before it acts, so a second run changes nothing and takes a second or two.
set -euo pipefail
cd "$(dirname "$0")/.."

PKGS=(iptables nftables python3-nftables bpfcc-tools python3-bpfcc bpftool linux-headers-amd64 conntrack iproute2
      python3-venv iperf3 wrk socat iputils-ping kubectl
      # the container image (make image, tests/integration/test_image.py): built with buildah on a base made by
      # mmdebstrap from the Debian archive (no registry), run with podman on runc (crun refuses this machine's
      # hybrid cgroup layout); as root, the kernel's overlayfs serves as storage, so no fuse-overlayfs
      podman buildah mmdebstrap runc)

if [ "$(id -u)" != 0 ]; then
    echo "setup: kproxy programs the kernel and its tests make network namespaces: run as root" >&2
    exit 1
fi

missing=()
for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "setup: installing Debian packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# bcc looks for headers under /lib/modules/$(uname -r)/{build,source}; Debian splits them in two folders.
K=$(uname -r)
if [ ! -e "/lib/modules/$K/build" ]; then
    arch=$(ls -d /usr/src/linux-headers-*-amd64 2>/dev/null | sort -V | tail -n1)
    common=$(ls -d /usr/src/linux-headers-*-common 2>/dev/null | sort -V | tail -n1)
    if [ -n "$arch" ] && [ -n "$common" ]; then
        mkdir -p "/lib/modules/$K"
        ln -sfn "$arch" "/lib/modules/$K/build"
        ln -sfn "$common" "/lib/modules/$K/source"
        echo "setup: linked bcc headers for $K"
    fi
fi

if ! mountpoint -q /sys/fs/bpf; then
    mount -t bpf bpf /sys/fs/bpf && echo "setup: mounted bpffs"
fi

if [ ! -x .venv/bin/python ]; then
    /usr/bin/python3 -m venv --system-site-packages .venv
fi
# Reinstall only when the project's metadata changed since the last install.
stamp=.venv/.kproxy-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    .venv/bin/pip install -q --disable-pip-version-check -e '.[dev]'
    touch "$stamp"
fi
