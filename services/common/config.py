"""Typed configuration: one dataclass per service, turned into argparse.

Every field is declared with `opt(default, help)`. `parse_config` builds the parser, reads an
optional YAML file (`--config`) that can supply any option (the command line wins), and calls the
dataclass's `validate()` once, at start-up, so a bad combination fails with a message saying what
to change.
"""

import argparse
import dataclasses
import pathlib
import sys
import types
import typing

import yaml

from services.common.config_error import ConfigError, debug_enabled  # noqa: F401 - ConfigError is this module's API too


def opt(default, help: str, choices=None, derived: bool = False, check=None):
    """A dataclass field with its help text. `derived` marks values computed in validate().
    `check(value)` returns "" for a good value, else what is wrong and what to give instead
    ("must be > 0 (e.g. 5e-7)"); check_fields runs it (services.common.flags declares such fields)."""
    meta = {"help": help, "choices": choices, "derived": derived, "check": check}
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def check_fields(config) -> None:
    """Runs the `check` of every field that has one; a bad value is a ConfigError naming the flag."""
    for f in dataclasses.fields(config):
        check = f.metadata.get("check")
        problem = check(getattr(config, f.name)) if check is not None else ""
        if problem:
            raise ConfigError(f"--{f.name} {getattr(config, f.name)} {problem}")


def _base_type(tp):
    """Optional[X] / X | None -> X."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return tp


PROGRAM = ""  # the `rlmesh` console script sets it to "rlmesh <command>" before it runs one


def program_name(cls) -> str:
    """The command the user typed, for usage lines and errors: `rlmesh <command>`, or `python -m MODULE`
    with MODULE as typed (its own module runs as __main__, so cls.__module__ may say "__main__")."""
    if PROGRAM:
        return PROGRAM
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    module = spec.name.removesuffix(".__main__") if spec is not None and spec.name else ""
    if not module.startswith("services."):  # run from elsewhere (a test, a script): the config's package
        module = cls.__module__.rsplit(".", 1)[0]
    return f"python -m {module}"


def build_parser(cls, description: str = "", parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    # Each option's help already states its default (argparse's own would print None: the parser's
    # defaults are None so that a YAML file can fill what the command line leaves out).
    # allow_abbrev=False: a prefix of an option is an error, not silently that option (simpleRL's
    # `--deepspeed FILE` must not become --deepspeed_enable_sleep).
    parser = parser or argparse.ArgumentParser(
        allow_abbrev=False, prog=program_name(cls), description=description or (cls.__doc__ or "").strip(), formatter_class=argparse.RawDescriptionHelpFormatter)
    if openrlhf_namespaced(cls):
        parser.epilog = ("OpenRLHF 0.11's namespaced options (--actor.num_nodes, --ds.zero_stage, --train.colocate_all, "
                         "...) are taken too, each as the option above with its meaning or refused with what to use "
                         "instead: services/common/openrlhf_names.py lists them.")
    parser.add_argument("--config", default=None, metavar="FILE.yaml",
                        help="YAML file whose keys are any of the options below (the command line wins)")
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("derived"):
            continue
        tp = _base_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        help_text = f.metadata.get("help", "")
        if tp is bool:
            parser.add_argument(f"--{f.name}", action=argparse.BooleanOptionalAction, default=None,
                                help=f"{help_text} (default: {default})")
        elif typing.get_origin(tp) is list:
            (item,) = typing.get_args(tp) or (str,)
            parser.add_argument(f"--{f.name}", type=item, nargs="*", default=None,
                                help=f"{help_text} (default: {default})")
        else:
            parser.add_argument(f"--{f.name}", type=tp, default=None, choices=f.metadata.get("choices"),
                                help=f"{help_text} (default: {default})")
    return parser


def unsupported(cls, names) -> str:
    """The message for options in `names` that cls lists in its UNSUPPORTED_FLAGS (options users
    bring from OpenRLHF that rlmesh does not have: each says what to use instead); "" if none."""
    table = getattr(cls, "UNSUPPORTED_FLAGS", {})
    fields = {f.name for f in dataclasses.fields(cls)}
    return "; ".join(f"--{name}: {table[name]}" for name in names if name in table and name not in fields)


def _option_names(argv) -> list[str]:
    return [arg[2:].split("=", 1)[0] for arg in argv if isinstance(arg, str) and arg.startswith("--")]


def from_mapping(cls, values: dict, source: str):
    """Builds cls from a dict (e.g. YAML), rejecting unknown keys with their source."""
    names = {f.name for f in dataclasses.fields(cls)}
    message = unsupported(cls, sorted(values))
    if message:
        raise ConfigError(f"{source}: {message}")
    unknown = sorted(set(values) - names)
    if unknown:
        raise ConfigError(f"{source}: unknown option(s) {unknown}; valid options are listed by --help")
    return values


def openrlhf_namespaced(cls) -> bool:
    """cls takes OpenRLHF 0.11's namespaced options too (services/common/openrlhf_names.py)."""
    return bool(getattr(cls, "OPENRLHF_NAMESPACED", False))


def parse_config(cls, argv=None, description: str = ""):
    """Parses argv (default sys.argv[1:]) into a validated `cls` instance; exits on errors."""
    parser = build_parser(cls, description)
    argv = list(sys.argv[1:] if argv is None else argv)
    if openrlhf_namespaced(cls):
        from services.common.openrlhf_names import translate_argv

        try:
            argv = translate_argv(cls, argv)
        except ConfigError as exc:
            parser.exit(2, f"config error: {exc}\n")
    message = unsupported(cls, _option_names(argv))
    if message:
        parser.exit(2, f"config error: {message}\n")
    args = _parse_known(cls, parser, argv)
    try:
        return config_from_args(cls, args)
    except ConfigError as exc:
        if debug_enabled():
            raise  # the command's run_command prints it with its traceback
        parser.exit(2, f"config error: {exc}\n")


def _parse_known(cls, parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """parse_args, except that an unknown option is named with what it was probably meant to be
    (services/common/option_hints.py) instead of argparse's usage dump; an OpenRLHF option given
    with its default value is dropped with a note."""
    from services.common.openrlhf_names import NAMES, split_options
    from services.common.option_hints import explain

    args, extra = parser.parse_known_args(argv)
    if not extra:
        return args
    known = [o[2:] for o in parser._option_string_actions if o.startswith("--")]
    if openrlhf_namespaced(cls):
        known += list(NAMES)
    errors = []
    for name, values in split_options(extra):
        if not name:
            errors.append(f"{' '.join(values)}: not an option (options start with --; see --help)")
            continue
        sentence, is_error = explain(name, values, known)
        if is_error:
            errors.append(sentence)
        else:
            print(f"{parser.prog}: note: {sentence}; dropped", file=sys.stderr)
    if errors:
        parser.exit(2, "".join(f"{parser.prog}: config error: {e}\n" for e in errors))
    return args


def config_from_args(cls, args: argparse.Namespace):
    values: dict = {}
    if args.config:
        path = pathlib.Path(args.config)
        if not path.is_file():
            raise ConfigError(f"--config {path}: no such file")
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"--config {path}: must be a mapping of option: value")
        if openrlhf_namespaced(cls):
            loaded = _namespaced_keys(cls, loaded, str(path))
        values.update(from_mapping(cls, {k.replace("-", "_"): v for k, v in loaded.items()}, str(path)))
    for f in dataclasses.fields(cls):
        given = getattr(args, f.name, None)
        if given is not None:
            values[f.name] = given
    config = cls(**values)
    validate = getattr(config, "validate", None)
    if validate is not None:
        validate()
    return config


def _namespaced_keys(cls, loaded: dict, source: str) -> dict:
    """A YAML file's OpenRLHF 0.11 keys (`ds.zero_stage: 3` or `ds: {zero_stage: 3}`) as cls's flat ones."""
    from services.common.openrlhf_names import mapping_to_argv, translate_argv

    tokens, rest = mapping_to_argv(loaded)
    if not tokens:
        return loaded
    try:
        argv = translate_argv(cls, tokens)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    both = sorted(set(_option_names(argv)) & {k.replace("-", "_") for k in rest})
    if both:
        raise ConfigError(f"{source}: {', '.join(both)} given twice (an OpenRLHF 0.11 key and the flat one); keep one")
    parsed = build_parser(cls).parse_args(argv)
    return {**rest, **{k: v for k, v in vars(parsed).items() if v is not None and k != "config"}}


def to_argv(config) -> list[str]:
    """The command line that reproduces `config` (used to start services as subprocesses)."""
    argv: list[str] = []
    for f in dataclasses.fields(config):
        if f.metadata.get("derived"):
            continue
        value = getattr(config, f.name)
        if isinstance(value, bool):
            argv.append(f"--{f.name}" if value else f"--no-{f.name}")
        elif isinstance(value, list):
            argv += [f"--{f.name}", *map(str, value)]
        elif value is not None:
            argv += [f"--{f.name}", str(value)]
    return argv


if __name__ == "__main__":
    sys.exit("services.common.config is a library")
