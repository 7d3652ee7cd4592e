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
