{{/*
The labels that select the gateway's pods: exactly the ones the per-policy NetworkPolicy
the gateway creates admits to its kernels' agent port (src/sandbox/kubernetes/objects.rs).
Never change them.
*/}}
{{- define "cellgate.selectorLabels" -}}
app.kubernetes.io/name: cellgate
app.kubernetes.io/component: gateway
{{- end }}

{{/* Labels of every object: the kustomize base's, and Helm's own. */}}
{{- define "cellgate.commonLabels" -}}
app.kubernetes.io/part-of: cellgate
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{/* Labels of the gateway's objects. */}}
{{- define "cellgate.labels" -}}
{{ include "cellgate.selectorLabels" . }}
{{ include "cellgate.commonLabels" . }}
{{- end }}

{{/* cellgate.toml: the value, else the chart's file. */}}
{{- define "cellgate.config" -}}
{{- if .Values.config }}{{ .Values.config }}{{ else }}{{ .Files.Get "files/cellgate.toml" }}{{ end }}
{{- end }}

{{/* The policies as ConfigMap data: the value, else the chart's files. */}}
{{- define "cellgate.policies" -}}
{{- if .Values.policies }}
{{- range $name, $content := .Values.policies }}
{{ $name }}: {{ $content | toYaml | indent 2 | trim }}
{{- end }}
{{- else }}
{{- range $path, $_ := .Files.Glob "files/policies/*.toml" }}
{{ base $path }}: {{ $.Files.Get $path | toYaml | indent 2 | trim }}
{{- end }}
{{- end }}
{{- end }}
