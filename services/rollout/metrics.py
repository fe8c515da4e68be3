"""Prometheus metrics of the rollout service (default registry, served on --metrics_port).

With the vLLM engine and --vllm_log_stats, vLLM's own metrics (vllm:num_requests_running, vllm:num_requests_waiting,
vllm:kv_cache_usage_perc, ...) are exported on the same endpoint.
"""

from prometheus_client import Counter, Gauge, Histogram

# Generation can take minutes for long responses; weight pushes seconds to minutes.
_DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)

GENERATED_TOKENS = Counter("rlmesh_rollout_generated_tokens_total", "Response tokens generated")
PROMPT_TOKENS = Counter("rlmesh_rollout_prompt_tokens_total", "Prompt tokens of generated samples (once per sample)")
SAMPLES = Counter("rlmesh_rollout_samples_total", "Finished samples, by finish reason", ["finish_reason"])
REQUESTS = Counter("rlmesh_rollout_requests_total", "RPCs handled, by method and gRPC status", ["method", "status"])
REQUEST_DURATION = Histogram("rlmesh_rollout_request_duration_seconds", "RPC duration, by method", ["method"],
                             buckets=_DURATION_BUCKETS)
MIXED_VERSION_SAMPLES = Counter("rlmesh_rollout_mixed_version_samples_total",
                                "Samples that continued on new weights after a push with pause_generation")
RUNNING_SAMPLES = Gauge("rlmesh_rollout_running_samples", "Samples submitted to the engine and not finished")
WAITING_REQUESTS = Gauge("rlmesh_rollout_waiting_requests",
                         "Generate calls waiting for a weight update or Sleep/WakeUp to end")
WEIGHT_UPDATE_DURATION = Histogram("rlmesh_rollout_weight_update_duration_seconds",
                                   "Time to receive and load one UpdateWeights chunk", buckets=_DURATION_BUCKETS)
WEIGHT_UPDATE_BYTES = Counter("rlmesh_rollout_weight_update_bytes_total", "Weight bytes received")
WEIGHT_VERSION = Gauge("rlmesh_rollout_weight_version", "Weight version in use (0 = the --pretrain checkpoint)")
WEIGHTS_READY = Gauge("rlmesh_rollout_weights_ready", "1 when Generate is served, 0 while weights are incomplete")
