"""Rollout service: a vLLM (or transformers) generation engine behind gRPC."""
