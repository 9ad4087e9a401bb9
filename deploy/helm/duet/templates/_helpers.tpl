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

{{/* etcd endpoints, comma-separated: every bundled member by its stable name, or the external list. */}}
{{- define "duet.etcdEndpoints" -}}
{{- if eq .Values.etcd.mode "external" -}}
{{- join "," .Values.etcd.external.endpoints -}}
{{- else -}}
{{- $name := include "duet.etcdName" . -}}
{{- $endpoints := list -}}
{{- range $i := until (int .Values.etcd.bundled.replicas) -}}
{{- $endpoints = append $endpoints (printf "http://%s-%d.%s.%s.svc.%s:2379" $name $i $name $.Release.Namespace $.Values.clusterDomain) -}}
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

{{/* gRPC probes against grpc.health.v1 on PORT; takes (dict "root" $ "port" PORT). */}}
{{- define "duet.probes" -}}
{{- $p := .root.Values.probes -}}
startupProbe:
  grpc: {port: {{ .port }}}
  periodSeconds: {{ $p.periodSeconds }}
  failureThreshold: {{ $p.startupFailureThreshold }}
readinessProbe:
  grpc: {port: {{ .port }}}
  periodSeconds: {{ $p.periodSeconds }}
  failureThreshold: {{ $p.readinessFailureThreshold }}
livenessProbe:
  grpc: {port: {{ .port }}}
  periodSeconds: {{ $p.periodSeconds }}
  failureThreshold: {{ $p.livenessFailureThreshold }}
{{- end -}}
