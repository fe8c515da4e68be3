"""Prometheus metrics of the reward service (default registry, served by the runner's port)."""

import prometheus_client

from services.common.metrics import metric_name

_DURATION_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# Rewards are clipped to [-10, 10] by default; finer steps near the usual 0/1 rule values.
_REWARD_BUCKETS = (-10, -5, -2, -1, -0.75, -0.5, -0.25, 0, 0.25, 0.5, 0.75, 1, 2, 5, 10)

SCORE_DURATION = prometheus_client.Histogram(
    metric_name("reward", "score_duration", "seconds"),
    "Time to score one Score request, by source kind", ["source"], buckets=_DURATION_BUCKETS)
SCORED_SAMPLES = prometheus_client.Counter(
    metric_name("reward", "scored_samples", "total"), "Samples scored, by source kind", ["source"])
SCORE_ERRORS = prometheus_client.Counter(
    metric_name("reward", "score_errors", "total"),
    "Score requests that failed, by source kind and gRPC status code", ["source", "code"])
DEDUPLICATED = prometheus_client.Counter(
    metric_name("reward", "deduplicated_requests", "total"),
    "Score requests answered from an earlier request with the same request_id and content (a caller's retry)")
REWARD_VALUES = prometheus_client.Histogram(
    metric_name("reward", "reward_value"), "Final per-sample rewards (after normalisation and clipping)",
    ["source"], buckets=_REWARD_BUCKETS)

REMOTE_REQUESTS = prometheus_client.Counter(
    metric_name("reward", "remote_requests", "total"),
    "Calls to remote reward servers and reward functions, by URL (or file) and outcome "
    "(ok, timeout, connection_error, http_5xx, http_4xx, grpc_error, invalid_response, error)",
    ["url", "outcome"])
REMOTE_RETRIES = prometheus_client.Counter(
    metric_name("reward", "remote_retries", "total"), "Retried calls to remote reward servers, by URL", ["url"])
REMOTE_DURATION = prometheus_client.Histogram(
    metric_name("reward", "remote_request_duration", "seconds"),
    "Duration of one call to a remote reward server or reward function, by URL (or file)", ["url"],
    buckets=_DURATION_BUCKETS)

REF_DURATION = prometheus_client.Histogram(
    metric_name("reward", "ref_logprobs_duration", "seconds"), "Time to answer one RefLogProbs request",
    buckets=_DURATION_BUCKETS)
REF_TOKENS = prometheus_client.Counter(
    metric_name("reward", "ref_tokens", "total"), "Tokens run through the reference model (prompt + response)")
