"""veRL's Hydra options for a config file: `--config-path DIR --config-name NAME` (also `--config-path=DIR`,
`-cp DIR`, `-cn NAME`), as veRL's example scripts and users' own configs give them.

    ppo_trainer            veRL's defaults (what verl_cli.DEFAULTS holds); no file is read
    ppo_megatron_trainer   refused: the rlmesh learner is DeepSpeed ZeRO
    any other NAME         DIR/NAME.yaml is read (DIR relative to the current folder): its keys, nested
                           as in veRL's YAML, become overrides as if given as key=value, and the
                           key=value overrides of the command line win over them. Its `defaults` list
                           may name ppo_trainer (veRL's defaults), other files of DIR (read first, in
                           order) and veRL's config groups (`actor@actor_rollout_ref.actor: dp_actor`:
                           FSDP's are what rlmesh maps; a Megatron one is refused). `hydra:` is skipped.

Interpolations (`${data.max_response_length}`) are resolved against the merged overrides and veRL's
defaults; one that cannot be (a key unknown here, or a resolver such as `${oc.env:...}`), on a key
that matters here, is an error naming the key and asking for its value.
"""

from __future__ import annotations

import pathlib
import re

import yaml

from services.common.config import ConfigError

BUILTIN = {"ppo_trainer", "ppo_megatron_trainer"}
MEGATRON = ("Megatron is not supported: the rlmesh learner is DeepSpeed ZeRO (veRL's FSDP settings map to it); "
            "run the FSDP config (ppo_trainer) with the same overrides")
_REFERENCE = re.compile(r"\$\{([^}]*)\}")
_OPTIONS = {"--config-path": "path", "-cp": "path", "--config-name": "name", "-cn": "name"}


def split_hydra_options(args: list[str]) -> tuple[str | None, str | None, list[str]]:
    """(config path, config name, the other arguments)."""
    found: dict[str, str] = {}
    rest: list[str] = []
    i = 0
    while i < len(args):
        option, sep, value = args[i].partition("=")
        if option in _OPTIONS:
            if not sep:
                if i + 1 >= len(args):
                    raise ConfigError(f"{option}: give a value ({option} VALUE or {option}=VALUE)")
                i, value = i + 1, args[i + 1]
            found[_OPTIONS[option]] = value
        else:
            rest.append(args[i])
        i += 1
    return found.get("path"), found.get("name"), rest


def config_file_overrides(config_path: str | None, config_name: str | None) -> dict[str, object]:
    """The flattened keys of the named config (with the files its defaults list names), {} for veRL's own."""
    if not config_name:
        return {}
    name = config_name.removesuffix(".yaml")
    if name == "ppo_megatron_trainer":
        raise ConfigError(f"--config-name={config_name}: {MEGATRON}")
    if name == "ppo_trainer":  # veRL's own, wherever --config-path points
        return {}
    return _read(pathlib.Path(config_path or ".").expanduser(), name, config_name, seen=())


def _read(folder: pathlib.Path, name: str, given: str, seen: tuple[str, ...]) -> dict[str, object]:
    if name == "ppo_megatron_trainer":
        raise ConfigError(f"--config-name={given}: its defaults name ppo_megatron_trainer; {MEGATRON}")
    if name in BUILTIN:
        return {}
    path = folder / f"{name}.yaml"
    if name in seen:
        raise ConfigError(f"--config-name={given}: {path}'s defaults name it again ({' -> '.join(seen + (name,))})")
    if not path.is_file():
        raise ConfigError(f"--config-name={given}: no {path.name} in --config-path {folder} ({path.resolve()}); "
                          "give the folder that holds it, or ppo_trainer for veRL's defaults")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc}); fix the file") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of veRL's config keys at the top, not {type(data).__name__}")
    values: dict[str, object] = {}
    for entry in data.get("defaults") or []:
        if isinstance(entry, str):
            if entry != "_self_":
                values.update(_read(folder, entry.removeprefix("/"), given, seen + (name,)))
        elif isinstance(entry, dict):
            for group, choice in entry.items():
                if "megatron" in f"{group} {choice}".lower():
                    raise ConfigError(f"{path}: defaults entry {group}: {choice}: {MEGATRON}")
    body = {k: v for k, v in data.items() if k not in ("defaults", "hydra")}
    values.update(_flatten(body, ""))
    return values


def _flatten(node: dict, prefix: str) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in node.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_flatten(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def resolve_interpolations(overrides: dict[str, object], defaults: dict[str, object],
                           read: set[str]) -> dict[str, object]:
    """`${a.b}` in values, replaced by what a.b holds (the overrides first, then veRL's defaults). A value
    that is one reference takes the referenced value's type. A key that matters here (in `read`) whose
    reference cannot be resolved is an error; any other key keeps its text (it has no effect)."""
    known = {**defaults, **overrides}
    out = dict(overrides)

    def lookup(key: str, reference: str, depth: int) -> object:
        if reference not in known or depth > 10:
            raise KeyError(reference)
        return resolve(key, known[reference], depth + 1)

    def resolve(key: str, value: object, depth: int = 0) -> object:
        if not isinstance(value, str) or "${" not in value:
            return value
        whole = _REFERENCE.fullmatch(value.strip())
        if whole:
            return lookup(key, whole.group(1).strip(), depth)
        return _REFERENCE.sub(lambda m: str(lookup(key, m.group(1).strip(), depth)), value)

    for key, value in overrides.items():
        try:
            out[key] = resolve(key, value)
        except KeyError as missing:
            if key in read:
                raise ConfigError(f"{key}={value}: the interpolation names {missing.args[0]}, which is neither "
                                  f"set nor one of veRL's defaults known here; give {key}=VALUE on the "
                                  "command line") from None
    return out
