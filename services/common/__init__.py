"""What every service shares: the gRPC server runner and client channels, typed config, logging,
metrics, errors, security, tensors on the wire, weight transfer, the RL maths, data files and
tiny models.

May import: the protos (rlmesh.*) and third-party libraries; never a service (rollout, reward,
learner, coordinator): it sits below all of them. Every module here may be imported by any
service. tests/test_layout.py holds these rules.
"""
