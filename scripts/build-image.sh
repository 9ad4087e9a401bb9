#!/usr/bin/env bash
# Builds duet's OCI image with buildah (Debian's `buildah`; as root, with the vfs storage driver
# and chroot isolation, so no container engine or daemon is needed) from the Containerfile: the
# release binaries on `scratch` with exactly the shared libraries they load. Produces the tagged
# image localhost/duet:VERSION (localhost/duet:VERSION-cuda with --gpu) in buildah's storage and
# an oci-archive file, target/image/duet-VERSION[-cuda].oci.tar, and prints the archive's path.
#
#   scripts/build-image.sh [--gpu] [--repository NAME] [--profile NAME]
#
#   --gpu             the GPU variant: adds NVRTC and cuBLAS (CUDA 13.0) from their PyPI wheels;
#                     the NVIDIA driver comes from the host
#   --repository NAME image name to tag (default: localhost/duet; env DUET_IMAGE_REPOSITORY)
#   --profile NAME    the cargo profile whose binaries go in (default: release; env
#                     DUET_BUILD_PROFILE; the test suite uses its `ci` build)
#
# Uses target/PROFILE/ as built by `cargo build --profile PROFILE --locked --workspace --bins
# --features cuda` (run first, a no-op when up to date). Load the archive elsewhere with e.g.
# `skopeo copy oci-archive:FILE docker://REGISTRY/duet:TAG` or `podman load -i FILE`.
set -euo pipefail
cd "$(dirname "$0")/.."
variant=cpu
repository=${DUET_IMAGE_REPOSITORY:-localhost/duet}
profile=${DUET_BUILD_PROFILE:-release}
while [ $# -gt 0 ]; do
  case "$1" in
    --gpu) variant=gpu ;;
    --repository) repository=$2; shift ;;
    --profile) profile=$2; shift ;;
    -h|--help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
command -v buildah >/dev/null || { echo "buildah is required (apt-get install buildah)" >&2; exit 1; }
buildah=(buildah --storage-driver vfs)

cargo build --profile "$profile" --locked --workspace --bins --features cuda >&2
target=target/$profile
[ "$profile" != dev ] || target=target/debug # where cargo puts the dev profile
bins=(duet duet-router duet-prefill duet-decode)
version=$("$target/duet" --version | awk '{print $2}')
tag=$version
[ "$variant" = gpu ] && tag=$version-cuda

context=$(mktemp -d)
trap 'rm -rf "$context"' EXIT
rootfs=$context/rootfs
mkdir -p "$rootfs/usr/local/bin" "$rootfs/usr/local/lib/duet" "$rootfs/bin" "$rootfs/etc" "$rootfs/models"
mkdir -m 1777 "$rootfs/tmp"
# Without the line tables (the release profile's debug = 1): a fifth of the size; symbols stay,
# so backtraces still name functions.
for b in "${bins[@]}"; do
  install -m 755 "$target/$b" "$rootfs/usr/local/bin/"
  strip --strip-debug "$rootfs/usr/local/bin/$b"
done

# The GPU variant's CUDA libraries (NVRTC also dlopens its builtins library, so take the folder).
cuda_libs=()
if [ "$variant" = gpu ]; then
  for dir in "$(./scripts/fetch-nvrtc.sh)" "$(./scripts/fetch-cublas.sh)"; do
    for lib in "$dir"/*.so*; do
      cp "$lib" "$rootfs/usr/local/lib/duet/"
      cuda_libs+=("$rootfs/usr/local/lib/duet/$(basename "$lib")")
    done
  done
fi

# Exactly the shared libraries the binaries and CUDA libraries link (ldd resolves them on this
# build machine), each at the path ldd names, plus the dynamic loader. libcuda is the host's.
needed=$(
  for f in "${bins[@]/#/$rootfs/usr/local/bin/}" "${cuda_libs[@]}"; do
    LD_LIBRARY_PATH=$rootfs/usr/local/lib/duet ldd "$f"
  done | awk -v ours="$rootfs/" '
    /not found/ && $1 !~ /^libcuda\.so/ { print "MISSING " $1; next }
    $2 == "=>" && $3 ~ /^\// && index($3, ours) != 1 { print $3 }
    $1 ~ /^\// { print $1 }' | sort -u
)
if grep -q '^MISSING' <<<"$needed"; then
  echo "libraries not found on this machine: $(grep '^MISSING' <<<"$needed" | cut -d' ' -f2 | tr '\n' ' ')" >&2
  exit 1
fi
for lib in $needed; do
  mkdir -p "$rootfs$(dirname "$lib")"
  cp -L "$lib" "$rootfs$lib"
done

busybox=$(command -v busybox || true)
[ -n "$busybox" ] && ! ldd "$busybox" >/dev/null 2>&1 ||
  { echo "a static busybox is required (apt-get install busybox-static)" >&2; exit 1; }
install -m 755 "$busybox" "$rootfs/bin/busybox"
for applet in sh cp ls cat; do ln -s busybox "$rootfs/bin/$applet"; done
echo 'duet:x:65532:65532:duet:/nonexistent:/bin/sh' >"$rootfs/etc/passwd"
echo 'duet:x:65532:' >"$rootfs/etc/group"
echo 'hosts: files dns' >"$rootfs/etc/nsswitch.conf"

# The previous build of this tag would stay behind untagged (vfs keeps whole copies): drop it.
"${buildah[@]}" rmi "$repository:$tag" >/dev/null 2>&1 || true
"${buildah[@]}" build --isolation chroot --layers=false --build-arg "VERSION=$version" \
  --build-arg "VARIANT=$variant" -f Containerfile -t "$repository:$tag" "$context" >&2
mkdir -p target/image
archive=target/image/duet-$tag.oci.tar
rm -f "$archive"
"${buildah[@]}" push "$repository:$tag" "oci-archive:$archive:$repository:$tag" >&2
echo "built $repository:$tag ($variant), $(du -h "$archive" | cut -f1) archive" >&2
echo "$PWD/$archive"
