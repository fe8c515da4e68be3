"""OpenRLHF 0.11's and veRL's names of rlmesh's options, read off the code that translates them.

Neither translation is a table of names: OpenRLHF 0.11's namespaced options go through
services.common.openrlhf_names.translate_argv (renames, value conversions, options read together),
veRL's overrides through services.coordinator.cli.verl_cli.translate (code with defaults and
conditions). So each name is put through the translation itself and the options it produces are
recorded: an OpenRLHF option is translated alone; a veRL key is changed from its value in a
baseline command (veRL's defaults, plus a setting that makes the key matter, e.g. use_kl_loss=True
for the KL keys) and the rlmesh options whose values change are the ones it sets.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

from services.common.config_error import ConfigError

# Values tried for an OpenRLHF option, in order: the first the translation takes names its flags.
OPENRLHF_VALUES = ([], ["1"], ["bf16"], ["flash_attention_2"], ["0", "1"], ["tis"], ["2048"])


@dataclasses.dataclass
class OpenRLHFNames:
    renamed: dict[str, list[str]]  # rlmesh option -> OpenRLHF 0.11 options that set it
    refused: dict[str, str]  # OpenRLHF 0.11 option -> what to use instead


@functools.cache
def openrlhf_names(cls) -> OpenRLHFNames:
    """Every OpenRLHF 0.11 option as `cls` (a config with OPENRLHF_NAMESPACED) takes or refuses it."""
    from services.common.openrlhf_names import NAMES, translate_argv

    renamed: dict[str, list[str]] = {}
    refused: dict[str, str] = {}
    for name in sorted(NAMES):
        produced, problem = None, ""
        for values in OPENRLHF_VALUES:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    argv = translate_argv(cls, [f"--{name}", *values])
            except ValueError as exc:  # ConfigError, or a value of the wrong form for this option
                problem = problem or str(exc)
                continue
            if argv:
                produced = [token[2:] for token in argv if token.startswith("--")]
                break
        if produced:
            for flat in produced:
                renamed.setdefault(flat.removeprefix("no-"), []).append(f"--{name}")
        elif "no counterpart in this command" not in problem:
            refused[f"--{name}"] = problem.split(": ", 1)[1] if problem.startswith(f"--{name}") else problem
    return OpenRLHFNames(renamed, refused)


# ---- veRL -----------------------------------------------------------------------------------------

A, R = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout."
BASELINE = {"data.train_files": "train.parquet", "actor_rollout_ref.model.path": "MODEL"}
OVERLONG = "reward_model.reward_kwargs.overlong_buffer_cfg."
# Settings under which groups of keys matter (a key is probed in each; its flags are the union).
CONTEXTS: tuple[dict, ...] = (
    {},
    {A + "use_kl_loss": True},
    {"algorithm.use_kl_in_reward": True, "algorithm.kl_ctrl.type": "adaptive"},
    {"reward_model.enable": True, "reward_model.model.path": "RM"},
    {"custom_reward_function.path": "reward.py"},
    {"actor_rollout_ref.model.lora_rank": 8},
    {"reward_model.overlong_buffer.enable": True, "reward_model.overlong_buffer.len": 64},
    {OVERLONG + "enable": True, OVERLONG + "len": 64},
    {"algorithm.rollout_correction.rollout_is": "token"},
    {"algorithm.filter_groups.enable": True},
    {"data.val_files": "val.parquet"},
    {A + "use_dynamic_bsz": True},
    {A + "optim.lr_scheduler_type": "cosine"},
    {A + "clip_ratio_low": 0.1},
    {"trainer.nnodes": 2},
    {"algorithm.adv_estimator": "grpo"},
)
STRINGS = ("grpo", "rloo", "k2", "mse", "seq-mean-token-sum", "cosine", "constant", "hf", "disable", "gspo",
           "token", "text")


def _candidates(key: str, default) -> list:
    if isinstance(default, bool):
        return [not default]
    if isinstance(default, int):
        return [default + 1, default * 4, default + 2]
    if isinstance(default, float):
        return [default * 2 if default else 0.5, default + 0.25]
    if isinstance(default, list):
        return [["tensorboard"], [0.8, 0.9]]
    if isinstance(default, str):
        return [s for s in STRINGS if s != default]
    return [True, False, 16, 0.5, *STRINGS, ["a", "b"]]


def _options(argv: list[str]) -> dict[str, tuple[str, ...]]:
    """--flag values ... -> {flag: values}; a flag given twice keeps its last values, as argparse does."""
    out: dict[str, tuple[str, ...]] = {}
    name = ""
    for token in argv:
        if token.startswith("--"):
            name = token[2:]
            out[name] = ()
        elif name:
            out[name] += (token,)
    return out


def _changed(before: dict, after: dict) -> set[str]:
    return {k.removeprefix("no-") for k in before.keys() | after.keys() if before.get(k) != after.get(k)}


def verl_names() -> tuple[dict[str, list[str]], dict[str, str]]:
    """({veRL key: the rlmesh options it sets}, {veRL key that sets none: what a value other than veRL's
    default gives, the error's message or "" when it is taken and changes nothing})."""
    from services.coordinator.cli.verl_cli import DEFAULTS, READ, translate

    def run(overrides: dict) -> tuple[dict | None, str]:
        try:
            return _options(translate(overrides)[0]), ""
        except ConfigError as exc:
            return None, str(exc)

    sets: dict[str, set[str]] = {}
    problems: dict[str, str] = {}
    for context in CONTEXTS:
        base_overrides = {**BASELINE, **context}
        base, problem = run(base_overrides)
        assert base is not None, f"veRL probe context {context}: {problem}"
        for key in sorted(READ):
            current = base_overrides.get(key, DEFAULTS.get(key))
            for value in _candidates(key, current):
                after, problem = run({**base_overrides, key: value})
                if after is not None and after != base:
                    sets.setdefault(key, set()).update(_changed(base, after))
                    break
                if problem.startswith(f"{key}="):
                    # The advice without the probe's value; a complaint about the value's form only if no other.
                    advice = problem.split(": ", 1)[-1]
                    if key not in problems or problems[key].startswith("expected"):
                        problems[key] = advice
    checked = {key: problems.get(key, "") for key in sorted(READ) if key not in sets}
    return {key: sorted(flags) for key, flags in sorted(sets.items())}, checked


def verl_by_option(keys: dict[str, list[str]]) -> dict[str, list[str]]:
    """{rlmesh option: veRL keys that set it}."""
    out: dict[str, list[str]] = {}
    for key, flags in keys.items():
        for flag in flags:
            out.setdefault(flag, []).append(key)
    return out
