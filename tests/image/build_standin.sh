#!/usr/bin/env bash
# Test-only: build a local CPU stand-in of the official SGLang image (lmsysorg/sglang), which
# cannot be pulled here. Same shape as the official one: a Debian/Ubuntu root file system whose
# system `python3` imports sglang 0.5.23 (installed in /usr/local/lib/python3.X/dist-packages),
# with pip and curl. The packages are the ones `pip install sglang==0.5.23` put into the
# project's .venv (hardlinked, not downloaded again); the hsdump editable install is left out.
#
#   tests/image/build_standin.sh TAG            build TAG unless the engine already has it
#
# Environment: ENGINE (docker|podman, default docker), VENV (default .venv), CACHE (work folder,
# default .cache/image), MIRROR (Debian mirror). Needs root and debootstrap (make prereqs).
set -euo pipefail

TAG=${1:?usage: build_standin.sh TAG}
ENGINE=${ENGINE:-docker}
VENV=${VENV:-.venv}
CACHE=${CACHE:-.cache/image}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
SUITE=bookworm  # its python3 is 3.11, the .venv's minor version

pyver=$("$VENV/bin/python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
site="$VENV/lib/python$pyver/site-packages"
sglang_version=$("$VENV/bin/python" -c 'from importlib.metadata import version; print(version("sglang"))')
[ -d "$site/sglang" ] || { echo "error: $site has no sglang; run 'make venv' first" >&2; exit 1; }

# An image is reused only when this recipe built it and it still has what the official image
# has (pip, sglang at the venv's version): a tag left by an interrupted or older build, on an
# engine whose storage outlives the checkout, is rebuilt instead of failing `make image` later.
recipe=$(cat "$0" | sha256sum | cut -c1-16)
check="import pip, sys; from importlib.metadata import version; sys.exit(version('sglang') != '$sglang_version')"
healthy() {
  [ "$("$ENGINE" image inspect -f '{{ index .Config.Labels "hsdump.test.recipe" }}' "$TAG" \
       2>/dev/null)" = "$recipe-$sglang_version" ] &&
  "$ENGINE" run --rm --network none "$TAG" python3 -c "$check" >/dev/null 2>&1
}
if healthy; then
  echo "stand-in base $TAG already built"
  exit 0
fi
if "$ENGINE" image inspect "$TAG" >/dev/null 2>&1; then
  echo "stand-in base $TAG is stale or broken (another recipe, no pip or no sglang $sglang_version): rebuilding"
  "$ENGINE" rmi -f "$TAG" >/dev/null
fi

command -v debootstrap >/dev/null || { echo "error: no debootstrap; run 'make prereqs'" >&2; exit 1; }

mkdir -p "$CACHE"
os="$CACHE/rootfs-$SUITE"
include=python3,python3-pip,curl,ca-certificates
# The marker names what the root holds: a root bootstrapped with other packages is redone.
if [ "$(cat "$os/.complete" 2>/dev/null)" != "$include" ]; then
  rm -rf "$os"
  echo "debootstrap $SUITE ($include) -> $os"
  debootstrap --variant=minbase --include="$include" \
    "$SUITE" "$os" "$MIRROR" >"$CACHE/debootstrap.log" 2>&1 \
    || { tail -20 "$CACHE/debootstrap.log" >&2; exit 1; }
  rm -rf "$os"/var/cache/apt/archives/*.deb "$os"/var/lib/apt/lists/*
  echo "$include" > "$os/.complete"
fi
ospy=$(chroot "$os" python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
[ "$ospy" = "$pyver" ] || { echo "error: $SUITE has python $ospy, $VENV has $pyver" >&2; exit 1; }

# The root file system of the image: the OS plus the venv's packages as system packages.
root="$CACHE/rootfs-standin"
rm -rf "$root"
cp -a "$os" "$root"
rm -f "$root/.complete"
dist="$root/usr/local/lib/python$pyver/dist-packages"
mkdir -p "$(dirname "$dist")"
rm -rf "$dist"
# Hardlinks when the venv is on the same file system (no 11 GB copy), a copy otherwise.
cp -al "$site" "$dist" 2>/dev/null || { rm -rf "$dist"; cp -a "$site" "$dist"; }
# Not part of the official image: hsdump itself (editable install), the venv's own pip.
rm -rf "$dist"/hsdump* "$dist"/__editable__*hsdump* "$dist"/pip "$dist"/pip-*.dist-info
mkdir -p "$root/sgl-workspace"

echo "importing $TAG (sglang $sglang_version, python $pyver)"
tar -C "$root" -c . | "$ENGINE" import \
  -c 'WORKDIR /sgl-workspace' \
  -c 'CMD ["/bin/bash"]' \
  -c "LABEL org.opencontainers.image.title=\"test-only CPU stand-in of lmsysorg/sglang\" \
org.opencontainers.image.version=\"$sglang_version\" \
hsdump.test.recipe=\"$recipe-$sglang_version\"" \
  - "$TAG"
rm -rf "$root"
healthy || { echo "error: the new stand-in $TAG lacks pip or sglang $sglang_version" >&2; exit 1; }
