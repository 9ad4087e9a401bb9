{{/*
One duet Deployment (router, prefill or decode pool). Takes (dict "root" $ "component" NAME
"pool" VALUES "cuda" BOOL "command" LIST "args" LIST "ports" LIST-OF-{name,port} "grpcPort" PORT
"env" LIST), and optionally "volumes" LIST and "mounts" LIST (the pod's own, besides the pool's
extra ones) and "gieFront" BOOL (a decode pod's GIE front container beside the worker).
*/}}
{{- define "duet.deployment" -}}
{{- $root := .root -}}
{{- $pool := .pool -}}
{{- $values := $root.Values -}}
{{- $labels := dict "root" $root "component" .component -}}
{{- $image := include "duet.image" (dict "root" $root "pool" $pool "cuda" .cuda) -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "duet.fullname" $root }}-{{ .component }}
  labels: {{- include "duet.labels" $labels | nindent 4 }}
  {{- with $values.workloadAnnotations }}
  annotations: {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  {{- if not $pool.autoscaling.enabled }}
  replicas: {{ $pool.replicas }}
  {{- end }}
  strategy:
    type: RollingUpdate
    rollingUpdate: {{- toYaml $pool.updateStrategy | nindent 6 }}
  selector:
    matchLabels: {{- include "duet.selectorLabels" $labels | nindent 6 }}
  template:
    metadata:
      labels: {{- include "duet.labels" $labels | nindent 8 }}
      {{- with $values.podAnnotations }}
      annotations: {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      automountServiceAccountToken: false
      {{- with $values.imagePullSecrets }}
      imagePullSecrets: {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext: {{- toYaml $values.podSecurityContext | nindent 8 }}
      # The worker drains for up to drainTimeoutSeconds after SIGTERM, then deregisters and exits.
      terminationGracePeriodSeconds: {{ add $values.shutdown.drainTimeoutSeconds $values.shutdown.graceMarginSeconds }}
      {{- with include "duet.scheduling" $pool | trim }}
      {{- . | nindent 6 }}
      {{- end }}
      {{- with include "duet.modelFetchInitContainers" (dict "root" $root "image" $image) | trim }}
      {{- . | nindent 6 }}
      {{- end }}
      containers:
        - name: {{ .component }}
          {{- $image | nindent 10 }}
          {{- if eq (len .command) 1 }}
          command: [{{ first .command }}]
          {{- else }}
          command:
            {{- range .command }}
            - {{ if regexMatch "^[-/A-Za-z0-9._=]+$" . }}{{ . }}{{ else }}{{ squote . }}{{ end }}
            {{- end }}
          {{- end }}
          args:
            {{- toYaml .args | nindent 12 }}
            {{- include "duet.clusterArgs" $root | nindent 12 }}
            {{- include "duet.modelArgs" $root | nindent 12 }}
            {{- with include "duet.securityArgs" (dict "root" $root "component" .component) | trim }}
            {{- . | nindent 12 }}
            {{- end }}
            {{- if $values.metrics.enabled }}
            - --metrics-listen=0.0.0.0:{{ $values.metrics.port }}
            {{- end }}
            {{- with $pool.extraArgs }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          {{- $env := concat .env $pool.env }}
          {{- with $env }}
          env: {{- toYaml . | nindent 12 }}
          {{- end }}
          ports:
            {{- range .ports }}
            - {name: {{ .name }}, containerPort: {{ .port }}, protocol: TCP}
            {{- end }}
            {{- if $values.metrics.enabled }}
            - {name: metrics, containerPort: {{ $values.metrics.port }}, protocol: TCP}
            {{- end }}
          {{- include "duet.probes" (dict "root" $root "port" .grpcPort "component" .component) | nindent 10 }}
          resources: {{- include "duet.resources" $pool | nindent 12 }}
          securityContext: {{- toYaml $values.securityContext | nindent 12 }}
          volumeMounts:
            - {name: models, mountPath: /models, readOnly: true}
            - {name: tmp, mountPath: /tmp}
            {{- with include "duet.securityMounts" (dict "root" $root "component" .component) | trim }}
            {{- . | nindent 12 }}
            {{- end }}
            {{- with .mounts }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
            {{- with $pool.extraVolumeMounts }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
        {{- if .gieFront }}
        {{- include "duet.gieFront" (dict "root" $root "image" $image) | nindent 8 }}
        {{- end }}
      volumes:
        {{- include "duet.modelVolume" $root | nindent 8 }}
        {{- with include "duet.securityVolumes" (dict "root" $root "component" .component "gieFront" .gieFront) | trim }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- with .volumes }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
        {{- with $pool.extraVolumes }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
{{- end -}}

{{/* A pool's Service; takes (dict "root" $ "component" NAME "ports" LIST "spec" EXTRA-SPEC-DICT). */}}
{{- define "duet.service" -}}
{{- $values := .root.Values -}}
{{- $labels := dict "root" .root "component" .component -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "duet.fullname" .root }}-{{ .component }}
  labels: {{- include "duet.labels" $labels | nindent 4 }}
spec:
  {{- with .spec }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
  selector: {{- include "duet.selectorLabels" $labels | nindent 4 }}
  ports:
    {{- range .ports }}
    - {name: {{ .name }}, port: {{ .port }}, targetPort: {{ .name }}, protocol: TCP{{ with .appProtocol }}, appProtocol: {{ . }}{{ end }}}
    {{- end }}
    {{- if $values.metrics.enabled }}
    - {name: metrics, port: {{ $values.metrics.port }}, targetPort: metrics, protocol: TCP}
    {{- end }}
{{- end -}}
