"""The loop's side of the fleet: which instances the loop sends work to.

The fleet (services/coordinator/fleet/recovery.py, scaling.py) learns of deaths, restarts and scale
requests; it changes what the loop uses only through these named calls: the rollout pool, the
scoring pools of the reward and reference roles, the endpoints, and the weight group.
"""

from __future__ import annotations

import asyncio

from services.coordinator.loop.rollout_pool import RolloutPool
from services.coordinator.loop.run_state import Endpoints
from services.coordinator.loop.scoring_pool import ScoringPool
from services.coordinator.loop.weight_sync import WeightSync


class Members:
    """The instances of each role the loop uses, and the engines of the weight group."""

    def __init__(self, pool: RolloutPool, rewards: ScoringPool, references: ScoringPool, endpoints: Endpoints,
                 weights: WeightSync):
        self.pool, self.rewards, self.references = pool, rewards, references
        self.endpoints, self.weights = endpoints, weights

    def _scoring(self, role: str) -> ScoringPool:
        return self.rewards if role == "reward" else self.references

    def instance_died(self, role: str, index: int, why: str) -> None:
        """No new work for a dead instance; the scoring pools move its in-flight calls at once."""
        if role == "rollout":
            self.pool.engine(index).healthy = False
        else:
            self._scoring(role).mark_dead(index, why)

    def instance_moved(self, role: str, index: int, address: str) -> None:
        """A restarted instance's address (calls waiting in the scoring pools move to it, request
        ids unchanged). A rollout engine is out of the pool until it is admitted again."""
        if role == "rollout":
            self.pool.replace(index, address)
            return
        self._scoring(role).replace(index, address)
        getattr(self.endpoints, role)[index] = address

    def add_instance(self, role: str, address: str) -> int:
        """A new instance (scaling); returns its index. An engine waits to be admitted."""
        if role == "rollout":
            return self.pool.add(address).index
        getattr(self.endpoints, role).append(address)
        return self._scoring(role).add(address)

    def drain_engine(self, index: int) -> int:
        """No new prompts for engine `index`; returns the samples it still owes."""
        engine = self.pool.engine(index)
        engine.draining = True
        return engine.outstanding

    async def remove_instance(self, role: str, index: int, address: str) -> None:
        """Out of the run once its in-flight work is done."""
        if role == "rollout":
            engine = self.pool.engine(index)
            while engine.outstanding > 0:
                await asyncio.sleep(0.2)
            await self.pool.remove(engine)
            return
        await self._scoring(role).remove(address)
        getattr(self.endpoints, role).remove(address)

    def engines(self) -> list:
        """Every engine of the pool: admitted, waiting to be (syncing), dead or draining."""
        return list(self.pool.engines)

    def engine(self, index: int):
        return self.pool.engine(index)

    def admitted_engines(self) -> list:
        return self.pool.admitted()

    async def engine_infos(self, engines: list) -> list:
        """GetModelInfo of `engines`, in order."""
        return await self.pool.model_infos(engines)

    def current_endpoints(self) -> Endpoints:
        return self.endpoints

    def weight_group_is(self, engines: list) -> bool:
        return self.weights.is_group(engines)

    def drop_weight_group(self) -> None:
        self.weights.drop_group()

    def use_rendezvous(self, master: tuple[str, int] | None) -> None:
        """The rendezvous of the next weight group (a new port after a broken one)."""
        self.weights.master = master

    async def build_weight_group(self, engines: list, master: tuple[str, int] | None) -> None:
        """A new weight group of the learner and `engines` at rendezvous `master` (a new port each
        time: the learner's store of the old group may still hold the old one)."""
        self.use_rendezvous(master)
        await self.weights.build_group(engines)
