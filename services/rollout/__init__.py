"""The rollout service: a vLLM (or transformers) generation engine behind rlmesh.rollout.v1.

server.py is the servicer (validation, weight versions, ordering of generation against pushes);
engine.py the interface both engines implement, vllm_engine.py and hf_engine.py the engines,
engines.py the factory that builds the one --engine selects; weight_receiver.py and
worker_extension.py receive pushed weights next to the model, readback.py reads back what a vLLM
model then computes with and held_weights.py judges it; pusher.py pushes a checkpoint from the
command line.

May import: services.common, the protos and third-party libraries (vLLM, transformers). Client
API: none; other services talk to it through rlmesh.rollout.v1 only (the learner pushes weights
with services.common.weights). tests/test_layout.py holds these rules.
"""
