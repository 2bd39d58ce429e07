#!/usr/bin/env bash
# Builds the Docker base image of clawgym's sandboxes, locally and never pulled:
# `debootstrap` a minimal Debian bookworm and `docker import` it. Idempotent: an image
# already tagged with this package list is kept (about 70 s the first time).
#
#   scripts/docker_base_image.sh          # prints the tag it built or found
#
# Needs root, debootstrap and docker.io. When no daemon answers it starts `dockerd` for
# the build and stops it afterwards. The tag is `clawgym/sandbox-base:<hash>`, where the
# hash covers the package list below; envs/sandbox/docker.py computes the same tag.
set -euo pipefail

suite=bookworm
mirror="${CLAWGYM_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
# Keep in sync with envs/sandbox/docker.py (BASE_PACKAGES): the tag is their hash.
packages="bash,coreutils,findutils,grep,sed,gawk,diffutils,procps,psmisc,file,bc,jq,tree,less,lsof,hashdeep,zip,unzip,bzip2,xz-utils,gzip,tar,cpio,python3,python3-pytest,git,ca-certificates"
tag="clawgym/sandbox-base:$(printf '%s %s' "$suite" "$packages" | sha256sum | cut -c1-12)"

log() { printf '[docker-base] %s\n' "$*" >&2; }

started_pid=""
stop_started() {
    if [ -n "$started_pid" ]; then
        kill "$started_pid" 2>/dev/null || true
        wait "$started_pid" 2>/dev/null || true
    fi
}
trap stop_started EXIT

if ! docker info >/dev/null 2>&1; then
    [ "$(id -u)" = 0 ] || { log "no Docker daemon answers and not root: cannot start one"; exit 1; }
    log "starting dockerd for the build"
    dockerd >/tmp/clawgym-dockerd-build.log 2>&1 &
    started_pid=$!
    for _ in $(seq 1 100); do
        docker info >/dev/null 2>&1 && break
        sleep 0.2
    done
    docker info >/dev/null 2>&1 || { log "dockerd did not start (see /tmp/clawgym-dockerd-build.log)"; exit 1; }
fi

if docker image inspect "$tag" >/dev/null 2>&1; then
    log "image $tag already built"
    echo "$tag"
    exit 0
fi

command -v debootstrap >/dev/null || { log "debootstrap is not installed"; exit 1; }
rootfs=$(mktemp -d /tmp/clawgym-rootfs.XXXXXX)
trap 'rm -rf "$rootfs"; stop_started' EXIT
log "debootstrap $suite into $rootfs (about a minute)"
debootstrap --variant=minbase --include="$packages" "$suite" "$rootfs" "$mirror" \
    >/tmp/clawgym-debootstrap.log 2>&1 || { log "debootstrap failed (see /tmp/clawgym-debootstrap.log)"; exit 1; }
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
tar -C "$rootfs" -c . | docker import \
    --change 'CMD ["/bin/bash"]' --change 'ENV LANG=C.UTF-8' - "$tag" >/dev/null
log "built $tag"
echo "$tag"
