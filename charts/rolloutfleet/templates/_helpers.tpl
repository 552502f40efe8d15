{{/* Names, labels and the watched namespaces, shared by every template. */}}

{{- define "rolloutfleet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "rolloutfleet.fullname" -}}
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

{{/*
Selector labels. `app.kubernetes.io/name: rolloutfleet-operator` is fixed (not nameOverride-able): the
NetworkPolicy the operator writes for every fleet admits the engine port only from pods with this label
(rolloutfleet.resources.labels.OPERATOR_POD_LABELS) in the operator's namespace.
*/}}
{{- define "rolloutfleet.selectorLabels" -}}
app.kubernetes.io/name: rolloutfleet-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "rolloutfleet.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "rolloutfleet.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: operator
app.kubernetes.io/part-of: rolloutfleet
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "rolloutfleet.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "rolloutfleet.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The namespaces served when not cluster-wide, as a JSON list (default: the release namespace). */}}
{{- define "rolloutfleet.watchNamespaces" -}}
{{- if .Values.watch.namespaces -}}
{{- .Values.watch.namespaces | uniq | toJson -}}
{{- else -}}
{{- list .Release.Namespace | toJson -}}
{{- end -}}
{{- end -}}

{{- define "rolloutfleet.peering" -}}
{{- gt (int .Values.replicaCount) 1 -}}
{{- end -}}

{{- define "rolloutfleet.peeringName" -}}
{{- default (include "rolloutfleet.fullname" .) .Values.peering.name -}}
{{- end -}}

{{- define "rolloutfleet.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}
{{- end -}}

{{- define "rolloutfleet.fleetImage" -}}
{{- printf "%s:%s" .Values.fleetImage.repository .Values.fleetImage.tag -}}
{{- end -}}

{{/*
The rules the operator needs in every namespace it serves (a Role there, or one ClusterRole when
cluster-wide). Derived from the code and proven by tests/integration/chart: each rule is exercised by a
rollout and nothing else is granted. Why each one:
*/}}
{{- define "rolloutfleet.rules" -}}
# kopf lists and watches fleets, patches their annotations (progress, last-handled configuration) and
# finalizer; the revision loop GETs each fleet afresh before acting on it.
- apiGroups: ["rolloutfleet.io"]
  resources: ["rolloutfleets"]
  verbs: ["get", "list", "watch", "patch"]
# Fleet status (replicas, pods, conditions, currentRevision/targetRevision): merge patches on the
# status subresource only.
- apiGroups: ["rolloutfleet.io"]
  resources: ["rolloutfleets/status"]
  verbs: ["patch"]
# kopf lists and watches revisions and patches their annotations; the revision loop LISTs them per fleet,
# and GETs a revision once before recording it as served (a revision deleted meanwhile is cancelled).
- apiGroups: ["rolloutfleet.io"]
  resources: ["weightrevisions"]
  verbs: ["get", "list", "watch", "patch"]
# WeightRevision status (phase, per-pod progress, conditions).
- apiGroups: ["rolloutfleet.io"]
  resources: ["weightrevisions/status"]
  verbs: ["patch"]
# Engine pods are listed by label to find their IPs (the operator dials pod IPs) and readiness, then
# watched, so that every pass and status write reads them without listing the whole fleet again (without
# `watch` the operator lists at every read: correct, and slower on large fleets).
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch"]
# A weight-transfer session that failed leaves its model's parameters unusable (vLLM puts them on the meta
# device) and only a new process repairs it: the operator deletes that one engine pod (docs/push.md), and
# its StatefulSet recreates it on the fleet's initial weights.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["delete"]
# The weights readiness gate (rolloutfleet.io/weights-ready): a strategic-merge patch of one pod condition,
# so a pod joins the Service only while it serves the fleet's verified weights.
- apiGroups: [""]
  resources: ["pods/status"]
  verbs: ["patch"]
# Fleet children are server-side applied: one PATCH that updates, or creates when absent (the API server
# then checks `create` too). The StatefulSet is read back for the fleet's status.
- apiGroups: [""]
  resources: ["services"]
  verbs: ["create", "patch"]
- apiGroups: ["apps"]
  resources: ["statefulsets"]
  verbs: ["get", "create", "patch"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["create", "patch"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["create", "patch"]
# The per-fleet control-token Secret: read by name, created once, never updated, listed or deleted (it
# goes with its owner reference).
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "create"]
# Events about fleets and revisions (ours and kopf's, both core/v1).
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end -}}
