"""The learner service: DeepSpeed actor and critic over N ranks behind rlmesh.learner.v1.

spmd.py starts the ranks (rank 0 serves gRPC and drives the others; see __main__.py);
server.py is rank 0's servicer; learner_rank.py is what every rank runs (with deepspeed_setup.py,
batches.py, logprob_head.py, varlen_attention.py, moe_aux.py for MoE router losses); checkpoint.py
saves and loads the run's checkpoints; weight_push.py pushes weights into the rollout engines;
offline.py with train_sft.py, train_rm.py and train_dpo.py are the offline trainers.

May import: services.common, the protos and third-party libraries. Client API: none; other
services talk to it through rlmesh.learner.v1 only. tests/test_layout.py holds these rules.
"""
