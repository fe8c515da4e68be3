"""The fleet: the service instances of a run and their lifecycle.

placement.py (local processes and static addresses) and ray_placement.py (Ray actors) start and
find instances (ray_host.py is the actor, light to import on every node); ray_cluster.py answers
what the Ray cluster holds (live nodes, where a bundle is, the bounded wait for an actor);
local_cluster.py starts a cluster of loopback nodes on one machine; launcher.py spawns a service
process and waits for it; supervisor.py watches every instance and restarts the dead; recovery.py
tells the loop what a death means for the step; elastic.py keeps the run's shape and, with --elastic,
goes on without what a lost node held and grows back when a node joins (ray_elastic.py re-forms the
learner on the ranks left); scaling.py adds and removes instances; security.py
makes the run's token and TLS settings; control.py serves the run's control API; final_scrape.py
waits for Prometheus' last scrape.

May import: services.common, the protos, services.coordinator.config, and of the loop only
loop.checkpoint (the coordinator state a rewind loads) and loop.metrics (the metrics log the
control API streams). Recovery drives the loop through the Trainer's named methods.
"""
