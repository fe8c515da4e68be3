"""A step's mean reward per task difficulty and per data source.

- `reward/by_difficulty/<value>`: over the samples whose prompt row carries a `difficulty` field
  (a level such as 3 or a name such as "hard"; `rlmesh make-task` writes one), one key per value.
- `reward/by_datasource/<name>`: when the step's samples come from several data sources (the rows'
  `datasource` / `data_source` field, else their file's name), as evaluation reports
  eval/<datasource>/...; with one source it would repeat reward/mean.

Both are also the coordinator's Prometheus gauges rlmesh_coordinator_reward_by_difficulty{difficulty}
and rlmesh_coordinator_reward_by_datasource{datasource}.
"""

from __future__ import annotations

from collections import defaultdict

from services.coordinator.loop import metrics as prom


def _means(pairs) -> dict[str, float]:
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for key, reward in pairs:
        sums[key][0] += reward
        sums[key][1] += 1
    return {key: total / count for key, (total, count) in sums.items()}


def _order(value: str) -> tuple:
    """Levels in numeric order (2 before 10), names after them in alphabetical order."""
    try:
        return (0, float(value), value)
    except ValueError:
        return (1, 0.0, value)


def group_rewards(samples) -> dict[str, float]:
    """{"reward/by_difficulty/<value>": mean, "reward/by_datasource/<name>": mean} of the scored samples."""
    scored = [s for s in samples if s.reward is not None]
    out = {}
    by_difficulty = _means((s.prompt.difficulty, s.reward) for s in scored if s.prompt.difficulty)
    for value in sorted(by_difficulty, key=_order):
        out[f"reward/by_difficulty/{value}"] = by_difficulty[value]
        prom.REWARD_BY_DIFFICULTY.labels(value).set(by_difficulty[value])
    by_source = _means((s.prompt.datasource, s.reward) for s in scored)
    if len(by_source) > 1:
        for name in sorted(by_source):
            out[f"reward/by_datasource/{name}"] = by_source[name]
            prom.REWARD_BY_DATASOURCE.labels(name).set(by_source[name])
    return out
