"""The learner service: DeepSpeed actor and critic over N ranks behind rlmesh.learner.v1 (see __main__.py)."""
