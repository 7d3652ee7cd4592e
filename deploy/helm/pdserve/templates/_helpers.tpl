{{/* Names, labels and shared snippets. */}}

{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* "<fullname>-<component>", e.g. pdserve-decode. Call with (list $ "decode"). */}}
{{- define "pdserve.component" -}}
{{- $ctx := index . 0 -}}
{{- printf "%s-%s" (include "pdserve.fullname" $ctx | trunc 45 | trimSuffix "-") (index . 1) -}}
{{- end -}}

{{- define "pdserve.selectorLabels" -}}
{{- $ctx := index . 0 -}}
app.kubernetes.io/name: {{ include "pdserve.name" $ctx }}
app.kubernetes.io/instance: {{ $ctx.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "pdserve.labels" -}}
{{- $ctx := index . 0 -}}
{{ include "pdserve.selectorLabels" . }}
helm.sh/chart: {{ printf "%s-%s" $ctx.Chart.Name $ctx.Chart.Version | replace "+" "_" }}
app.kubernetes.io/version: {{ $ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ $ctx.Release.Service }}
app.kubernetes.io/part-of: pdserve
{{- end -}}

{{- define "pdserve.image" -}}
{{- $flavor := ternary "cuda" "cpu" .Values.gpu.enabled -}}
{{- $tag := default (printf "%s-%s" .Chart.AppVersion $flavor) .Values.image.tag -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}

{{/* The Secret that holds the Redis URL: the user's, or the chart's own. */}}
{{- define "pdserve.redisSecretName" -}}
{{- if and (not .Values.redis.enabled) .Values.redis.external.existingSecret -}}
{{- .Values.redis.external.existingSecret -}}
{{- else -}}
{{- include "pdserve.fullname" . -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.redisSecretKey" -}}
{{- if and (not .Values.redis.enabled) .Values.redis.external.existingSecret -}}
{{- .Values.redis.external.existingSecretKey -}}
{{- else -}}
redis-url
{{- end -}}
{{- end -}}

{{- define "pdserve.redisUrl" -}}
{{- if .Values.redis.enabled -}}
{{- if or .Values.redis.external.url .Values.redis.external.existingSecret -}}
{{- fail "redis: set redis.enabled=false to use redis.external (the bundled Redis is on)" -}}
{{- end -}}
{{- printf "redis://%s:6379/0" (include "pdserve.component" (list . "redis")) -}}
{{- else if .Values.redis.external.url -}}
{{- .Values.redis.external.url -}}
{{- else if not .Values.redis.external.existingSecret -}}
{{- fail "redis: with redis.enabled=false, set redis.external.url or redis.external.existingSecret" -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.apiKeysSecretName" -}}
{{- default (printf "%s-api-keys" (include "pdserve.fullname" .)) .Values.apiKeys.existingSecret -}}
{{- end -}}

{{- define "pdserve.apiKeysEnabled" -}}
{{- if or .Values.apiKeys.keys .Values.apiKeys.existingSecret -}}true{{- end -}}
{{- end -}}

{{/* Pod annotations that roll the pods when the chart's config or secret changes. */}}
{{- define "pdserve.checksums" -}}
checksum/config: {{ include (print .Template.BasePath "/configmap.yaml") . | sha256sum }}
checksum/secret: {{ include (print .Template.BasePath "/secret.yaml") . | sha256sum }}
{{- end -}}

{{/* exec probes: pdserve-healthcheck reads the service's own (expanded) command line. */}}
{{- define "pdserve.execProbes" -}}
startupProbe:
  exec:
    command: ["pdserve-healthcheck", "--quiet"]
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: {{ div .Values.probes.startupSeconds 10 | max 1 }}
readinessProbe:
  exec:
    command: ["pdserve-healthcheck", "--quiet"]
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 3
livenessProbe:
  exec:
    command: ["pdserve-healthcheck", "--quiet"]
  periodSeconds: 20
  timeoutSeconds: 5
  failureThreshold: 3
{{- end -}}

{{- define "pdserve.podSpecCommon" -}}
automountServiceAccountToken: false
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "pdserve.configEnv" -}}
envFrom:
  - configMapRef:
      name: {{ include "pdserve.fullname" . }}
{{- end -}}

{{/* ---- Security: TLS, writable scratch space, checkov notes (see docs/security.md). ---- */}}

{{- define "pdserve.tlsMountPath" -}}/etc/pdserve/tls{{- end -}}

{{/* `, "--tls-dir", "<mount>"` for a service's args when mutual TLS is on. (list $ role) */}}
{{- define "pdserve.tlsArgs" -}}
{{- $ctx := index . 0 -}}
{{- if $ctx.Values.tls.enabled -}}
, "--tls-dir", {{ include "pdserve.tlsMountPath" $ctx | quote }}
{{- end -}}
{{- end -}}

{{/* The Secret with a role's certificate: ca.pem, <role>.pem, <role>-key.pem (generate,
secret), or cert-manager's ca.crt, tls.crt, tls.key. (list $ role) */}}
{{- define "pdserve.tlsVolume" -}}
{{- $ctx := index . 0 -}}
{{- $role := index . 1 -}}
{{- if $ctx.Values.tls.enabled }}
- name: tls
  secret:
    defaultMode: 0440
    {{- if eq $ctx.Values.tls.source "certManager" }}
    secretName: {{ include "pdserve.component" (list $ctx (printf "tls-%s" $role)) }}
    items:
      - {key: ca.crt, path: ca.pem}
      - {key: tls.crt, path: {{ printf "%s.pem" $role }}}
      - {key: tls.key, path: {{ printf "%s-key.pem" $role }}}
    {{- else }}
    {{- if eq $ctx.Values.tls.source "secret" }}
    secretName: {{ required "tls.existingSecret is required with tls.source=secret" $ctx.Values.tls.existingSecret }}
    {{- else }}
    secretName: {{ include "pdserve.component" (list $ctx "tls") }}
    {{- end }}
    items:  # only this role's key reaches the pod
      - {key: ca.pem, path: ca.pem}
      - {key: {{ printf "%s.pem" $role }}, path: {{ printf "%s.pem" $role }}}
      - {key: {{ printf "%s-key.pem" $role }}, path: {{ printf "%s-key.pem" $role }}}
    {{- end }}
{{- end }}
{{- end -}}

{{- define "pdserve.tlsMount" -}}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: {{ include "pdserve.tlsMountPath" . }}
  readOnly: true
{{- end }}
{{- end -}}

{{/* The root filesystem is read-only: scratch space where the services write. */}}
{{- define "pdserve.scratchVolumes" -}}
- name: tmp
  emptyDir: {sizeLimit: 1Gi}
- name: home
  emptyDir: {sizeLimit: 2Gi}
{{- end -}}

{{- define "pdserve.scratchMounts" -}}
- name: tmp
  mountPath: /tmp
- name: home
  mountPath: /home/pdserve  # $HOME: torch / Triton caches
{{- end -}}

{{/* Checks the chart leaves to the operator, said where checkov reads them. */}}
{{- define "pdserve.checkovSkips" -}}
checkov.io/skip1: {{ "CKV_K8S_43=Image digests are the operator's choice: set image.tag (or redis.image) to a digest, repo@sha256:..., to pin one" | quote }}
checkov.io/skip2: {{ "CKV_K8S_15=imagePullPolicy is the operator's choice (image.pullPolicy): IfNotPresent suits pinned tags and digests, Always suits moving ones" | quote }}
{{- end -}}

{{/* The Redis password: the value given, the one an earlier install made (kept on upgrade),
or a new random one. */}}
{{- define "pdserve.redisPassword" -}}
{{- if .Values.redis.auth.password -}}
{{- .Values.redis.auth.password -}}
{{- else -}}
{{- $old := lookup "v1" "Secret" .Release.Namespace (include "pdserve.fullname" .) -}}
{{- if and $old $old.data (hasKey $old.data "redis-password") -}}
{{- index $old.data "redis-password" | b64dec -}}
{{- else -}}
{{- randAlphaNum 32 -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The KV store's two secrets (services/common/kv_secrets.py): store-secret for the master
and the storage nodes (registration, admin calls, read/write capabilities), block-secret for
the engines and the router (block keys and MACs). Each pod mounts only the one it needs. */}}
{{- define "pdserve.kvSecretName" -}}
{{- default (printf "%s-kv" (include "pdserve.fullname" .)) .Values.kvSecrets.existingSecret -}}
{{- end -}}

{{/* A secret's value: the one the release already has (kept on upgrade), else new. (list $ key) */}}
{{- define "pdserve.kvSecretValue" -}}
{{- $ctx := index . 0 -}}
{{- $key := index . 1 -}}
{{- $old := lookup "v1" "Secret" $ctx.Release.Namespace (include "pdserve.kvSecretName" $ctx) -}}
{{- if and $old $old.data (hasKey $old.data $key) -}}
{{- index $old.data $key | b64dec -}}
{{- else -}}
{{- randAlphaNum 64 -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.kvSecretVolume" -}}
{{- $ctx := index . 0 -}}
- name: kv-secret
  secret:
    secretName: {{ include "pdserve.kvSecretName" $ctx }}
    defaultMode: 0440
    items:
      - {key: {{ index . 1 }}, path: {{ index . 1 }}}
{{- end -}}

{{- define "pdserve.kvSecretMount" -}}
- name: kv-secret
  mountPath: /etc/pdserve/kv
  readOnly: true
{{- end -}}

{{/* ---- Discovery (values.discovery): registry -> the engines register in Redis, the router
watches it; both read the Redis URL (with its password) as a file, `--registry @FILE`. ---- */}}

{{- define "pdserve.registryOn" -}}
{{- if eq .Values.discovery "registry" -}}true{{- end -}}
{{- end -}}

{{- define "pdserve.registryVolume" -}}
{{- if include "pdserve.registryOn" . }}
- name: registry-url
  secret:
    secretName: {{ include "pdserve.redisSecretName" . }}
    defaultMode: 0440
    items:
      - {key: {{ include "pdserve.redisSecretKey" . }}, path: url}
{{- end }}
{{- end -}}

{{- define "pdserve.registryMount" -}}
{{- if include "pdserve.registryOn" . }}
- name: registry-url
  mountPath: /etc/pdserve/registry
  readOnly: true
{{- end }}
{{- end -}}
