{{/* Chart name, overridable with nameOverride. */}}
{{- define "topotrain.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Fully qualified name: <release>-<chart>, or the release name alone when it
already contains the chart name. Truncated to 63 characters (DNS label).
*/}}
{{- define "topotrain.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Chart label value: <name>-<version>. */}}
{{- define "topotrain.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object the chart creates. */}}
{{- define "topotrain.labels" -}}
helm.sh/chart: {{ include "topotrain.chart" . }}
{{ include "topotrain.selectorLabels" . }}
app.kubernetes.io/version: {{ include "topotrain.imageTag" . | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: topotrain
{{- end }}

{{/* Labels that select the operator pods; never change across upgrades. */}}
{{- define "topotrain.selectorLabels" -}}
app.kubernetes.io/name: {{ include "topotrain.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Name of the operator's ServiceAccount. */}}
{{- define "topotrain.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "topotrain.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Image tag: the chart's appVersion unless image.tag is set. */}}
{{- define "topotrain.imageTag" -}}
{{- default .Chart.AppVersion .Values.image.tag }}
{{- end }}

{{/* Image reference: repository:tag, plus @digest when image.digest is set. */}}
{{- define "topotrain.image" -}}
{{- $ref := printf "%s:%s" .Values.image.repository (include "topotrain.imageTag" .) }}
{{- if .Values.image.digest }}
{{- $ref = printf "%s@%s" $ref .Values.image.digest }}
{{- end }}
{{- $ref }}
{{- end }}

{{/* Name of the leader-election Lease (in the release namespace). */}}
{{- define "topotrain.leaseName" -}}
{{- default (include "topotrain.fullname" .) .Values.leaderElection.leaseName }}
{{- end }}

{{/* Cluster-wide mode: no watchNamespaces given. */}}
{{- define "topotrain.clusterWide" -}}
{{- if not .Values.watchNamespaces }}true{{ end }}
{{- end }}

{{/*
RBAC rules for the namespaced objects the operator manages. Every verb is
used by the operator; docs/helm.md ("RBAC review") says where.
*/}}
{{- define "topotrain.workloadRules" -}}
# TrainingJobs: watch them, add kopf's finalizer and progress annotations, delete a finished one
# whose spec.ttlSecondsAfterFinished passed.
- apiGroups: [topotrain.io]
  resources: [trainingjobs]
  verbs: [get, list, watch, patch, update, delete]
# One status write per reconcile.
- apiGroups: [topotrain.io]
  resources: [trainingjobs/status]
  verbs: [get, patch, update]
# Read the desired data-parallel degree set through `kubectl scale`.
- apiGroups: [topotrain.io]
  resources: [trainingjobs/scale]
  verbs: [get]
# Child objects point at their TrainingJob with blockOwnerDeletion; clusters
# running the OwnerReferencesPermissionEnforcement admission plugin require this.
- apiGroups: [topotrain.io]
  resources: [trainingjobs/finalizers]
  verbs: [update]
# The gang's worker pods: create, replace failed ones, tear down on resize.
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch, create, delete, patch]
# The headless Service (stable MASTER_ADDR) and per-job ConfigMaps.
- apiGroups: [""]
  resources: [services, configmaps]
  verbs: [get, list, watch, create, patch, delete]
# Events about placement, failures and recovery.
- apiGroups: ["", events.k8s.io]
  resources: [events]
  verbs: [create, patch]
# Kueue: the Workload that queues a job labelled kueue.x-k8s.io/queue-name (docs/kueue.md);
# its status is written only to give back the quota of an evicted job whose pods are gone.
- apiGroups: [kueue.x-k8s.io]
  resources: [workloads]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [kueue.x-k8s.io]
  resources: [workloads/status]
  verbs: [get, patch]
# ... and the ClusterQueue its LocalQueue points at, named while the job waits.
- apiGroups: [kueue.x-k8s.io]
  resources: [localqueues]
  verbs: [get]
{{- if .Values.networkPolicy.enabled }}
# The per-job NetworkPolicy: read it (never take over a user's), server-side apply it.
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, create, patch]
{{- end }}
{{- end }}

{{/* Leader election: create the Lease (create cannot be limited to a name), then read and
renew only the release's own. */}}
{{- define "topotrain.leaseRules" -}}
- apiGroups: [coordination.k8s.io]
  resources: [leases]
  verbs: [create]
- apiGroups: [coordination.k8s.io]
  resources: [leases]
  resourceNames: [{{ include "topotrain.leaseName" . | quote }}]
  verbs: [get, update]
# the Lease's owner (TOPOTRAIN_LEASE_OWNER): this release's Deployment, read for its UID
- apiGroups: [apps]
  resources: [deployments]
  resourceNames: [{{ include "topotrain.fullname" . | quote }}]
  verbs: [get]
{{- end }}
