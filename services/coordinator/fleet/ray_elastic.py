"""The Ray placement of an elastic run (--elastic): the learner re-forms on the ranks a lost node left.

A lost node's bundles wait for another node (Ray keeps the placement group RESCHEDULING and moves
them to a node that has or gets room); an elastic run waits --elastic_wait_s for that, not
--ray_placement_timeout_s. The other bundles of the group stay where they are and their actors
run on.

    a rollout / reward instance   its restart raises NoRoom past the bound; the supervisor leaves it
                                  out (elastic.py says when) and its actor waits on its bundle; once a
                                  node takes the bundle, `has_node` says so and it is started again
    the learner                   a restart finds which ranks' bundles have a live node; when some do
                                  not, the learner re-forms on those that do (as many as keep
                                  --train_batch_size a multiple of --micro_train_batch_size x ranks:
                                  the learner accumulates more gradients per rank, the global batch
                                  and the maths stay), ranks numbered anew from 0; the others are left
                                  out, each actor waiting on its bundle
    growing back                  `grow_learner`, between two steps: the left-out ranks whose bundles
                                  a node took join the ranks again (the loop saved a checkpoint first)

A learner re-formed on other ranks loads the newest checkpoint: its partitions of the optimizer
states died with the lost ranks (ZeRO 1-3, and bf16 without ZeRO too: DeepSpeed's BF16_Optimizer
partitions the fp32 master weights and optimizer states over the data-parallel ranks), so the
checkpoint is the newest state that survives whole (only an fp32 or fp16 run at ZeRO stage 0 keeps
a whole copy on every rank; that case loads the checkpoint as well); the learner converts it to DeepSpeed's universal checkpoint when its layout differs
(--use_ds_universal_ckpt is passed for --elastic). On a cluster without GPUs the learner is one
bundle whose ranks it starts itself: it moves whole or not at all.
"""

from __future__ import annotations

import asyncio
import dataclasses

import ray

from services.common.log import get_logger, log_event
from services.coordinator.fleet.placement import learner_argv
from services.coordinator.fleet.ray_cluster import bundle_has_live_node, cluster_summary
from services.coordinator.fleet.ray_placement import Placed, RayPlacement
from services.coordinator.fleet.supervisor import NoRoom

_log = get_logger("coordinator")


def learner_world(ranks: int, train_batch_size: int, micro_train_batch_size: int) -> int:
    """The most ranks, at most `ranks`, that keep train_batch_size a multiple of micro x ranks (0 for none)."""
    return next((k for k in range(ranks, 0, -1) if train_batch_size % (micro_train_batch_size * k) == 0), 0)


class ElasticRayPlacement(RayPlacement):
    """RayPlacement whose learner re-forms on fewer ranks when a node is lost, and grows back."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.left_out_ranks: list[Placed] = []  # learner ranks whose bundle lost its node, in their first order

    async def start(self):
        endpoints = await super().start()
        # From here on a lost node's bundles wait --elastic_wait_s for a node, then the run goes on without them.
        self.lost_bundle_wait_s, self.lost_bundle_flag = self.cfg.elastic_wait_s, "--elastic_wait_s"
        return endpoints

    # ---- the shape ----
    def learner_ranks(self) -> int:
        return len(self._members("learner")) if self.gpu_plan else self.cfg.actor_gpus()

    def has_node(self, name: str) -> bool:
        """Whether every bundle of the instance is on a live node now."""
        return all(bundle_has_live_node(g, i) for p in self._members(name) for g, i in p.bundles)

    def ranks_to_add(self) -> list[Placed]:
        """Left-out learner ranks whose bundle a node took, as many as make a valid learner with the others."""
        placed = [p for p in self.left_out_ranks if bundle_has_live_node(*p.bundles[0])]
        ranks = self.learner_ranks()
        world = learner_world(ranks + len(placed), self.cfg.train_batch_size, self.cfg.micro_train_batch_size)
        return placed[:max(world - ranks, 0)]

    # ---- restarts ----
    async def restart(self, name: str) -> str:
        if name != "learner" or not self.gpu_plan:
            return await super().restart(name)
        ranks = self._members("learner")
        await self._stop_actors(ranks)
        live = await self._ranks_with_nodes(ranks)
        if len(live) < len(ranks):
            world = learner_world(len(live), self.cfg.train_batch_size, self.cfg.micro_train_batch_size)
            if world == 0:
                raise NoRoom(f"learner: no node took the bundle of any of its {len(ranks)} rank(s) within "
                             f"--elastic_wait_s {self.cfg.elastic_wait_s:.0f} s; {cluster_summary()}. A node with room "
                             "must join; once the run stopped, add it and resume with --load_checkpoint")
            kept = {id(p) for p in live[:world]}
            self.left_out_ranks += [p for p in ranks if id(p) not in kept]
            self._reform(live[:world])
            log_event(_log, "ray.learner_reformed", ranks=world, was=len(ranks),
                      left_out=",".join(f"{g.id.hex()[:12]}:{i}" for p in self.left_out_ranks for g, i in p.bundles))
        await self._start_learner()
        return self.learner_host.address

    async def _ranks_with_nodes(self, ranks: list[Placed]) -> list[Placed]:
        """The ranks whose bundle has a live node, after waiting up to --elastic_wait_s for all of them
        (Ray moves a lost node's bundles to a node with room within seconds)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.elastic_wait_s
        while True:
            live = [p for p in ranks if bundle_has_live_node(*p.bundles[0])]
            if len(live) == len(ranks) or loop.time() >= deadline:
                return live
            await asyncio.sleep(1.0)

    async def grow_learner(self) -> str:
        """The learner again on its ranks and the left-out ones a node took (call it between two steps,
        after a checkpoint of the last one); returns rank 0's address."""
        ranks, adding = self._members("learner"), self.ranks_to_add()
        await self._stop_actors(ranks)
        added = {id(p) for p in adding}
        self.left_out_ranks = [p for p in self.left_out_ranks if id(p) not in added]
        self._reform(ranks + adding)
        log_event(_log, "ray.learner_reformed", ranks=len(ranks) + len(adding), was=len(ranks))
        await self._start_learner()
        return self.learner_host.address

    def _reform(self, ranks: list[Placed]) -> None:
        """The learner's actors become `ranks`, in this order (rank 0 first), each with the command line
        of the new number of ranks; an actor whose rank changes is replaced (its service's name does)."""
        argv = learner_argv(self.cfg, self.total_steps, len(ranks))
        reformed = []
        for rank, old in enumerate(ranks):
            name = "learner" if rank == 0 else f"learner-rank{rank}"
            p = dataclasses.replace(old, spec=dataclasses.replace(old.spec, name=name, argv=argv), rank=rank)
            if name != old.spec.name:
                ray.kill(old.actor)
                self._make_actor(p)
            reformed.append(p)
        self.placed = reformed + [p for p in self.placed if "learner" not in p.spec.roles]
        self.learner_host = reformed[0]

    async def stop(self) -> None:
        if ray.is_initialized():
            for p in self.left_out_ranks:  # waiting on bundles without a node: nothing to ask them
                ray.kill(p.actor)
        await super().stop()
