"""Named crash points: a test-only switch that makes a process kill itself (SIGKILL) at a chosen
moment of the checkpoint, weight-push, rank-group or step protocol.

    RLMESH_CRASH_AT="<point>[@<who>][#<n>][,<point>...]"
        point  a name from POINTS
        who    only this process: a service name as the coordinator's launcher names it ("learner",
               "rollout-1", "reward-ref-0"), "rank<N>" for one rank of a learner, or "coordinator"
        n      the n-th time this process reaches the point (default: the first)
    (Hold points, services/common/hold_points.py, also take ":<call>": the request they serve.)
    RLMESH_CRASH_ONCE_DIR=<folder>
        each entry fires once over all processes (a file per fired entry, created exclusively),
        so a restarted process that reaches the same point again lives on; without it every
        process that matches dies there, the restarted ones too.

The environment is read once, at import: with RLMESH_CRASH_AT unset, crash_point() returns at its
first line. A misspelled point or filter stops the process at import with the entry and the fix,
so a test never passes because its kill silently never happened.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import signal

# Every point, with what a kill there leaves behind and how the run gets over it (docs/guides/resilience.md, "Named crash points").
POINTS: dict[str, str] = {
    # The learner's half of a checkpoint (rank 0 writes the files of its own; every rank its shards).
    "learner.checkpoint.folder_created": "global_step_N/ exists and is empty; the restarted learner adopts it",
    "learner.checkpoint.folder_marking": "global_step_N/ holds only the temporary ownership marker; the restarted "
                                         "learner recognises it as its own and replaces it",
    "learner.checkpoint.client_state_written": "client_state.bin written, no model files, no learner.json: "
                                               "incomplete, ignored by loading, rewritten by the next save",
    "learner.checkpoint.model_written": "one model's DeepSpeed files written (per model, every rank), no "
                                        "learner.json: incomplete, ignored, rewritten",
    "learner.checkpoint.marker_renamed": "learner.json in place, nothing pruned, no coordinator.json: the "
                                         "coordinator's `latest` still names the previous step, which is resumed",
    "learner.checkpoint.pruned": "older checkpoints pruned, SaveCheckpoint not answered: as above",
    # The coordinator's half of a checkpoint.
    "coordinator.checkpoint.state_written": "coordinator.json in place, `latest` not moved: the rerun resumes "
                                            "from the previous checkpoint and redoes the step",
    "coordinator.checkpoint.latest_updated": "`latest` names step N, nothing pruned: the rerun resumes from N",
    "coordinator.checkpoint.pruned": "pruned, the step not logged: the rerun resumes from N",
    # The weight push: group, chunks, version, admission.
    "learner.push.group_built": "the learner joined a new weight group and did not answer: the push is retried "
                                "with a new group once the learner is back",
    "rollout.push.group_built": "an engine joined a new weight group and did not answer: restarted, admitted again",
    "coordinator.push.group_built": "every member joined the group, no chunk sent: the rerun builds a new group",
    "coordinator.push.chunk_from_learner": "the learner sent a chunk the engines never asked for: it gives its "
                                           "broadcast up once the call is gone, so a rerun pushes at once",
    "learner.push.chunk_sent": "the learner sent a chunk and did not answer the coordinator",
    "rollout.push.chunk_received": "an engine received a chunk and did not answer: it holds half-loaded weights, "
                                   "is restarted and admitted only after a full push",
    "coordinator.push.chunk_relayed": "every engine answered the chunk, the learner got no ack",
    "learner.push.chunk_acknowledged": "the learner got the ack of a chunk and sent nothing more",
    "rollout.push.version_committed": "an engine loaded the last chunk and took the version, no answer",
    "learner.push.version_committed": "the learner noted the pushed version, PushWeights not finished",
    "coordinator.push.version_committed": "every engine verified the version, the step not yet booked",
    "coordinator.push.engine_admitted": "a restarted engine got the weights and was admitted, no prompt sent yet",
    # The learner's rank group: the collectives of a training step (every rank takes part).
    "learner.rank.forward_done": "a micro-batch's loss computed, before the gradient all-reduce of backward",
    "learner.rank.backward_done": "gradients reduced, before the optimizer step (its grad-norm all-reduce)",
    "learner.rank.step_done": "the optimizer step applied on this rank, before the next micro-batch",
    "learner.rank.result_ready": "a rank's command done, before its result goes to rank 0",
    # The coordinator's step: one point per phase boundary.
    "coordinator.step.generated": "the step's samples generated, scoring under way",
    "coordinator.step.scored": "scores and log-probs in, nothing trained",
    "coordinator.step.trained": "the learner trained the step, no push",
    "coordinator.step.pushed": "the step's weights on every engine, no checkpoint",
    "coordinator.step.done": "the step checkpointed (when it saves), its metrics not yet logged",
}


@dataclasses.dataclass
class Entry:
    text: str
    point: str
    who: str
    call: str
    nth: int
    seen: int = 0

    def reached(self, point: str, call: str) -> bool:
        """Counts a pass of this process through `point` for `call`; True on the pass the entry names."""
        if self.point != point or (self.who and self.who not in process_names()):
            return False
        if self.call and not (call == self.call or call.startswith(self.call + "-")):
            return False
        self.seen += 1
        return self.seen == self.nth


def parse_entries(variable: str, points: dict[str, str], calls: bool) -> list[Entry]:
    """The entries of the environment variable `variable`, each naming one of `points`; `calls`:
    whether the points pass the request they serve (an entry may then name one after ':')."""
    entries = []
    for item in (part.strip() for part in os.environ.get(variable, "").split(",")):
        if not item:
            continue
        rest, _, nth = item.partition("#")
        rest, _, call = rest.partition(":")
        point, _, who = rest.partition("@")
        if point not in points:
            raise SystemExit(f"{variable}: {item!r} names no point; the points are: {', '.join(points)}")
        if call and not calls:
            raise SystemExit(f"{variable}: {item!r}: these points take no ':<request id>' (they are passed "
                             "none); pick the pass with '#N' instead")
        if nth and not (nth.isdigit() and int(nth) >= 1):
            raise SystemExit(f"{variable}: {item!r}: the count after '#' must be a whole number >= 1")
        entries.append(Entry(item, point, who, call, int(nth or 1)))
    return entries


def process_names() -> set[str]:
    names = {os.environ.get("RLMESH_SERVICE", "coordinator")}
    if "RANK" in os.environ:
        names.add(f"rank{os.environ['RANK']}")
    return names


def claim_file(folder: pathlib.Path, entry: Entry, prefix: str) -> bool:
    """Creates folder/<prefix><entry> exclusively, recording who made it; False when it exists."""
    flag = folder / (prefix + entry.text.replace("/", "_"))
    try:
        fd = os.open(flag, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    # The record says who fired where; a test reads it to know the kill happened.
    os.write(fd, f"{os.getpid()} {sorted(process_names())}\n".encode())
    os.fsync(fd)
    os.close(fd)
    return True


_PLAN = parse_entries("RLMESH_CRASH_AT", POINTS, calls=False) or None
_ONCE_DIR = os.environ.get("RLMESH_CRASH_ONCE_DIR", "")


def crash_point(name: str) -> None:
    """Kills this process (SIGKILL, no cleanup, as a power cut or the OOM killer) when the switch
    names `name` for it; otherwise does nothing."""
    if _PLAN is None:
        return
    if name not in POINTS:
        raise ValueError(f"crash_point({name!r}): not in services.common.crash_points.POINTS; add it there")
    for entry in _PLAN:
        if entry.reached(name, "") and (not _ONCE_DIR or claim_file(pathlib.Path(_ONCE_DIR), entry, "fired-")):
            os.kill(os.getpid(), signal.SIGKILL)
