"""A gRPC reward server around a Python function (rlmesh.reward.v1.RewardService).

    python examples/grpc_reward_server.py --port 50051
    python -m services.reward --remote_rm_url grpc://127.0.0.1:50051 --port 50052

Reward: 1 when the response's last line contains the label, else 0; "length" is logged too.
"""

from services.reward.function_server import serve_reward_function


def last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


def reward_func(queries, prompts, labels, responses, **kwargs):
    rewards = [1.0 if label and label in last_line(r) else 0.0 for r, label in zip(responses, labels)]
    return {"rewards": rewards, "extra_logs": {"length": [len(r) for r in responses]}}


if __name__ == "__main__":
    serve_reward_function(reward_func)
