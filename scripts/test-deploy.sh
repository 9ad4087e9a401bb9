#!/usr/bin/env bash
# The deployment tests, all offline (there is no Kubernetes API server or container engine here):
#  - the Helm chart (deploy/helm/duet): `helm lint --strict`; `helm template` with the default,
#    CPU, GPU, external-etcd, secure, cert-manager, GIE (InferencePool) and planner values, each validated by
#    `kubernetes-validate --strict` against the Kubernetes 1.29 and 1.33 schemas, checked for its
#    security wiring (secrets only as read-only mounted files, never in argv or an env value; `duet
#    health` exec probes with TLS, gRPC probes without; certificates naming what peers dial; the
#    workers' NetworkPolicies; the autoscalers' metrics exposed by the adapter rules) and diffed
#    against the rendering committed under deploy/helm/rendered/ (so a chart change shows in
#    review; the generated cluster token's random value is masked there); the generated token;
#    the Grafana dashboard's and the GIE endpoint picker's metric names against the ones the
#    sources export; NOTES.txt and the
#    `helm test` pod with TLS and API keys; extra volumes; bad values refused by the schema with a
#    message;
#  - the OCI image (scripts/build-image.sh, buildah): built from the binaries of DUET_BUILD_PROFILE's
#    build (default release; scripts/test.sh's is `ci`), then, inside
#    it, `duet --version`, `duet generate` on the tiny fixture (the same tokens as outside), and the
#    `helm test` pod's own command against a `duet up --processes` run from the image's binaries
#    (it must get tokens, and must fail with no router); the GPU variant's CUDA libraries must find
#    every library they link inside the image.
# Prints one PASS/FAIL line per check and a closing count; exits non-zero on any failure.
#   scripts/test-deploy.sh [--update] [--chart-only]
#     --update       rewrites deploy/helm/rendered/ instead of diffing
#     --chart-only   the chart's checks only: no image build (no cargo, buildah or binaries needed)
set -uo pipefail
cd "$(dirname "$0")/.."
update=false chart_only=false
for arg in "$@"; do
  case $arg in
    --update) update=true ;;
    --chart-only) chart_only=true ;;
    *) echo "usage: $0 [--update] [--chart-only]" >&2; exit 2 ;;
  esac
done
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
# python3 with the PyYAML that kubernetes-validate brings.
py() { PYTHONPATH=$tools/../python python3 "$@"; }

# --- the chart -----------------------------------------------------------------------------------
values_files() { [ "$1" = default ] || echo "--values=$chart/values-$1.yaml"; }

# kubernetes-validate has no schema for custom resources: the Prometheus Operator's ServiceMonitor,
# cert-manager's Certificate and the Gateway API Inference Extension's InferencePool; those
# warnings are expected, any other warning or error fails.
validate() {
  local out
  out=$(kubernetes-validate --strict --kubernetes-version "$1" --quiet "$2" 2>&1) || { echo "$out"; return 1; }
  out=$(grep -v -e "Couldn't find schema for kind ServiceMonitor with api version monitoring.coreos.com/v1 " \
    -e "Couldn't find schema for kind Certificate with api version cert-manager.io/v1 " \
    -e "Couldn't find schema for kind InferencePool with api version inference.networking.k8s.io/v1 " <<<"$out")
  [ -z "$out" ] || { echo "$out"; return 1; }
}

# The cluster token the chart generates (unless given a Secret) is random: masked in the committed
# renderings.
mask_generated() {
  sed -E '/# generated once by the chart/{n;s/^(  [^:]+: ).*/\1<48 random characters, base64>/}' "$1"
}

# wiring RENDERING: what the rendered objects must wire together, whatever the values.
wiring() {
  py - "$1" <<'PY'
import re, sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
kinds = {}
for d in docs:
    kinds.setdefault(d["kind"], {})[d["metadata"]["name"]] = d
errors = []
def check(ok, message):
    if not ok:
        errors.append(message)
deployments = kinds.get("Deployment", {})
certificates = kinds.get("Certificate", {})
def container(d):
    return d["spec"]["template"]["spec"]["containers"][0]
tls_on = any(a.startswith("--tls-cert=") for d in deployments.values() for a in container(d)["args"])
secret_flags = r"--(cluster-token-file|api-keys-file|api-key-file|tls-cert|tls-key|tls-ca|etcd-ca|etcd-cert|etcd-key|etcd-password-file)=(.*)"
def files_in_secrets(name, spec, c, argv):
    mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for a in argv:
        m = re.match(secret_flags, a)
        if m:
            mount = [p for p in mounts if m.group(2).startswith(p + "/")]
            check(mount and mounts[mount[0]].get("readOnly") and "secret" in volumes[mounts[mount[0]]["name"]],
                  f"{name}: {a} is not in a read-only Secret mount")
        check(not re.match(r"--(cluster-token|api-key|api-keys|etcd-password)=", a), f"{name}: a secret in argv: {a}")
    for e in c.get("env", []):
        check("value" not in e or not re.search(r"TOKEN|KEY|PASSWORD", e["name"]), f"{name}: a secret in env {e['name']}")
for name, d in deployments.items():
    spec, c = d["spec"]["template"]["spec"], container(d)
    component = d["metadata"]["labels"]["app.kubernetes.io/component"]
    if component == "epp":
        continue  # the GIE endpoint picker: not a duet binary (checked below)
    args, command = c["args"], c["command"]
    files_in_secrets(name, spec, c, command + args)
    check(tls_on == any(a.startswith("--tls-cert=") for a in args), f"{name}: TLS on some services only")
    cert = certificates.get(f"{name}-tls")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        p = c[probe]
        if component == "planner":
            # It serves no gRPC: its plain-HTTP metrics endpoint, with TLS on or off.
            check(p.get("httpGet", {}).get("port") == "metrics", f"{name}: {probe} is not its /metrics")
        elif tls_on:
            cmd = p.get("exec", {}).get("command", [])
            check(cmd[:2] == ["/usr/local/bin/duet", "health"] and any(x.startswith("--tls-cert=") for x in cmd),
                  f"{name}: {probe} is not `duet health` with the pod's certificate")
            files_in_secrets(f"{name} {probe}", spec, c, cmd)
            server_name = next((x.split("=", 1)[1] for x in cmd if x.startswith("--tls-server-name=")), "")
            check(not cert or server_name in cert["spec"]["dnsNames"], f"{name}: probe's name {server_name} not on its certificate")
        else:
            check("grpc" in p, f"{name}: {probe} is not a gRPC probe")
    if component in ("prefill", "decode"):
        line = " ".join(command + args)
        if tls_on:
            m = re.search(r'--advertise="\$\(busybox echo "\$POD_IP" \| busybox tr \.: --\)\.([^:"]+):', line)
            check(m, f"{name}: with TLS on the worker does not advertise its pod's DNS name")
            check(not (m and cert) or "*." + m.group(1) in cert["spec"]["dnsNames"],
                  f"{name}: the advertised <ip>.{m and m.group(1)} is not on its certificate")
        else:
            check("--advertise=$(POD_IP):" in line, f"{name}: does not advertise its pod IP")
for name, cert in certificates.items():
    check({"server auth", "client auth"} <= set(cert["spec"]["usages"]), f"{name}: not usable as server and client")
for name, s in kinds.get("StatefulSet", {}).items():
    command = container(s)["command"]
    if tls_on:
        for flag in ("--client-cert-auth=true", "--peer-client-cert-auth=true", "--listen-client-urls=https://0.0.0.0:2379",
                     "--listen-peer-urls=https://0.0.0.0:2380", "--trusted-ca-file=/etc/etcd/tls/ca.crt"):
            check(flag in command, f"{name}: {flag} missing with TLS on")
        member = re.search(r"--advertise-client-urls=https://\$\(POD_NAME\)\.(\S+):2379", " ".join(command))
        check(not (member and f"{name}-tls" in certificates) or "*." + member.group(1) in certificates[f"{name}-tls"]["spec"]["dnsNames"],
              f"{name}: the members' names are not on its certificate")
    else:
        check(not any("https" in a for a in command), f"{name}: TLS off but https")
for d in deployments.values():
    for a in container(d)["args"]:
        if a.startswith("--etcd="):
            check(not kinds.get("StatefulSet") or a.startswith("--etcd=https://") == tls_on, f"--etcd endpoints vs TLS: {a}")
for name, np in kinds.get("NetworkPolicy", {}).items():
    component = np["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
    if component in ("prefill", "decode"):
        rule = np["spec"]["ingress"][0]
        sources = {f.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/component") for f in rule.get("from", [])}
        check({"router", "decode" if component == "prefill" else "prefill"} <= sources,
              f"{name}: the worker's port is not limited to the router and the other pool")
adapter = [c["data"]["config.yaml"] for c in kinds.get("ConfigMap", {}).values() if "config.yaml" in c.get("data", {})]
for hpa in kinds.get("HorizontalPodAutoscaler", {}).values():
    for m in hpa["spec"]["metrics"]:
        if m["type"] in ("Pods", "External"):
            metric = m[m["type"].lower()]["metric"]["name"]
            check(not adapter or f'as: "{metric}"' in adapter[0], f"{hpa['metadata']['name']}: {metric} not in the adapter's rules")
if errors:
    print("\n".join(errors))
    sys.exit(1)
PY
}

for values in default cpu gpu external-etcd secure cert-manager gie planner; do
  check "helm lint --strict ($values values)" helm lint --strict $(values_files $values) "$chart"
  out="$work/$values.yaml"
  if ! helm template duet "$chart" --namespace duet $(values_files $values) >"$out" 2>"$work/err"; then
    fail "helm template ($values values)" "$(cat "$work/err")"
    continue
  fi
  for version in 1.29.0 1.33.0; do
    check "kubernetes-validate --strict $version ($values values)" validate "$version" "$out"
  done
  check "secrets as read-only files, probes, certificate names, NetworkPolicies, autoscalers ($values values)" \
    wiring "$out"
  mask_generated "$out" >"$out.masked"
  if $update; then
    mkdir -p "$rendered" && cp "$out.masked" "$rendered/$values.yaml"
  else
    check "$rendered/$values.yaml is the chart's rendering (scripts/test-deploy.sh --update)" \
      diff -u "$rendered/$values.yaml" "$out.masked"
  fi
done

# The generated cluster token: 48 random characters, another on each install.
tokens=$(for i in 1 2; do
  helm template duet "$chart" --show-only templates/cluster-token.yaml |
    sed -n '/# generated once by the chart/{n;s/^  token: //p}' | base64 -d
  echo
done)
if [ "$(sort -u <<<"$tokens" | grep -cE '^[A-Za-z0-9]{48}$')" = 2 ]; then
  pass "the generated cluster token is 48 random characters"
else
  fail "the generated cluster token is 48 random characters" "$tokens"
fi

# The tiers' GPU switches reach the workers' argv: page-locked host memory on both pools, pulls
# over CUDA IPC on the decode pool.
tiers=$(helm template duet "$chart" --show-only templates/workers.yaml \
  --set prefill.kvTiers.hostPinned=true --set decode.kvTiers.hostPinned=true \
  --set decode.kvTiers.peerPull=true --set decode.kvTiers.peerPullCudaIpc=true 2>&1)
if [ "$(grep -c -- '- --kv-host-pinned=on$' <<<"$tiers")" = 2 ] &&
  [ "$(grep -c -- '- --kv-peer-pull-cuda-ipc=on$' <<<"$tiers")" = 1 ]; then
  pass "kvTiers.hostPinned and decode.kvTiers.peerPullCudaIpc reach the workers' flags"
else
  fail "kvTiers.hostPinned and decode.kvTiers.peerPullCudaIpc reach the workers' flags" "$tiers"
fi

# The Grafana dashboard: the datasource a variable, every metric name in its queries one the
# sources export (a histogram as _bucket, _sum, _count), and shipped in the ConfigMap.
dashboard() {
  local sources=(crates/duet-worker/src/metrics.rs crates/duet-worker/src/stats.rs services/router/src/metrics.rs)
  py - "$chart/dashboards/duet.json" "${sources[@]}" <<'PY'
import json, re, sys
d = json.load(open(sys.argv[1]))
text = "".join(open(f).read() for f in sys.argv[2:])
families = set(re.findall(r'"(duet_[a-z0-9_]+)"', text))
histograms = set(re.findall(r'(?:histogram|HistogramOpts::new)\(\s*"(duet_[a-z0-9_]+)"', text))
assert histograms, "no histogram found in the sources"
known = (families - histograms) | {h + s for h in histograms for s in ("_bucket", "_sum", "_count")}
assert any(v["type"] == "datasource" and v["name"] == "datasource" for v in d["templating"]["list"]), "no datasource variable"
used = set()
for p in d["panels"]:
    if p["type"] != "row":
        assert p["datasource"]["uid"] == "${datasource}", f"{p['title']}: datasource is not the variable"
        assert p["targets"], f"{p['title']}: no query"
    for t in p.get("targets", []):
        used |= set(re.findall(r"\bduet_[a-z0-9_]+\b", t["expr"]))
unknown = sorted(used - known)
assert not unknown, f"not exported by duet: {unknown}"
print(f"{len(used)} metric names, all exported ({len(histograms)} histograms in the sources)")
PY
}
if out=$(dashboard 2>&1) &&
  helm template duet "$chart" --set grafana.dashboards.enabled=true --show-only templates/grafana-dashboard.yaml |
  py -c 'import json, sys, yaml; d = yaml.safe_load(sys.stdin); assert d["metadata"]["labels"]["grafana_dashboard"] == "1"; json.loads(d["data"]["duet.json"])' 2>"$work/err"; then
  pass "dashboards/duet.json, in its ConfigMap for Grafana's sidecar: $out"
else
  fail "dashboards/duet.json uses only metric names duet exports, in its ConfigMap" "$out $(cat "$work/err")"
fi

# The GIE endpoint picker: an InferencePool over the decode pods, the picker it names, and every
# metric the picker is told to read one the decode workers export.
gie_check() {
  py - "$work/gie.yaml" crates/duet-worker/src/metrics.rs <<'PY'
import re, sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
exported = set(re.findall(r'"(duet_[a-z0-9_]+)"', open(sys.argv[2]).read()))
pool = next(d for d in docs if d["kind"] == "InferencePool")
decode = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-decode"))
picker = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == pool["spec"]["endpointPickerRef"]["name"])
assert pool["spec"]["selector"]["matchLabels"].items() <= decode["spec"]["template"]["metadata"]["labels"].items(), "the pool does not select the decode pods"
args = dict(a[2:].split("=", 1) for a in picker["spec"]["template"]["spec"]["containers"][0]["args"] if "=" in a)
names = [args[f] for f in ("total-queued-requests-metric", "total-running-requests-metric", "kv-cache-usage-percentage-metric")]
unknown = [n for n in names if n not in exported]
assert not unknown, f"the picker reads metrics duet does not export: {unknown}"
assert args["pool-name"] == pool["metadata"]["name"], args
ports = [p["containerPort"] for p in decode["spec"]["template"]["spec"]["containers"][0]["ports"]]
metrics = [a for a in decode["spec"]["template"]["spec"]["containers"][0]["args"] if a.startswith("--metrics-listen=")]
assert metrics and metrics[0].endswith(":" + args["model-server-metrics-port"]), (metrics, args)
print(", ".join(names))
PY
}
if out=$(gie_check 2>&1); then
  pass "the GIE InferencePool selects the decode pods; its picker reads their metrics port and duet's names: $out"
else
  fail "the GIE InferencePool selects the decode pods; its picker reads their metrics port and duet's names" "$out"
fi

# The GIE front: the pool's target port on each decode pod is a router pinned to that pod's decode
# worker, reachable through the NetworkPolicy; with TLS and API keys on (the secure values too),
# it takes them from read-only Secret mounts and is probed over HTTPS.
gie_front_check() {
  py - "$1" "$2" <<'PY'
import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
secure = sys.argv[2] == "secure"
pool = next(d for d in docs if d["kind"] == "InferencePool")
decode = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-decode"))
spec = decode["spec"]["template"]["spec"]
worker, front = spec["containers"][0], next(c for c in spec["containers"] if c["name"] == "front")
port = pool["spec"]["targetPorts"][0]["number"]
args = front["args"]
assert front["command"] == ["/usr/local/bin/duet-router"], front["command"]
assert f"--http-listen=0.0.0.0:{port}" in args, args
assert "--only-decode-worker=$(POD_NAME)" in args and "--worker-id=$(POD_NAME)" in worker["args"], args
env = {e["name"]: e for e in front["env"]}
assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name", env
assert any(p["containerPort"] == port for p in front["ports"]), front["ports"]
policy = next((d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"].endswith("-decode")), None)
assert policy is None or any(p["port"] == port for rule in policy["spec"]["ingress"] for p in rule["ports"]), \
    "the decode pods' NetworkPolicy refuses the front's port"
scheme = {front[p]["httpGet"]["scheme"] for p in ("startupProbe", "readinessProbe", "livenessProbe")}
assert scheme == {"HTTPS" if secure else "HTTP"}, scheme
if secure:
    mounts = {m["mountPath"]: m for m in front["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    for flag in ("--api-keys-file=", "--cluster-token-file=", "--tls-cert="):
        path = next(a for a in args if a.startswith(flag)).split("=", 1)[1]
        mount = next(m for p, m in mounts.items() if path.startswith(p + "/"))
        assert mount.get("readOnly") and "secret" in volumes[mount["name"]], (flag, mount)
print(f"port {port}")
PY
}
helm template duet "$chart" --namespace duet $(values_files secure) $(values_files gie) >"$work/gie-secure.yaml"
for rendering in gie gie-secure; do
  if out=$(gie_front_check "$work/$rendering.yaml" "${rendering#gie-}" 2>&1); then
    pass "the GIE front: a router pinned to its pod's decode worker on the pool's target port ($rendering values): $out"
  else
    fail "the GIE front: a router pinned to its pod's decode worker on the pool's target port ($rendering values)" "$out"
  fi
done

# NOTES.txt (rendered only by install): how to call the release, with grpcurl and ghz; with TLS
# and API keys on, with the CA and a key read from their Secrets.
notes=$(helm install duet "$chart" --namespace duet --dry-run=client 2>&1)
if grep -q 'duet-router.duet.svc.cluster.local:50051 duet.v1.Generation/Generate' <<<"$notes" &&
  grep -q -- '--call duet.v1.Generation.Generate' <<<"$notes"; then
  pass "NOTES.txt renders the grpcurl and ghz lines for the release"
else
  fail "NOTES.txt renders the grpcurl and ghz lines for the release" "$notes"
fi
notes=$(helm install duet "$chart" --namespace duet --dry-run=client --values="$chart/values-secure.yaml" 2>&1)
if grep -qF 'grpcurl -cacert ca.crt -servername duet-router -H "authorization: Bearer $KEY"' <<<"$notes" &&
  grep -qF "get secret -n duet duet-api-keys -o jsonpath='{.data.api-keys}'" <<<"$notes" &&
  grep -qF "get secret -n duet duet-tls -o jsonpath='{.data.ca\.crt}'" <<<"$notes" &&
  grep -qF 'ghz --cacert ca.crt --cname duet-router -m "{\"authorization\":\"Bearer $KEY\"}"' <<<"$notes"; then
  pass "NOTES.txt (secure values) calls with the CA and an API key from their Secrets"
else
  fail "NOTES.txt (secure values) calls with the CA and an API key from their Secrets" "$notes"
fi
# The helm test pod with the secure values: the CA and the API keys mounted from their Secrets.
test_pod=$(sed -n '/helm.sh\/hook: test/,$p' "$work/secure.yaml")
if grep -qF -- '- --tls-ca=/etc/duet/tls/ca.crt' <<<"$test_pod" &&
  grep -qF -- '- --api-key-file=/etc/duet/api-keys/keys' <<<"$test_pod" &&
  grep -qF 'secretName: duet-api-keys' <<<"$test_pod" && grep -qF 'secretName: duet-tls' <<<"$test_pod"; then
  pass "the helm test pod calls with the CA and an API key (secure values)"
else
  fail "the helm test pod calls with the CA and an API key (secure values)" "$test_pod"
fi

# Extra volumes per pool: accepted, mounted, valid Kubernetes.
extra=(--set-json 'router.extraVolumes=[{"name":"ca-bundle","configMap":{"name":"ca-bundle"}}]'
  --set-json 'router.extraVolumeMounts=[{"name":"ca-bundle","mountPath":"/etc/ssl/extra","readOnly":true}]'
  --set-json 'decode.extraVolumes=[{"name":"shm","emptyDir":{"medium":"Memory"}}]'
  --set-json 'decode.extraVolumeMounts=[{"name":"shm","mountPath":"/dev/shm"}]')
if helm template duet "$chart" --namespace duet "${extra[@]}" >"$work/extra.yaml" 2>"$work/err" &&
  validate 1.33.0 "$work/extra.yaml" >"$work/err" 2>&1 &&
  py - "$work/extra.yaml" <<'PY' 2>"$work/err"
import sys, yaml
pods = {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in yaml.safe_load_all(open(sys.argv[1])) if d and d["kind"] == "Deployment"}
def has(name, volume, path):
    spec = pods[name]
    return any(v["name"] == volume for v in spec["volumes"]) and \
        any(m["name"] == volume and m["mountPath"] == path for m in spec["containers"][0]["volumeMounts"])
assert has("duet-router", "ca-bundle", "/etc/ssl/extra") and has("duet-decode", "shm", "/dev/shm")
assert not has("duet-prefill", "shm", "/dev/shm")
PY
then
  pass "extraVolumes / extraVolumeMounts per pool are mounted in that pool"
else
  fail "extraVolumes / extraVolumeMounts per pool are mounted in that pool" "$(cat "$work/err")"
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
rejected "mTLS without certificates" "at '/tls': missing property 'tls.enabled needs certificates" --set tls.enabled=true
rejected "certificates from both a Secret and cert-manager" \
  "at '/tls': missing property 'tls.existingSecret and tls.certManager.issuer.name both set" \
  --set tls.enabled=true --set tls.existingSecret=duet-tls --set tls.certManager.issuer.name=duet-ca
rejected "certificates with TLS off" "at '/tls': missing property 'certificates are configured but tls.enabled is false" \
  --set tls.certManager.issuer.name=duet-ca
rejected "API keys without a Secret" \
  "at '/security/apiKeys': missing property 'security.apiKeys.enabled needs security.apiKeys.existingSecret" \
  --set security.apiKeys.enabled=true
rejected "an etcd user without a password Secret" \
  "at '/etcd/external/auth': missing property 'etcd.external.auth.user needs etcd.external.auth.existingSecret" \
  --set etcd.mode=external --set 'etcd.external.endpoints[0]=http://etcd:2379' --set etcd.external.auth.user=duet
rejected "a plaintext etcd endpoint with etcd TLS" \
  "at '/etcd/external/endpoints/0': 'http://etcd:2379' does not match pattern '^https://'" \
  --values="$chart/values-external-etcd.yaml" --set-json 'etcd.external.endpoints=["http://etcd:2379"]'
rejected "a prefill signal for the decode autoscaler" \
  "at '/decode/autoscaling/metric': value must be one of 'kvCacheUsage', 'runningRequests', 'planner', 'cpu'" \
  --set decode.autoscaling.metric=ttft
rejected "a NetworkPolicy peer typo" "at '/networkPolicy/router/from/0': additional properties 'podselector' not allowed" \
  --set-json 'networkPolicy.router.from=[{"podselector":{}}]'
rejected "an extra volume without a name" "at '/decode/extraVolumes/0': missing property 'name'" \
  --set-json 'decode.extraVolumes=[{"emptyDir":{}}]'
rejected "the GIE picker without metrics" \
  "at '/gie': missing property 'gie.enabled needs metrics.enabled" \
  --set gie.enabled=true --set metrics.enabled=false
rejected "peer pulls on the prefill pool" "at '/prefill/kvTiers/peerPull': value must be false" \
  --set prefill.kvTiers.peerPull=true
rejected "CUDA-IPC peer pulls on the prefill pool" \
  "at '/prefill/kvTiers/peerPullCudaIpc': value must be false" \
  --set prefill.kvTiers.peerPullCudaIpc=true
rejected "a disk tier of no bytes" "at '/decode/kvTiers/disk/bytes': minimum: got 0, want 1" \
  --set decode.kvTiers.disk.bytes=0
rejected "a serving signal without metrics" \
  "at '/decode/autoscaling': missing property 'decode.autoscaling.metric other than cpu needs metrics.enabled" \
  --set metrics.enabled=false --set decode.autoscaling.enabled=true
rejected "an SLO of 0 for the planner" "at '/planner/ttftSloMs': exclusiveMinimum: got 0, want 0" \
  --set planner.enabled=true --set planner.profile.configMap=p --set planner.ttftSloMs=0
rejected "the planner without a profile" "planner.enabled needs planner.profile.configMap" \
  --set planner.enabled=true
rejected "the planner without metrics" "planner.enabled needs metrics.enabled" \
  --set planner.enabled=true --set planner.profile.configMap=p --set metrics.enabled=false
rejected "the planner's signal without the planner" "decode.autoscaling.metric planner needs planner.enabled" \
  --set decode.autoscaling.enabled=true --set decode.autoscaling.metric=planner

if $chart_only; then
  echo "$passed passed, $failed failed (chart only)"
  [ "$failed" = 0 ]
  exit
fi

# --- the image -----------------------------------------------------------------------------------
buildah=(buildah --storage-driver vfs)
# The binaries of DUET_BUILD_PROFILE's build (release unless set; scripts/test.sh sets its `ci`
# build, so the image holds the binaries the cargo tests ran), which build-image.sh uses too.
target=target/${DUET_BUILD_PROFILE:-release}
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
  version=$("$target/duet" --version)
  if out=$(in_image "$archive" duet --version 2>&1) && [ "$out" = "$version" ]; then
    pass "duet --version in the image: $out"
  else
    fail "duet --version in the image" "$out"
  fi
  generate=(generate --prompt "hello world" --max-tokens 8 --temperature 0 --json)
  host_ids=$("$target/duet" "${generate[@]}" --model tests/fixtures/tiny-llama | token_ids)
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
