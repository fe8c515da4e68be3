"""The reward service: rewards and reference-model log-probs behind rlmesh.reward.v1.

server.py serves both roles; source.py is the interface every reward source implements:
model_source.py (a reward model), rules.py and math_check.py (built-in rules), function_source.py
and function_worker.py (a user's Python function), http_source.py and grpc_source.py (remote
servers, with remote.py's batching and retries). reference.py computes reference log-probs;
function_server.py wraps a Python function as a reward server of its own.

May import: services.common, the protos and third-party libraries. Client API: client.py
(RewardClient, ReferenceClient, ScoreBatch, ScoreResult; its __all__), the only module of this
package other services may import. tests/test_layout.py holds these rules.
"""
