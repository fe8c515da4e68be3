"""The training loop: one global step after another over the services.

trainer.py runs the steps (generate -> score -> advantages -> train -> push -> checkpoint), with
resume.py its checkpoint half (save a step, resume from `latest`, rewind after a learner restart);
weight_sync.py is the weight-transfer protocol (group, push, verify); async_loop.py overlaps the
next step's generation with this one's training; experience.py and advantages.py hold a step's
samples and their maths; rollout_pool.py and scoring_pool.py spread calls over the admitted
instances; agent*.py run multi-turn episodes; evaluate.py is evaluation during training.

May import: services.common, the protos, services.coordinator.config, and services.reward.client
(the reward service's declared client API). Never the fleet or the commands: the fleet hands the
loop its endpoints and a recovery object, and calls the loop's named methods.
"""
