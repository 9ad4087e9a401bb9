{{/* Names, labels and the pieces every duet pod shares. */}}

{{- define "duet.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "duet.selectorLabels" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Labels of every object; takes (dict "root" $ "component" NAME). */}}
{{- define "duet.labels" -}}
{{ include "duet.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{/* The cluster's name in etcd. */}}
{{- define "duet.cluster" -}}
{{- .Values.membership.cluster | default .Release.Name -}}
{{- end -}}

{{- define "duet.etcdName" -}}
{{- printf "%s-etcd" (include "duet.fullname" .) -}}
{{- end -}}

{{/* etcd endpoints, comma-separated: every bundled member by its stable name (https with TLS on),
or the external list. */}}
{{- define "duet.etcdEndpoints" -}}
{{- if eq .Values.etcd.mode "external" -}}
{{- join "," .Values.etcd.external.endpoints -}}
{{- else -}}
{{- $name := include "duet.etcdName" . -}}
{{- $endpoints := list -}}
{{- range $i := until (int .Values.etcd.bundled.replicas) -}}
{{- $endpoints = append $endpoints (printf "%s://%s-%d.%s.%s.svc.%s:2379" (ternary "https" "http" $.Values.tls.enabled) $name $i $name $.Release.Namespace $.Values.clusterDomain) -}}
{{- end -}}
{{- join "," $endpoints -}}
{{- end -}}
{{- end -}}

{{/* A pool's image; takes (dict "root" $ "pool" VALUES "cuda" BOOL). */}}
{{- define "duet.image" -}}
{{- $image := merge (deepCopy .pool.image) .root.Values.image -}}
{{- $tag := $image.tag | default (printf "%s%s" .root.Chart.AppVersion (ternary "-cuda" "" .cuda)) -}}
image: {{ printf "%s:%s" $image.repository $tag | quote }}
imagePullPolicy: {{ $image.pullPolicy }}
{{- end -}}

{{/* A pool's resources, with its GPUs as a limit (Kubernetes sets the request equal). */}}
{{- define "duet.resources" -}}
{{- $resources := deepCopy .resources -}}
{{- if gt (int .gpu.count) 0 -}}
{{- $limits := $resources.limits | default dict -}}
{{- $_ := set $limits .gpu.resourceName (int .gpu.count) -}}
{{- $_ := set $resources "limits" $limits -}}
{{- end -}}
{{- toYaml $resources -}}
{{- end -}}

{{/* Where membership is kept: the flags every duet service takes. */}}
{{- define "duet.clusterArgs" -}}
- --etcd={{ include "duet.etcdEndpoints" . }}
- --cluster={{ include "duet.cluster" . }}
{{- end -}}

{{/* The model flag and the read-only /models mount's source. */}}
{{- define "duet.modelArgs" -}}
{{- if .Values.model.path -}}
- --model=/models/{{ .Values.model.path }}
{{- else -}}
- --models-dir=/models
{{- end -}}
{{- end -}}

{{- define "duet.modelVolume" -}}
- name: models
{{- if eq .Values.model.source "pvc" }}
  persistentVolumeClaim:
    claimName: {{ .Values.model.pvc.claimName }}
    readOnly: true
{{- else if eq .Values.model.source "hostPath" }}
  hostPath:
    path: {{ .Values.model.hostPath.path }}
    type: Directory
{{- else }}
  emptyDir: {}
- name: duet-binary
  emptyDir: {}
- name: fetch-tmp
  emptyDir: {}
{{- end }}
- name: tmp
  emptyDir: {}
{{- end -}}

{{/*
The fetch source's init containers: the duet binary is copied out of the duet image (it has no
Python), then `duet model fetch` runs in a Python image and installs the model into /models.
Takes (dict "root" $ "image" IMAGE-YAML).
*/}}
{{- define "duet.modelFetchInitContainers" -}}
{{- $values := .root.Values -}}
{{- if eq $values.model.source "fetch" }}
initContainers:
  - name: duet-binary
    {{- .image | nindent 4 }}
    command: [/bin/cp, /usr/local/bin/duet, /duet-binary/duet]
    securityContext: {{- toYaml $values.securityContext | nindent 6 }}
    volumeMounts:
      - {name: duet-binary, mountPath: /duet-binary}
  - name: model-fetch
    image: {{ $values.model.fetch.image | quote }}
    command: [/duet-binary/duet, model, fetch, --models-dir=/models]
    env:
      - {name: HOME, value: /fetch-tmp}
      - {name: TMPDIR, value: /fetch-tmp}
    securityContext: {{- toYaml $values.securityContext | nindent 6 }}
    {{- with $values.model.fetch.resources }}
    resources: {{- toYaml . | nindent 6 }}
    {{- end }}
    volumeMounts:
      - {name: duet-binary, mountPath: /duet-binary, readOnly: true}
      - {name: models, mountPath: /models}
      - {name: fetch-tmp, mountPath: /fetch-tmp}
{{- end }}
{{- end -}}

{{/* Scheduling, taken from a pool's values. */}}
{{- define "duet.scheduling" -}}
{{- with .nodeSelector }}
nodeSelector: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity: {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/*
Probes against grpc.health.v1 on PORT; takes (dict "root" $ "port" PORT "component" NAME). TLS off:
the kubelet's gRPC probes. TLS on: `duet health` run in the container with the pod's certificate
(the kubelet's gRPC probe cannot present a client certificate, which a worker's port then
requires), checking the certificate against the name of the pool's Service.
*/}}
{{- define "duet.probes" -}}
{{- $p := .root.Values.probes -}}
{{- $check := "" -}}
{{- if .root.Values.tls.enabled -}}
{{- $command := list "/usr/local/bin/duet" "health" (printf "--server=127.0.0.1:%v" .port)
      (printf "--tls-ca=%s/ca.crt" (include "duet.tlsDir" .)) (printf "--tls-cert=%s/tls.crt" (include "duet.tlsDir" .))
      (printf "--tls-key=%s/tls.key" (include "duet.tlsDir" .))
      (printf "--tls-server-name=%s" (include "duet.serviceHost" (dict "root" .root "component" .component))) -}}
{{- $check = printf "exec:\n  command: [%s]\ntimeoutSeconds: %v" (join ", " $command) $p.execTimeoutSeconds -}}
{{- else -}}
{{- $check = printf "grpc: {port: %v}" .port -}}
{{- end -}}
startupProbe:
  {{- $check | nindent 2 }}
  periodSeconds: {{ $p.periodSeconds }}
  failureThreshold: {{ $p.startupFailureThreshold }}
readinessProbe:
  {{- $check | nindent 2 }}
  periodSeconds: {{ $p.periodSeconds }}
  failureThreshold: {{ $p.readinessFailureThreshold }}
livenessProbe:
  {{- $check | nindent 2 }}
  periodSeconds: {{ $p.periodSeconds }}
  failureThreshold: {{ $p.livenessFailureThreshold }}
{{- end -}}

{{/* ---------------------------------------------------------------------------------------------
Security: the cluster token, TLS, API keys and etcd's credentials, each a Secret mounted read-only
under /etc/duet and named to the binaries by its path (never a secret in argv or an env value).
--------------------------------------------------------------------------------------------- */}}

{{- define "duet.tlsDir" -}}/etc/duet/tls{{- end -}}

{{/* A component's Service, fully qualified; takes (dict "root" $ "component" NAME). */}}
{{- define "duet.serviceHost" -}}
{{- printf "%s-%s.%s.svc.%s" (include "duet.fullname" .root) .component .root.Release.Namespace .root.Values.clusterDomain -}}
{{- end -}}

{{- define "duet.clusterTokenSecret" -}}
{{- .Values.security.clusterToken.existingSecret | default (printf "%s-cluster-token" (include "duet.fullname" .)) -}}
{{- end -}}

{{- define "duet.certManager" -}}
{{- if and .Values.tls.enabled .Values.tls.certManager.issuer.name -}}true{{- end -}}
{{- end -}}

{{/* The Secret with a component's tls.crt, tls.key and ca.crt; takes (dict "root" $ "component" NAME). */}}
{{- define "duet.tlsSecret" -}}
{{- $tls := .root.Values.tls -}}
{{- if include "duet.certManager" .root -}}
{{- printf "%s-%s-tls" (include "duet.fullname" .root) .component -}}
{{- else if and (eq .component "etcd") $tls.etcdExistingSecret -}}
{{- $tls.etcdExistingSecret -}}
{{- else -}}
{{- $tls.existingSecret -}}
{{- end -}}
{{- end -}}

{{/*
The names on a component's certificate (cert-manager): its Service's, and the addresses peers dial
it at: a worker advertises <pod-IP-with-dashes>.<namespace>.pod.<domain> with TLS on (a Deployment's
pods have no other name of their own), etcd members <pod>.<etcd Service>.<namespace>.svc.<domain>.
Takes (dict "root" $ "component" NAME); a JSON list.
*/}}
{{- define "duet.tlsDnsNames" -}}
{{- $root := .root -}}
{{- $ns := $root.Release.Namespace -}}
{{- $domain := $root.Values.clusterDomain -}}
{{- $service := ternary (include "duet.etcdName" $root) (printf "%s-%s" (include "duet.fullname" $root) .component) (eq .component "etcd") -}}
{{- $names := list $service (printf "%s.%s" $service $ns) (printf "%s.%s.svc" $service $ns) (printf "%s.%s.svc.%s" $service $ns $domain) -}}
{{- if eq .component "etcd" -}}
{{- $names = append $names (printf "*.%s.%s.svc.%s" $service $ns $domain) -}}
{{- $names = append $names (printf "*.%s.%s.svc" $service $ns) -}}
{{- else if eq .component "router" -}}
{{- $names = concat $names $root.Values.tls.certManager.routerDnsNames -}}
{{- else -}}
{{- $names = append $names (printf "*.%s.pod.%s" $ns $domain) -}}
{{- end -}}
{{- toJson $names -}}
{{- end -}}

{{/* The security flags of a duet service; takes (dict "root" $ "component" NAME). */}}
{{- define "duet.securityArgs" -}}
{{- $values := .root.Values -}}
{{- if $values.security.clusterToken.enabled }}
- --cluster-token-file=/etc/duet/cluster-token/token
{{- end }}
{{- if $values.tls.enabled }}
- --tls-cert={{ include "duet.tlsDir" . }}/tls.crt
- --tls-key={{ include "duet.tlsDir" . }}/tls.key
- --tls-ca={{ include "duet.tlsDir" . }}/ca.crt
{{- end }}
{{- if and (eq .component "router") $values.security.apiKeys.enabled }}
- --api-keys-file=/etc/duet/api-keys/keys
{{- end }}
{{- if eq $values.etcd.mode "bundled" }}
{{- if $values.tls.enabled }}
- --etcd-ca={{ include "duet.tlsDir" . }}/ca.crt
- --etcd-cert={{ include "duet.tlsDir" . }}/tls.crt
- --etcd-key={{ include "duet.tlsDir" . }}/tls.key
{{- end }}
{{- else }}
{{- with $values.etcd.external.tls }}
{{- if .existingSecret }}
- --etcd-ca=/etc/duet/etcd-tls/ca.crt
{{- if .clientCert }}
- --etcd-cert=/etc/duet/etcd-tls/tls.crt
- --etcd-key=/etc/duet/etcd-tls/tls.key
{{- end }}
{{- end }}
{{- end }}
{{- with $values.etcd.external.auth }}
{{- if .user }}
- --etcd-user={{ .user }}
- --etcd-password-file=/etc/duet/etcd-auth/password
{{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{/* The security Secrets as volumes; takes (dict "root" $ "component" NAME). */}}
{{- define "duet.securityVolumes" -}}
{{- $values := .root.Values -}}
{{- if $values.security.clusterToken.enabled }}
- name: cluster-token
  secret:
    secretName: {{ include "duet.clusterTokenSecret" .root }}
    items: [{key: {{ $values.security.clusterToken.key | quote }}, path: token}]
    defaultMode: 288  # 0440: root and the pod's fsGroup
{{- end }}
{{- if $values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "duet.tlsSecret" . }}
    items: [{key: tls.crt, path: tls.crt}, {key: tls.key, path: tls.key}, {key: ca.crt, path: ca.crt}]
    defaultMode: 288
{{- end }}
{{- if and (or (eq .component "router") .gieFront) $values.security.apiKeys.enabled }}
- name: api-keys
  secret:
    secretName: {{ $values.security.apiKeys.existingSecret }}
    items: [{key: {{ $values.security.apiKeys.key | quote }}, path: keys}]
    defaultMode: 288
{{- end }}
{{- if eq $values.etcd.mode "external" }}
{{- with $values.etcd.external.tls }}
{{- if .existingSecret }}
- name: etcd-tls
  secret:
    secretName: {{ .existingSecret }}
    {{- if .clientCert }}
    items: [{key: ca.crt, path: ca.crt}, {key: tls.crt, path: tls.crt}, {key: tls.key, path: tls.key}]
    {{- else }}
    items: [{key: ca.crt, path: ca.crt}]
    {{- end }}
    defaultMode: 288
{{- end }}
{{- end }}
{{- with $values.etcd.external.auth }}
{{- if .user }}
- name: etcd-auth
  secret:
    secretName: {{ .existingSecret }}
    items: [{key: {{ .passwordKey | quote }}, path: password}]
    defaultMode: 288
{{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{/* Their read-only mounts; takes (dict "root" $ "component" NAME). */}}
{{- define "duet.securityMounts" -}}
{{- $values := .root.Values -}}
{{- if $values.security.clusterToken.enabled }}
- {name: cluster-token, mountPath: /etc/duet/cluster-token, readOnly: true}
{{- end }}
{{- if $values.tls.enabled }}
- {name: tls, mountPath: {{ include "duet.tlsDir" . }}, readOnly: true}
{{- end }}
{{- if and (eq .component "router") $values.security.apiKeys.enabled }}
- {name: api-keys, mountPath: /etc/duet/api-keys, readOnly: true}
{{- end }}
{{- if eq $values.etcd.mode "external" }}
{{- if $values.etcd.external.tls.existingSecret }}
- {name: etcd-tls, mountPath: /etc/duet/etcd-tls, readOnly: true}
{{- end }}
{{- if $values.etcd.external.auth.user }}
- {name: etcd-auth, mountPath: /etc/duet/etcd-auth, readOnly: true}
{{- end }}
{{- end }}
{{- end -}}
