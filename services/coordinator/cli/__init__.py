"""The coordinator's commands: what a user types.

train.py (`rlmesh train`, `python -m services.coordinator.train_ppo_ray`) builds a run from its
flags and wires loop and fleet together; verl_cli.py translates veRL's `main_ppo` overrides;
control_cli.py and scale_cli.py steer a running run; plot.py draws a run's curves; run_config.py
reads the run's one YAML file for every service; eval_cli.py is `rlmesh eval`.

May import anything in the coordinator, services.common and the protos; no other service's
modules except their declared client APIs.
"""
