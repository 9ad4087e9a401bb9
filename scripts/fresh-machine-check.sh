#!/usr/bin/env bash
# Runs the README's first command, and the build step of its second, on a fresh Debian machine
# that has only a Rust toolchain and Python 3 with pip: a Debian root made by debootstrap (with
# python3, pip and the C compiler and libc headers every Rust toolchain links with), this host's
# Rust toolchain copied in, and this checkout's working tree (tracked and untracked files, not
# target/ or models/) copied in. No protoc anywhere. In it, under chroot with a minimal PATH:
#   ./scripts/demo.sh                         (build, model fetch, `duet up`, a sample call)
#   cargo build --release --locked --workspace --bins --features cuda   (scripts/test.sh's build)
#
# Usage (as root, with debootstrap installed and Debian's mirror, crates.io and PyPI reachable):
#   scripts/fresh-machine-check.sh [ROOT]     ROOT defaults to /var/tmp/duet-fresh
# Environment: DEBIAN_SUITE (bookworm), DEBIAN_MIRROR (http://deb.debian.org/debian),
# FRESH_KEEP=1 keeps ROOT afterwards (the Debian root is reused by the next run either way;
# the copied checkout, cargo's registry and the build are made afresh each run).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
root="${1:-/var/tmp/duet-fresh}"
suite="${DEBIAN_SUITE:-bookworm}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
log() { printf '\n== %s\n' "$*"; }

[ "$(id -u)" = 0 ] || { echo "needs root (debootstrap, chroot, mounts)" >&2; exit 1; }
command -v debootstrap >/dev/null || { echo "needs debootstrap (apt-get install debootstrap)" >&2; exit 1; }

if [ ! -x "$root/usr/bin/python3" ]; then
  log "debootstrap $suite into $root"
  debootstrap --variant=minbase \
    --include=ca-certificates,python3,python3-pip,gcc,libc6-dev,procps \
    "$suite" "$root" "$mirror"
fi
# This host's network settings: its resolver, and its CA bundle (a proxy's CA, where there is one).
cp /etc/resolv.conf "$root/etc/resolv.conf"
cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"

log "copying the Rust toolchain ($(rustc --version))"
rm -rf "$root/opt/rust"
cp -a "$(rustc --print sysroot)" "$root/opt/rust"

log "copying the working tree of $repo"
rm -rf "$root/work" "$root/root/.cargo"
mkdir -p "$root/work/duet"
(cd "$repo" && git ls-files -z --cached --others --exclude-standard |
  while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done |
  tar --null -T - -cf -) | tar -xf - -C "$root/work/duet"

mounts=()
cleanup() {
  for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do umount -l "${mounts[$i]}" 2>/dev/null || true; done
  [ "${FRESH_KEEP:-0}" = 1 ] || rm -rf "$root/work" "$root/root/.cargo" "$root/opt/rust"
}
trap cleanup EXIT
for m in proc dev dev/pts sys; do
  mkdir -p "$root/$m"
  case $m in
    proc) mount -t proc proc "$root/proc" ;;
    *) mount --bind "/$m" "$root/$m" ;;
  esac
  mounts+=("$root/$m")
done

log "in the fresh root: demo, then the test suite's build"
# A clean environment: no host PATH, cargo home or proxies of this shell beyond what is passed.
env -i HOME=/root TERM=dumb LANG=C.UTF-8 \
  PATH=/opt/rust/bin:/usr/local/bin:/usr/bin:/bin \
  DUET_ROUTER_LISTEN=127.0.0.1:50951 \
  "$(command -v chroot)" "$root" /bin/bash -euo pipefail -c '
    cd /work/duet
    if command -v protoc; then echo "protoc is on PATH: not a fresh machine" >&2; exit 1; fi
    rustc --version; cargo --version; python3 --version; python3 -m pip --version
    ./scripts/demo.sh
    cargo build --release --locked --workspace --bins --features cuda
    echo "fresh machine: demo and the test build passed"
  '
