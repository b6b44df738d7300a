#!/usr/bin/env bash
# `make image`: build deploy/Dockerfile into the local image localhost/kproxy:<version> with Debian's own container
# tools, no container registry (none is reachable here). Used by the Makefile and by tests/integration/test_image.py.
#
# 1. The base: a minimal Debian 12 root filesystem made by mmdebstrap from the Debian archive, imported as
#    localhost/kproxy-debian:bookworm-<hash of how it is made>. Made once per machine (~25 s), then reused.
# 2. The image: `buildah bud --layers` with that base as the Dockerfile's BASE. Layers are cached in the machine's
#    container storage, so a rebuild after a code change redoes only the last layer (kproxy itself).
# 3. Skipped altogether when the image's label io.kproxy.inputs already matches a hash of everything that goes in
#    (the Dockerfile, the pinned requirements, kproxy's files, the base, the git revision).
#
# Prints the image reference on the last line of stdout. Needs root and the packages scripts/setup.sh installs.
# KPROXY_IMAGE overrides the reference, KPROXY_IMAGE_SOURCE the source label. PIP_INDEX_URL is passed to the build when it is an http(s) address (the
# build's pip otherwise uses the public package index), and PIP_CERT (or the machine's pip.conf `cert`) as a CA
# bundle mounted for the build only.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -n1)
IMAGE=${KPROXY_IMAGE:-localhost/kproxy:$VERSION}
SUITE=bookworm
MIRRORS=("deb http://deb.debian.org/debian $SUITE main"
         "deb http://deb.debian.org/debian $SUITE-updates main"
         "deb http://deb.debian.org/debian-security $SUITE-security main")
# Like Debian's slim images: no manuals, docs (but their copyright files) or translations, in the base and in every
# package the Dockerfile installs on top (the dpkg setting stays in the base).
DEBSTRAP_OPTS=(--variant=minbase --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr
               --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*'
               --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright'
               --dpkgopt='path-exclude=/usr/share/locale/*'
               --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/* "$1"/var/log/*')

say() { echo "image: $*" >&2; }

if [ "$(id -u)" != 0 ]; then
    say "building and running containers here needs root"; exit 1
fi
for tool in podman buildah mmdebstrap runc; do
    command -v "$tool" >/dev/null || { say "$tool is missing: run scripts/setup.sh (make setup)"; exit 1; }
done

# One build at a time on this machine (make image and a test session may race).
exec 9>/run/kproxy-image.lock
flock 9

t0=$EPOCHREALTIME
elapsed() { awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }

# --- 1. the base -------------------------------------------------------------------------------------------------
base_hash=$(printf '%s\n' "$SUITE" "${MIRRORS[@]}" "${DEBSTRAP_OPTS[@]}" | sha256sum | cut -c1-12)
BASE=localhost/kproxy-debian:$SUITE-$base_hash
if podman image exists "$BASE"; then
    say "base $BASE cached"
else
    say "making the base $BASE with mmdebstrap from the Debian archive"
    tmp=$(mktemp -d /var/tmp/kproxy-base.XXXXXX)
    trap 'rm -rf "$tmp"' EXIT
    mmdebstrap --quiet "${DEBSTRAP_OPTS[@]}" "$SUITE" "$tmp/base.tar" "${MIRRORS[@]}" >&2
    podman import --quiet --change 'CMD ["/bin/bash"]' \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        "$tmp/base.tar" "$BASE" >/dev/null
    rm -rf "$tmp"; trap - EXIT
    say "base made in $(elapsed) s"
fi

# --- 2. the image ------------------------------------------------------------------------------------------------
REVISION=$(git rev-parse HEAD 2>/dev/null || echo unknown)
INPUTS=(deploy/Dockerfile deploy/requirements.txt pyproject.toml README.md kproxy backends bpf)
if [ "$REVISION" != unknown ] && [ -n "$(git status --porcelain -- "${INPUTS[@]}" 2>/dev/null)" ]; then
    REVISION="$REVISION-dirty"
fi
# where the source lives: KPROXY_IMAGE_SOURCE, else the clone's origin when it is a web address (a CI clone's origin
# is a local path), else the project's home
SOURCE=${KPROXY_IMAGE_SOURCE:-$(git config --get remote.origin.url 2>/dev/null || true)}
case "$SOURCE" in https://*|http://*) ;; *) SOURCE=https://github.com/kproxy/kproxy ;; esac
inputs_hash=$( {
    printf '%s\n' "$BASE" "$VERSION" "$REVISION" "$SOURCE"
    find "${INPUTS[@]}" \( -name __pycache__ -o -name '*.egg-info' \) -prune -o \( -type f -o -type l \) -print \
        | LC_ALL=C sort | while IFS= read -r f; do
            if [ -L "$f" ]; then printf '%s -> %s\n' "$f" "$(readlink "$f")"; else sha256sum "$f"; fi
        done
} | sha256sum | cut -c1-16)

current=$(podman image inspect --format '{{ index .Labels "io.kproxy.inputs" }}' "$IMAGE" 2>/dev/null || true)
if [ "$current" = "$inputs_hash" ]; then
    say "$IMAGE is up to date (inputs $inputs_hash)"
    echo "$IMAGE"; exit 0
fi
old_id=$(podman image inspect --format '{{.Id}}' "$IMAGE" 2>/dev/null || true)

build_args=(--build-arg "BASE=$BASE" --build-arg "VERSION=$VERSION" --build-arg "REVISION=$REVISION"
            --build-arg "SOURCE=$SOURCE")
case "${PIP_INDEX_URL:-}" in http://*|https://*) build_args+=(--build-arg "PIP_INDEX_URL=$PIP_INDEX_URL") ;; *) ;; esac
# A TLS-inspecting proxy between here and the package index (as on this machine) needs the machine's CA bundle:
# it is mounted into the build's RUN steps only, never copied into the image.
volumes=()
cert=${PIP_CERT:-$(sed -n 's/^cert *= *//p' /etc/xdg/pip/pip.conf /etc/pip.conf 2>/dev/null | head -n1)}
if [ -n "$cert" ] && [ -f "$cert" ]; then
    volumes+=(--volume "$(readlink -f "$cert"):/run/kproxy-build-ca.crt:ro")
    build_args+=(--build-arg PIP_CERT=/run/kproxy-build-ca.crt)
fi
# the same facts as OCI annotations on the manifest (the LABELs above are the image config's)
annotations=()
for kv in "version=$VERSION" "revision=$REVISION" "source=$SOURCE" "title=kproxy"; do
    annotations+=(--annotation "org.opencontainers.image.$kv")
done

say "building $IMAGE (revision $REVISION)"
buildah bud --quiet --isolation chroot --layers --format oci --pull-never \
    -f deploy/Dockerfile "${build_args[@]}" "${volumes[@]}" "${annotations[@]}" \
    --label "io.kproxy.inputs=$inputs_hash" -t "$IMAGE" . >&2
# the image it replaced, unless something still uses it (cached layers are kept: they make the next build quick)
new_id=$(podman image inspect --format '{{.Id}}' "$IMAGE")
if [ -n "$old_id" ] && [ "$old_id" != "$new_id" ]; then
    podman rmi "$old_id" >/dev/null 2>&1 || true
fi
size=$(podman image inspect --format '{{.Size}}' "$IMAGE")
say "built $IMAGE in $(elapsed) s: $((size / 1000000)) MB"
echo "$IMAGE"
