"""Torch-profiler traces of chosen learner calls, for finding where a step leaves the GPU idle.

Off unless the environment asks (the learner's flags stay those users know):

    RLMESH_PROFILE_DIR=/tmp/prof                       # where the traces go (rank 0 only)
    RLMESH_PROFILE_CALLS=train_actor:2,logprobs:2      # which call of each command (1-based)

For each chosen call, rank 0 writes `<command>-<n>.trace.json.gz` (a Chrome / Perfetto trace: CPU
ops, CUDA kernels and copies, with shapes) and `<command>-<n>.txt`: the ops by self device time
and by self host time, and the device's busy share over the call with its longest idle gaps,
each with the host ops that were running meanwhile (what the GPU waited for).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import pathlib
import time

import torch

from services.common.log import get_logger, log_event

log = get_logger("learner.profiling")

ENV_DIR = "RLMESH_PROFILE_DIR"
ENV_CALLS = "RLMESH_PROFILE_CALLS"
DEFAULT_CALLS = "train_actor:2,logprobs:2"


def parse_calls(text: str) -> dict[str, set[int]]:
    """"train_actor:2,logprobs:2:3" -> {"train_actor": {2}, "logprobs": {2, 3}}; ValueError naming the item."""
    chosen: dict[str, set[int]] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, numbers = item.partition(":")
        try:
            counts = {int(n) for n in numbers.split(":")} if numbers else {1}
        except ValueError:
            raise ValueError(f"{ENV_CALLS}: {item!r} must be COMMAND[:N[:N...]] with N a call number "
                             f"(1 = the first call), e.g. train_actor:2") from None
        if not name or any(n < 1 for n in counts):
            raise ValueError(f"{ENV_CALLS}: {item!r} must be COMMAND[:N...] with N >= 1, e.g. train_actor:2")
        chosen.setdefault(name, set()).update(counts)
    return chosen


class CallProfiler:
    """Counts the calls of each command and profiles the chosen ones (rank 0; a no-op when off)."""

    def __init__(self, rank: int, environ=os.environ):
        folder = environ.get(ENV_DIR, "")
        self.folder = pathlib.Path(folder) if folder and rank == 0 else None
        self.chosen = parse_calls(environ.get(ENV_CALLS, DEFAULT_CALLS)) if self.folder else {}
        self.counts: dict[str, int] = {}

    def __call__(self, name: str):
        """A context manager around one call of command `name`."""
        if self.folder is None:
            return contextlib.nullcontext()
        self.counts[name] = self.counts.get(name, 0) + 1
        if self.counts[name] not in self.chosen.get(name, ()):
            return contextlib.nullcontext()
        return self._profile(f"{name}-{self.counts[name]}")

    @contextlib.contextmanager
    def _profile(self, label: str):
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.folder.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
            yield
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        wall = time.monotonic() - started
        trace = self.folder / f"{label}.trace.json"
        prof.export_chrome_trace(str(trace))
        raw = trace.read_bytes()  # read once: compressed beside it, and parsed for the report
        pathlib.Path(f"{trace}.gz").write_bytes(gzip.compress(raw))
        events = json.loads(raw)
        trace.unlink()
        device_key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        table = [f"{label}: {wall:.3f} s wall", "",
                 prof.key_averages().table(sort_by=device_key, row_limit=30), "",
                 prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30), "",
                 *idle_report(events.get("traceEvents", []))]
        (self.folder / f"{label}.txt").write_text("\n".join(table) + "\n")
        log_event(log, "profile.written", label=label, folder=str(self.folder), seconds=round(wall, 3))


def idle_report(events: list[dict], gaps: int = 15, min_gap_us: float = 200.0) -> list[str]:
    """The device's busy share between its first and last kernel, and its `gaps` longest idle gaps
    (kernels and copies on any stream count as busy), each with the host ops running during it."""
    device = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events
                    if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    if not device:
        return ["no device activity recorded"]
    busy, idle, end = 0.0, [], device[0][0]
    for start, stop in device:
        if start > end:
            idle.append((start - end, end, start))
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    span = end - device[0][0]
    lines = [f"device busy {busy / 1e3:.1f} ms of {span / 1e3:.1f} ms ({100 * busy / max(span, 1):.0f}%), "
             f"{len(idle)} idle gaps, {sum(g for g, _, _ in idle if g >= min_gap_us) / 1e3:.1f} ms in gaps >= "
             f"{min_gap_us:.0f} us", ""]
    host = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "python_function", "cuda_runtime",
                                                                         "user_annotation")]
    for gap, start, stop in sorted(idle, reverse=True)[:gaps]:
        during = sorted(((min(stop, e["ts"] + e.get("dur", 0)) - max(start, e["ts"]), e["name"]) for e in host
                         if e["ts"] < stop and e["ts"] + e.get("dur", 0) > start), reverse=True)
        names = ", ".join(f"{name} {overlap / 1e3:.2f}" for overlap, name in during[:6])
        lines.append(f"gap {gap / 1e3:7.2f} ms at +{(start - device[0][0]) / 1e3:8.1f} ms: {names}")
    return lines
