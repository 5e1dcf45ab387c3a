{{/* Names and labels shared by every template of the kvpool chart. */}}

{{- define "kvpool.fullname" -}}
{{- if contains "kvpool" .Release.Name -}}
{{- printf "%s-operator" .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-kvpool-operator" .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvpool.selectorLabels" -}}
app.kubernetes.io/name: kvpool-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvpool.labels" -}}
{{ include "kvpool.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kvpool.serviceAccountName" -}}
{{- default (include "kvpool.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- define "kvpool.webhookService" -}}
{{- printf "%s-webhook" (include "kvpool.fullname" .) -}}
{{- end -}}

{{- define "kvpool.webhookMode" -}}
{{- if .Values.webhook.enabled -}}{{ .Values.webhook.certMode }}{{- else -}}none{{- end -}}
{{- end -}}
