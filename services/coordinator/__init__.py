"""The coordinator: one training job over the rollout, reward and learner services.

It holds three jobs, each a sub-package:

    loop/    the training loop: one step after another (generate, score, advantages, train,
             push), the experience it collects, the async loop, agents, the rollout and scoring
             pools, in-training evaluation, the coordinator's checkpoint state and metrics log.
    fleet/   the service instances: where they run (local processes, Ray actors, static
             addresses), starting, watching, restarting, scaling and securing them, the control API.
    cli/     the commands: train (and train_ppo_ray), the veRL and OpenRLHF translations,
             control, scale, plot, run_config and eval.

config.py (the run's typed settings) is read by all three. What may import what:
    loop   -> common, protos, coordinator.config, services.reward.client (the reward service's
              client API); the fleet only through the interfaces it is handed (no imports)
    fleet  -> common, protos, coordinator.config, and of the loop only loop.checkpoint,
              loop.metrics and the Trainer's named recovery methods
    cli    -> anything above
tests/test_layout.py holds these rules. train_ppo_ray.py, main_ppo.py and train.py stay at this
level because users type them (`python -m services.coordinator.train_ppo_ray ...`).
"""
