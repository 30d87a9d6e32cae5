{{/* Chart name, truncated to the 63 characters a label allows. */}}
{{- define "marl.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release-qualified name; component names append "-<component>" so keep room (52). */}}
{{- define "marl.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "marl.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels: stable across upgrades, so they never carry the chart version. */}}
{{- define "marl.selectorLabels" -}}
app.kubernetes.io/name: {{ include "marl.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "marl.labels" -}}
helm.sh/chart: {{ include "marl.chart" .root }}
{{ include "marl.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: marl
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- end }}

{{/* Image reference for a component: {registry/}repository:tag (tag defaults to appVersion). */}}
{{- define "marl.image" -}}
{{- $img := .image }}
{{- $tag := default .root.Chart.AppVersion (default .root.Values.image.tag $img.tag) }}
{{- if .root.Values.image.registry }}
{{- printf "%s/%s:%s" .root.Values.image.registry $img.repository $tag }}
{{- else }}
{{- printf "%s:%s" $img.repository $tag }}
{{- end }}
{{- end }}

{{- define "marl.authSecret" -}}
{{- default (printf "%s-auth" (include "marl.fullname" .)) .Values.auth.existingSecret }}
{{- end }}

{{/* ---- The sandbox's own token (auth.sandbox): the only token the sandbox accepts and
holds, a file mounted into the sandbox and the workflow pods only; the sandbox never gets
the services' token. */}}
{{- define "marl.sandboxAuthSecret" -}}
{{- default (printf "%s-sandbox-auth" (include "marl.fullname" .)) .Values.auth.sandbox.existingSecret }}
{{- end }}

{{- define "marl.sandboxTokenEnv" -}}
{{- if include "marl.authEnabled" . }}
- name: MARL_SANDBOX_TOKEN_FILE
  value: /etc/marl-sandbox-auth/token
{{- end }}
{{- end }}

{{- define "marl.sandboxTokenMount" -}}
{{- if include "marl.authEnabled" . }}
- {name: sandbox-auth, mountPath: /etc/marl-sandbox-auth, readOnly: true}
{{- end }}
{{- end }}

{{- define "marl.sandboxTokenVolume" -}}
{{- if include "marl.authEnabled" . }}
- name: sandbox-auth
  secret:
    secretName: {{ include "marl.sandboxAuthSecret" . }}
    defaultMode: 0440
    items:
      - {key: token, path: token}
{{- end }}
{{- end }}

{{- define "marl.authEnabled" -}}
{{- if .Values.auth.enabled }}true{{ end }}
{{- end }}

{{/* ---- Users (auth.users.existingSecret): their token file, for the learner and inference,
which check whose runs and adapters a caller may see. Mounted as a directory (never a
subPath), so the kubelet's update of the Secret reaches the file, which they read again. */}}
{{- define "marl.usersEnv" -}}
{{- if and (include "marl.authEnabled" .) .Values.auth.users.existingSecret }}
- name: MARL_AUTH_TOKENS_FILE
  value: /etc/marl-users/tokens.csv
{{- end }}
{{- end }}

{{- define "marl.usersMount" -}}
{{- if and (include "marl.authEnabled" .) .Values.auth.users.existingSecret }}
- {name: users, mountPath: /etc/marl-users, readOnly: true}
{{- end }}
{{- end }}

{{- define "marl.usersVolume" -}}
{{- if and (include "marl.authEnabled" .) .Values.auth.users.existingSecret }}
- name: users
  secret:
    secretName: {{ .Values.auth.users.existingSecret }}
    defaultMode: 0440
    items:
      - {key: tokens.csv, path: tokens.csv}
{{- end }}
{{- end }}

{{/* NetworkPolicy peers that may call the user-facing ports (the learner's Runs API,
inference's OpenAI port): this release's pods, pods with networkPolicy.clients.podLabels,
and every pod of networkPolicy.clients.namespaces. Never an empty selector (all pods). */}}
{{- define "marl.clientPeers" -}}
- podSelector:
    matchLabels:
      app.kubernetes.io/name: {{ include "marl.name" . }}
      app.kubernetes.io/instance: {{ .Release.Name }}
{{- with .Values.networkPolicy.clients.podLabels }}
- podSelector:
    matchLabels:
      {{- toYaml . | nindent 6 }}
{{- end }}
{{- range .Values.networkPolicy.clients.namespaces }}
- namespaceSelector:
    matchLabels:
      kubernetes.io/metadata.name: {{ . }}
{{- end }}
{{- end }}

{{/* The Redis URL a service uses; $(MARL_AUTH_TOKEN) is expanded by the kubelet from the env var set before it. */}}
{{/* With TLS: rediss://, verified against the mounted CA (redis-py reads ssl_ca_certs from the URL). */}}
{{- define "marl.redisUrl" -}}
{{- if .Values.redis.enabled }}
{{- $host := printf "%s-redis" (include "marl.fullname" .) }}
{{- $scheme := ternary "rediss" "redis" .Values.tls.enabled }}
{{- $query := ternary "?ssl_ca_certs=/etc/marl-tls/ca.crt" "" .Values.tls.enabled }}
{{- if include "marl.authEnabled" . }}
{{- printf "%s://:$(MARL_AUTH_TOKEN)@%s:6379/0%s" $scheme $host $query }}
{{- else }}
{{- printf "%s://%s:6379/0%s" $scheme $host $query }}
{{- end }}
{{- else }}
{{- required "redis.external.url is required when redis.enabled is false" .Values.redis.external.url }}
{{- end }}
{{- end }}

{{/* The shared token, if any: services require it from callers (gRPC metadata, HTTP bearer) and send it. */}}
{{- define "marl.authEnv" -}}
{{- if include "marl.authEnabled" . }}
- name: MARL_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "marl.authSecret" . }}
      key: token
{{- end }}
{{- end }}

{{/* Env vars every Redis-using service gets: the token (if any), then its MARL_<SVC>_REDIS. */}}
{{- define "marl.redisEnv" -}}
{{- include "marl.authEnv" .root }}
- name: MARL_{{ .service | upper }}_REDIS
  value: {{ include "marl.redisUrl" .root | quote }}
{{- end }}

{{/* The "restricted" Pod Security Standard, pod level. */}}
{{- define "marl.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* The "restricted" Pod Security Standard, container level, plus a read-only root. */}}
{{- define "marl.containerSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* Scheduling knobs shared by every workload. */}}
{{- define "marl.scheduling" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{- define "marl.pullSecrets" -}}
{{- with .Values.image.pullSecrets }}
imagePullSecrets:
  {{- range . }}
  - name: {{ . }}
  {{- end }}
{{- end }}
{{- end }}

{{/* Resources, with nvidia.com/gpu added to requests and limits when gpu > 0. */}}
{{- define "marl.resources" -}}
{{- $res := deepCopy (.resources | default dict) }}
{{- if gt (int .gpu) 0 }}
{{- $_ := set $res "limits" (merge (dict "nvidia.com/gpu" (int .gpu)) ($res.limits | default dict)) }}
{{- $_ := set $res "requests" (merge (dict "nvidia.com/gpu" (int .gpu)) ($res.requests | default dict)) }}
{{- end }}
{{- toYaml $res }}
{{- end }}

{{/*
checkov findings this chart does not follow, each with its reason (read by
`checkov --framework kubernetes` from the workload's annotations):
- CKV_K8S_43 (image digest): the chart deploys the tag a release pins; pin a digest
  by setting the tag to "TAG@sha256:DIGEST" (image.tag or <component>.image.tag).
- CKV_K8S_15 (pull policy Always): release tags are immutable, and Always breaks
  images side-loaded into nodes (kind, air-gapped); set image.pullPolicy: Always if wanted.
- CKV_K8S_35 (secrets as files): the auth token must reach Redis's --requirepass
  and the services' Redis URL, which the kubelet composes from an env var with
  $(MARL_AUTH_TOKEN); neither redis-server nor redis-py reads a password file.
- CKV_K8S_8 (liveness probe), only on a learner of learner.nodes > 1 pods: one pod
  template serves every rank, and only rank 0 serves gRPC; torchrun's agents watch
  the ranks and restart the whole group when one exits (a collective that hangs
  exits at its timeout).
*/}}
{{- define "marl.checkovSkips" -}}
checkov.io/skip1: CKV_K8S_43=tags are pinned per release; set TAG@sha256:DIGEST to pin a digest
checkov.io/skip2: CKV_K8S_15=release tags are immutable; Always breaks side-loaded images
checkov.io/skip3: CKV_K8S_35=the token reaches redis-server and the Redis URL only through env
{{- end }}

{{- define "marl.checkovSkipsLearnerGroup" -}}
checkov.io/skip4: CKV_K8S_8=only rank 0 serves gRPC; torchrun's agents watch every rank
{{- end }}

{{/* ---- TLS (tls.enabled): one certificate for every pod but the sandbox, which has its own. */}}

{{/* The name clients check a server dialled at an IP address against (MARL_TLS_SERVER_NAME). */}}
{{- define "marl.tlsServerName" -}}
{{- default (printf "%s.%s.svc" (include "marl.fullname" .) .Release.Namespace) .Values.tls.serverName }}
{{- end }}

{{/* The Secret holding tls.crt, tls.key and ca.crt for `.component` ("sandbox": its own). */}}
{{- define "marl.tlsSecret" -}}
{{- $root := .root }}
{{- if eq .component "sandbox" }}
{{- if $root.Values.tls.certManager.enabled }}
{{- printf "%s-sandbox-tls" (include "marl.fullname" $root) }}
{{- else }}
{{- required "tls.sandboxExistingSecret is required with tls.existingSecret while sandbox.enabled: untrusted code can read the sandbox pod's files, so it gets a certificate of its own" $root.Values.tls.sandboxExistingSecret }}
{{- end }}
{{- else if $root.Values.tls.certManager.enabled }}
{{- printf "%s-tls" (include "marl.fullname" $root) }}
{{- else }}
{{- required "tls.enabled needs tls.existingSecret (tls.crt, tls.key, ca.crt) or tls.certManager.enabled" $root.Values.tls.existingSecret }}
{{- end }}
{{- end }}

{{/* DNS names a certificate holds: each component's Service in every form, and localhost. */}}
{{- define "marl.tlsDnsNames" -}}
{{- $root := .root }}
{{- range .components }}
{{- $svc := printf "%s-%s" (include "marl.fullname" $root) . }}
- {{ $svc }}
- {{ $svc }}.{{ $root.Release.Namespace }}
- {{ $svc }}.{{ $root.Release.Namespace }}.svc
- {{ $svc }}.{{ $root.Release.Namespace }}.svc.cluster.local
{{- end }}
- localhost
{{- end }}

{{/* MARL_TLS_* for a marl service: its certificate and key (it serves TLS only), and for
every client but the sandbox (which calls no one) the CA to verify servers with and the name
to check a server dialled at its IP against. */}}
{{- define "marl.tlsEnv" -}}
{{- if .root.Values.tls.enabled }}
- name: MARL_TLS_CERT
  value: /etc/marl-tls/tls.crt
- name: MARL_TLS_KEY
  value: /etc/marl-tls/tls.key
{{- if ne .component "sandbox" }}
- name: MARL_TLS_CA
  value: /etc/marl-tls/ca.crt
- name: MARL_TLS_SERVER_NAME
  value: {{ include "marl.tlsServerName" .root | quote }}
{{- end }}
{{- end }}
{{- end }}

{{- define "marl.tlsMount" -}}
{{- if .Values.tls.enabled }}
- {name: tls, mountPath: /etc/marl-tls, readOnly: true}
{{- end }}
{{- end }}

{{- define "marl.tlsVolume" -}}
{{- if .root.Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "marl.tlsSecret" . }}
    defaultMode: 0440
{{- end }}
{{- end }}

{{/* A health probe on a marl service's gRPC port: the kubelet's native gRPC probe, or with
TLS (which that probe cannot speak) a short Python check of the same health service over
TLS, verifying the pod's certificate for `name` against the CA. That check runs with an
empty environment (`env -i`, PATH only) and needs no secret: in the sandbox pod a job of
the same uid could read a process's environment, and the probe starts one every period. */}}
{{- define "marl.probe" -}}
{{- if .root.Values.tls.enabled }}
{{- $script := printf `import sys, grpc
from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g
ca = grpc.ssl_channel_credentials(open("/etc/marl-tls/ca.crt", "rb").read())
c = grpc.secure_channel("127.0.0.1:%d", ca, options=[("grpc.ssl_target_name_override", "%s")])
sys.exit(g.HealthStub(c).Check(h.HealthCheckRequest(), timeout=4).status != h.HealthCheckResponse.SERVING)
` (int .port) .name }}
exec:
  command: ["env", "-i", "PATH=/opt/marl/bin:/usr/local/bin:/usr/bin:/bin", "python", "-c", {{ $script | toJson }}]
{{- else }}
grpc:
  port: {{ .port }}
{{- end }}
periodSeconds: {{ .period | default 10 }}
failureThreshold: {{ .failures | default 3 }}
timeoutSeconds: 5
{{- end }}

{{/* ---- Prometheus: pods that serve /metrics (their http_port) say so. */}}
{{- define "marl.scrapeAnnotations" -}}
{{- if .port }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: /metrics
prometheus.io/scheme: {{ ternary "https" "http" .root.Values.tls.enabled }}
{{- end }}
{{- end }}

{{/* Label matchers that pick this release's pods of `component` in Prometheus: the
namespace, and the pod labels a pod scrape carries over as app_kubernetes_io_* (the
prometheus-community chart's kubernetes-pods job, and this chart's PodMonitor). */}}
{{- define "marl.promSelector" -}}
namespace="{{ .root.Release.Namespace }}",app_kubernetes_io_instance="{{ .root.Release.Name }}",app_kubernetes_io_component="{{ .component }}"
{{- end }}
