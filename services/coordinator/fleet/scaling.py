"""Adding and removing rollout and reward instances while the run goes on (the control API's Scale,
`rlmesh scale rollout N`).

    add:     the placement starts the instance (local: a process; Ray: an actor on a placement group
             of its own; static: the deployment started it, the address is checked for SERVING);
             the supervisor watches it from then on. A rollout engine joins the pool as syncing and
             is admitted at the next step start, after the current weights were pushed to it and
             their version and checksum verified; a reward instance joins its scoring pool at once.
    remove:  the instance gets no new work (draining); once its in-flight work is done it leaves the
             pool, the supervisor stops watching it, and the placement stops it (static: forgets it).

The rollout pool cuts a step's prompts by the number of engines, so a run that scaled its engines
draws other generation seeds from then on than one that did not.
"""

from __future__ import annotations

import asyncio

from services.common.log import get_logger
from services.coordinator.fleet.supervisor import DRAINING, SYNCING, Instance

_log = get_logger("coordinator")


class ScaleError(ValueError):
    """A Scale request that cannot be done as asked; the message says what to change."""


class Scaler:
    """Scale requests against one run (its placement, supervisor and recovery)."""

    def __init__(self, recovery, placement_name: str):
        self.recovery = recovery
        self.members, self.sup = recovery.members, recovery.sup
        self.placement_name = placement_name
        self._lock = asyncio.Lock()
        self._drains: set[asyncio.Task] = set()

    def live(self, role: str) -> list[Instance]:
        return [i for i in self.sup.by_role(role) if i.state != DRAINING]

    async def scale(self, role: str, replicas: int, add_addresses: list[str],
                    remove_addresses: list[str]) -> tuple[list[str], list[str], list[str]]:
        """Returns (addresses after the call, added, removed)."""
        if role not in ("rollout", "reward"):
            raise ScaleError(f"role {role!r}: only rollout and reward instances scale; send role rollout or reward")
        if role == "reward" and not self.recovery.config.reward_service_needed:
            raise ScaleError("this run has no reward service: its agent's own rewards are the rewards "
                             "(--agent_rewards agent)")
        static = self.placement_name == "static"
        if static and replicas:
            raise ScaleError("static placement: the deployment starts instances; send add_addresses / "
                             "remove_addresses instead of replicas")
        if not static and (add_addresses or remove_addresses):
            raise ScaleError(f"{self.placement_name} placement starts and stops instances itself; send replicas "
                             "(the number wanted) instead of addresses")
        if replicas < 0 or (not static and replicas == 0):
            raise ScaleError(f"replicas {replicas}: send the number of {role} instances wanted (>= 1)")
        added, removed = [], []
        async with self._lock:
            self.sup.raise_if_failed()
            if static:
                known = {i.address: i for i in self.live(role)}
                gone = [a for a in remove_addresses if a not in known]
                if gone:
                    raise ScaleError(f"remove_addresses {gone}: not {role} instances of this run (have {sorted(known)})")
                if len(known) - len(remove_addresses) + len(add_addresses) < 1:
                    raise ScaleError(f"that would leave no {role} instance; add one before removing the last")
                for address in add_addresses:
                    added.append(await self._add(role, address))
                for address in remove_addresses:
                    removed.append(self._remove(known[address]))
            else:
                live = self.live(role)
                for _ in range(replicas - len(live)):
                    added.append(await self._add(role, None))
                # The newest instances leave first.
                for instance in sorted(live, key=lambda i: _index(i.name), reverse=True)[:max(len(live) - replicas, 0)]:
                    removed.append(self._remove(instance))
        return [i.address for i in self.live(role)], added, removed

    async def _add(self, role: str, address: str | None) -> str:
        placement, rec = self.sup.placement, self.recovery
        name, roles, address = (await placement.add_address(role, address) if address is not None
                                else await placement.add(role))
        instance = Instance(name, roles, address, state=SYNCING if role == "rollout" else "serving")
        self.sup.instances[name] = instance
        for role, index in (("rollout", rec.rollout_index), ("reward", rec.reward_index),
                            ("reference", rec.reference_index)):
            if role in roles:
                index[name] = self.members.add_instance(role, address)
        self.sup.event("service.added", service=name, address=address, roles=",".join(roles))
        rec.refresh_status()
        return address

    def _remove(self, instance: Instance) -> str:
        instance.state = DRAINING
        in_flight = 0  # rollout samples requested and not yet received
        if instance.name in self.recovery.rollout_index:
            in_flight = self.members.drain_engine(self.recovery.rollout_index[instance.name])
        self.sup.event("service.draining", service=instance.name, address=instance.address, in_flight=in_flight)
        task = asyncio.ensure_future(self._drain(instance))
        self._drains.add(task)
        task.add_done_callback(self._drains.discard)
        self.recovery.refresh_status()
        return instance.address

    async def _drain(self, instance: Instance) -> None:
        """Waits for the instance's in-flight work, then takes it out of the run and stops it."""
        rec = self.recovery
        for role, index in (("rollout", rec.rollout_index), ("reward", rec.reward_index),
                            ("reference", rec.reference_index)):
            if instance.name in index:
                await self.members.remove_instance(role, index.pop(instance.name), instance.address)
        # Unwatched before it stops, or the supervisor would take the stop for a death.
        self.sup.instances.pop(instance.name, None)
        await self.sup.placement.remove(instance.name)
        self.sup.event("service.removed", service=instance.name, address=instance.address)
        rec.refresh_status()

    async def close(self) -> None:
        for task in list(self._drains):
            task.cancel()
        await asyncio.gather(*self._drains, return_exceptions=True)


def _index(name: str) -> int:
    suffix = name.rpartition("-")[2]
    return int(suffix) if suffix.isdigit() else 0
