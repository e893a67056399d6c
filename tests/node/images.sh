#!/usr/bin/env bash
# Builds the node's images without a Docker engine or a registry, into build/node-e2e/images/*.tar
# (docker-archive files that `ctr images import` loads):
# - the Dockerfiles' base, python:3.11.7-slim-bookworm, stood in for by a Debian bookworm root file
#   system (debootstrap --variant=minbase, Debian's python3 3.11, pip and venv) under the same name;
# - Dockerfile.init and Dockerfile.sidecar, built as they are by buildah (vfs storage, chroot isolation;
#   their pip steps reach PyPI), tagged as manifests/hami-patch names them;
# - the pod sandbox (pause) image: the static program in tests/node/pause, alone.
# Incremental: a step whose output exists and is newer than its inputs is skipped.
# NODE_E2E_DEBIAN_MIRROR: the Debian mirror for debootstrap (default: the first URIs of this machine's apt sources).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
build=$repo/build/node-e2e
out=$build/images
mkdir -p "$out"
export PATH=/usr/local/go/bin:$PATH

base_name=docker.io/library/python:3.11.7-slim-bookworm
init_name=$(grep -ho 'image: .*hami-initcheck:[^ ]*' "$repo/manifests/hami-patch/patch.yaml" | head -1 | cut -d' ' -f2)
sidecar_name=$(grep -ho 'image: .*hami-sidecar:[^ ]*' "$repo/manifests/hami-patch/patch.yaml" | head -1 | cut -d' ' -f2)
pause_name=${NODE_E2E_PAUSE_IMAGE:-localhost/node-e2e/pause:1}
# HAMi's plugin needs a GPU: the stand-in's image is the sidecar's plus the test rig (Dockerfile.standin).
standin_name=${sidecar_name%/*}/hami-standin:${sidecar_name##*:}

mirror=${NODE_E2E_DEBIAN_MIRROR:-}
if [ -z "$mirror" ]; then
  mirror=$(grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | head -1 | awk '{print $2}')
  [ -n "$mirror" ] || mirror=$(grep -hs '^deb ' /etc/apt/sources.list | head -1 | awk '{print $2}')
fi
[ -n "$mirror" ] || { echo "error: set NODE_E2E_DEBIAN_MIRROR (no Debian mirror in the apt sources)"; exit 1; }

bah() { buildah --storage-driver vfs --root "$build/buildah" --runroot "$build/buildah-run" "$@"; }

# Is $1 missing or older than any of the files under the other arguments?
stale() {
  local target=$1
  shift
  [ -e "$target" ] || return 0
  [ -n "$(find "$@" -newer "$target" -not -path '*/__pycache__*' -print -quit 2>/dev/null)" ]
}

# 1. The base root file system and image.
if [ ! -e "$build/rootfs.done" ]; then
  rm -rf "$build/rootfs"
  echo "debootstrap bookworm from $mirror"
  debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,python-is-python3,ca-certificates \
    bookworm "$build/rootfs" "$mirror" > "$build/debootstrap.log" 2>&1 || {
    tail -20 "$build/debootstrap.log"
    exit 1
  }
  # The python image's pip installs into its own Python; Debian marks its Python as apt's.
  rm -f "$build"/rootfs/usr/lib/python3*/EXTERNALLY-MANAGED
  rm -rf "$build"/rootfs/var/cache/apt/archives/*.deb "$build"/rootfs/var/lib/apt/lists/*
  touch "$build/rootfs.done"
fi
if ! bah inspect --type image "$base_name" > /dev/null 2>&1; then
  c=$(bah from scratch)
  m=$(bah mount "$c")
  tar -C "$build/rootfs" -cf - . | tar -C "$m" -xf -
  bah umount "$c" > /dev/null
  bah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --env LANG=C.UTF-8 \
    --cmd python3 "$c"
  bah commit --quiet "$c" "$base_name" > /dev/null
  bah rm "$c" > /dev/null
fi

# 2. The project's images, from its Dockerfiles. Their RUN steps see this machine's certificate store
# (a bind mount during the build, not a layer), so pip reaches PyPI through whatever proxy the machine
# trusts.
trust=(--volume /etc/ssl/certs:/etc/ssl/certs:ro)
build_image() { # dockerfile name tar inputs... [-- build arguments...]
  local dockerfile=$1 name=$2 tar=$3 args=()
  shift 3
  local inputs=()
  while (($#)) && [ "$1" != -- ]; do inputs+=("$1"); shift; done
  (($#)) && shift && args=("$@")
  set -- "${inputs[@]}"
  if stale "$out/$tar" "$repo/$dockerfile" "$@"; then
    echo "buildah bud -f $dockerfile -t $name"
    (cd "$repo" && bah bud --quiet --pull=never --isolation chroot --layers=false "${trust[@]}" "${args[@]}" -f "$dockerfile" \
      -t "$name" .) > "$build/$tar.log" 2>&1 || {
      tail -30 "$build/$tar.log"
      exit 1
    }
    rm -f "$out/$tar"
    bah push --quiet "$name" "docker-archive:$out/$tar.tmp:$name"
    mv "$out/$tar.tmp" "$out/$tar"
  fi
}
build_image Dockerfile.init "$init_name" init.tar "$repo/hami_guard" "$repo/initcheck" "$repo/images" "$repo/requirements" \
  "$repo/.dockerignore"
build_image Dockerfile.sidecar "$sidecar_name" sidecar.tar "$repo/hami_guard" "$repo/initcheck" "$repo/sidecar" "$repo/doctor" \
  "$repo/requirements" "$repo/pyproject.toml" "$repo/.dockerignore"
build_image tests/node/Dockerfile.standin "$standin_name" standin.tar "$out/sidecar.tar" "$repo/testing" \
  -- --build-arg "SIDECAR_IMAGE=$sidecar_name"

# 3. The pause image.
if stale "$out/pause.tar" "$here/pause"; then
  (cd "$here" && CGO_ENABLED=0 go build -buildvcs=false -ldflags '-s -w' -o "$build/pause" ./pause)
  c=$(bah from scratch)
  bah copy "$c" "$build/pause" /pause > /dev/null
  bah config --entrypoint '["/pause"]' "$c"
  bah commit --quiet "$c" "$pause_name" > /dev/null
  bah rm "$c" > /dev/null
  rm -f "$out/pause.tar"
  bah push --quiet "$pause_name" "docker-archive:$out/pause.tar.tmp:$pause_name"
  mv "$out/pause.tar.tmp" "$out/pause.tar"
fi
echo "images: $out ($init_name, $sidecar_name, $standin_name, $pause_name)"
