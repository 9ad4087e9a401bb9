#!/usr/bin/env bash
# The deployment tests, all offline (there is no Kubernetes API server or container engine here):
#  - the Helm chart (deploy/helm/duet): `helm lint --strict`; `helm template` with the default,
#    CPU, GPU and external-etcd values, each validated by `kubernetes-validate --strict` against
#    the Kubernetes 1.29 and 1.33 schemas and diffed against the rendering committed under
#    deploy/helm/rendered/ (so a chart change shows in review); bad values refused by the schema
#    with a message;
#  - the OCI image (scripts/build-image.sh, buildah): built from the release binaries, then, inside
#    it, `duet --version`, `duet generate` on the tiny fixture (the same tokens as outside), and the
#    `helm test` pod's own command against a `duet up --processes` run from the image's binaries
#    (it must get tokens, and must fail with no router); the GPU variant's CUDA libraries must find
#    every library they link inside the image.
# Prints one PASS/FAIL line per check and a closing count; exits non-zero on any failure.
#   scripts/test-deploy.sh [--update]   --update rewrites deploy/helm/rendered/ instead of diffing
set -uo pipefail
cd "$(dirname "$0")/.."
update=false
[ "${1:-}" = --update ] && update=true
tools=$(./scripts/fetch-chart-tools.sh) || exit 1
PATH=$tools:$PATH
chart=deploy/helm/duet
rendered=deploy/helm/rendered
work=$(mktemp -d "${TMPDIR:-/tmp}/duet-deploy-test.XXXXXX")
trap 'rm -rf "$work"' EXIT

passed=0 failed=0
pass() { echo "PASS $1"; passed=$((passed + 1)); }
fail() { echo "FAIL $1"; [ -z "${2:-}" ] || sed 's/^/    /' <<<"$2"; failed=$((failed + 1)); }
# check NAME COMMAND...: passes when the command succeeds.
check() {
  local name=$1 out
  shift
  if out=$("$@" 2>&1); then pass "$name"; else fail "$name" "$out"; fi
}

# --- the chart -----------------------------------------------------------------------------------
values_files() { [ "$1" = default ] || echo "--values=$chart/values-$1.yaml"; }

# kubernetes-validate has no schema for the Prometheus Operator's ServiceMonitor (a CRD): that
# one warning is expected; any other warning or error fails.
validate() {
  local out
  out=$(kubernetes-validate --strict --kubernetes-version "$1" --quiet "$2" 2>&1) || { echo "$out"; return 1; }
  out=$(grep -v "Couldn't find schema for kind ServiceMonitor with api version monitoring.coreos.com/v1" <<<"$out")
  [ -z "$out" ] || { echo "$out"; return 1; }
}

for values in default cpu gpu external-etcd; do
  check "helm lint --strict ($values values)" helm lint --strict $(values_files $values) "$chart"
  out="$work/$values.yaml"
  if ! helm template duet "$chart" --namespace duet $(values_files $values) >"$out" 2>"$work/err"; then
    fail "helm template ($values values)" "$(cat "$work/err")"
    continue
  fi
  for version in 1.29.0 1.33.0; do
    check "kubernetes-validate --strict $version ($values values)" validate "$version" "$out"
  done
  if $update; then
    mkdir -p "$rendered" && cp "$out" "$rendered/$values.yaml"
  else
    check "$rendered/$values.yaml is the chart's rendering (scripts/test-deploy.sh --update)" \
      diff -u "$rendered/$values.yaml" "$out"
  fi
done

# NOTES.txt (rendered only by install): how to call the release, with grpcurl and ghz.
notes=$(helm install duet "$chart" --namespace duet --dry-run=client 2>&1)
if grep -q 'duet-router.duet.svc.cluster.local:50051 duet.v1.Generation/Generate' <<<"$notes" &&
  grep -q -- '--call duet.v1.Generation.Generate' <<<"$notes"; then
  pass "NOTES.txt renders the grpcurl and ghz lines for the release"
else
  fail "NOTES.txt renders the grpcurl and ghz lines for the release" "$notes"
fi

# rejected NAME EXPECTED-MESSAGE HELM-ARGS...: the schema refuses the values with that message.
rejected() {
  local name=$1 message=$2 out
  shift 2
  if out=$(helm template duet "$chart" "$@" 2>&1); then
    fail "schema rejects $name" "rendered without error"
  elif grep -qF -- "$message" <<<"$out"; then
    pass "schema rejects $name: $message"
  else
    fail "schema rejects $name with \"$message\"" "$out"
  fi
}
rejected "a negative replica count" "at '/decode/replicas': minimum: got -1, want 0" --set decode.replicas=-1
rejected "an unknown etcd.mode" "at '/etcd/mode': value must be one of 'bundled', 'external'" --set etcd.mode=embedded
rejected "a GPU count with device cpu" "at '/prefill/gpu/count': value must be 0" --set prefill.device=cpu
rejected "external etcd without endpoints" "at '/etcd/external/endpoints': minItems: got 0, want 1" --set etcd.mode=external
rejected "a misspelt key" "at '/router': additional properties 'replica' not allowed" --set router.replica=3

# --- the image -----------------------------------------------------------------------------------
buildah=(buildah --storage-driver vfs)
# in_image ARCHIVE COMMAND...: runs the command in a fresh container made from the oci-archive,
# with tests/fixtures at /fixtures and the host's network (loopback).
in_image() {
  local archive=$1 c rc
  shift
  c=$("${buildah[@]}" from --quiet "oci-archive:$archive") || return 1
  "${buildah[@]}" run --isolation chroot --network host \
    --volume "$PWD/tests/fixtures:/fixtures:ro" "$c" -- "$@"
  rc=$?
  "${buildah[@]}" rm "$c" >/dev/null
  return $rc
}
token_ids() { python3 -c 'import json,sys; print(json.load(sys.stdin)["token_ids"])'; }

if archive=$(./scripts/build-image.sh 2>"$work/build.log"); then
  pass "scripts/build-image.sh: $(tail -1 "$work/build.log" | sed 's/^built //')"
  version=$(./target/release/duet --version)
  if out=$(in_image "$archive" duet --version 2>&1) && [ "$out" = "$version" ]; then
    pass "duet --version in the image: $out"
  else
    fail "duet --version in the image" "$out"
  fi
  generate=(generate --prompt "hello world" --max-tokens 8 --temperature 0 --json)
  host_ids=$(./target/release/duet "${generate[@]}" --model tests/fixtures/tiny-llama | token_ids)
  image_ids=$(in_image "$archive" duet "${generate[@]}" --model /fixtures/tiny-llama 2>"$work/gen.err" | token_ids)
  if [ -n "$image_ids" ] && [ "$image_ids" = "$host_ids" ]; then
    pass "duet generate on the tiny fixture in the image: tokens $image_ids, as outside"
  else
    fail "duet generate on the tiny fixture in the image" "image: $image_ids host: $host_ids $(cat "$work/gen.err")"
  fi

  # The `helm test` pod's command, as rendered, pointed at a router on loopback instead of the
  # release's Service: first with `duet up --processes` (the image's router, prefill and decode
  # binaries) behind it, then with nothing listening, where it must fail. (`duet up` stops its
  # processes on SIGINT.)
  port=$((20000 + RANDOM % 20000))
  hook=$(PYTHONPATH=$tools/../python python3 - "$rendered/default.yaml" "127.0.0.1:$port" <<'EOF'
import shlex, sys, yaml
for doc in yaml.safe_load_all(open(sys.argv[1])):
    if doc and doc.get("metadata", {}).get("annotations", {}).get("helm.sh/hook") == "test":
        command = doc["spec"]["containers"][0]["command"]
        print(shlex.join("--server=" + sys.argv[2] if a.startswith("--server=") else a for a in command))
EOF
  )
  script="duet up --processes --model /fixtures/tiny-llama --listen 127.0.0.1:$port >/tmp/up.log 2>&1 &
    up=\$!
    for i in \$(busybox seq 600); do busybox grep -q ready /tmp/up.log && break; busybox sleep 0.1; done
    $hook; rc=\$?; kill -INT \$up; wait \$up; [ \$rc = 0 ] || cat /tmp/up.log; exit \$rc"
  if out=$(in_image "$archive" sh -c "$script" 2>&1) && grep -q '"token_ids":\[[0-9]' <<<"$out"; then
    pass "the helm test pod's command in the image gets tokens from duet up --processes"
  else
    fail "the helm test pod's command in the image gets tokens from duet up --processes" "$hook
$out"
  fi
  if out=$(in_image "$archive" sh -c "${hook/127.0.0.1:$port/127.0.0.1:$((port + 1))}" 2>&1); then
    fail "the helm test pod's command fails with no router" "$out"
  else
    pass "the helm test pod's command fails with no router: $(grep -m1 "^error" <<<"$out")"
  fi
else
  fail "scripts/build-image.sh" "$(cat "$work/build.log")"
fi

if archive=$(./scripts/build-image.sh --gpu 2>"$work/build-gpu.log"); then
  pass "scripts/build-image.sh --gpu: $(tail -1 "$work/build-gpu.log" | sed 's/^built //')"
  # Every CUDA library in the image finds what it links there, except the host's driver.
  script='for lib in /usr/local/lib/duet/*.so*; do
      /lib64/ld-linux-x86-64.so.2 --list "$lib" | busybox grep "not found" | busybox grep -v "libcuda\.so" && exit 1
    done; ls /usr/local/lib/duet'
  if out=$(in_image "$archive" sh -c "$script" 2>&1); then
    pass "the GPU image's CUDA libraries resolve inside it: $(tr '\n' ' ' <<<"$out")"
  else
    fail "the GPU image's CUDA libraries resolve inside it" "$out"
  fi
else
  fail "scripts/build-image.sh --gpu" "$(cat "$work/build-gpu.log")"
fi

echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
