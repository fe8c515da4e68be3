"""Every option rlmesh shares with OpenRLHF 0.11 has OpenRLHF's default, or the difference is listed, with
its reason, in docs/guides/openrlhf-defaults.md (whose table this test reads).

For each option of OpenRLHF's four training commands (tests/common/openrlhf_defaults.py) the test asks
what OpenRLHF's default means in rlmesh: the option with its default value goes through rlmesh's own
translation (services/common/openrlhf_names.py) and parser, and every flag it sets must already hold
that value by default. An option OpenRLHF leaves unset (None, or a switch left off) must be unset or
off in rlmesh. An option rlmesh refuses must be one whose default rlmesh does anyway."""

from __future__ import annotations

import dataclasses
import math
import pathlib
import re
import warnings

import pytest

from services.common.config import ConfigError, build_parser
from services.common.openrlhf_names import NAMES, Refuse, _rule, translate_argv
from services.common.option_hints import OPENRLHF_ONLY
from services.coordinator.config import CoordinatorConfig
from services.learner.train_dpo import DPOConfig
from services.learner.train_rm import RMConfig
from services.learner.train_sft import SFTConfig
from tests.common.openrlhf_defaults import DEFAULTS

COMMANDS = {"train_ppo_ray": CoordinatorConfig, "train_sft": SFTConfig, "train_rm": RMConfig, "train_dpo": DPOConfig}
DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "guides" / "openrlhf-defaults.md"


def _defaults(cls) -> dict:
    return {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
            for f in dataclasses.fields(cls)}


def _same(ours, theirs) -> bool:
    if theirs is None or theirs is False:
        return ours in (None, False, "", [], 0, 0.0)  # unset or off
    if isinstance(theirs, (list, tuple)):
        return isinstance(ours, (list, tuple)) and len(ours) == len(theirs) and all(map(_same, ours, theirs))
    if isinstance(theirs, (int, float)) and not isinstance(theirs, bool):
        return isinstance(ours, (int, float)) and not isinstance(ours, bool) and math.isclose(ours, theirs)
    if theirs == "inf":
        return False
    return ours == theirs


def _same_text(a: str, b: str) -> bool:
    try:
        return math.isclose(float(a), float(b))
    except ValueError:
        return a == b


def _values(default) -> list[str]:
    return [str(v) for v in default] if isinstance(default, (list, tuple)) else [str(default)]


def difference(command: str, option: str, theirs) -> str:
    """"" when rlmesh's default means OpenRLHF's, else what rlmesh does instead."""
    cls = COMMANDS[command]
    ours = _defaults(cls)
    if "." not in option:  # OpenRLHF 0.11's flat options (lr_scheduler, optim, use_ms, local_rank)
        if option in ours:
            return "" if _same(ours[option], theirs) else repr(ours[option])
        missing = OPENRLHF_ONLY.get(option)
        harmless = missing is not None and missing.default is not None and tuple(_values(theirs)) == missing.default
        return "" if theirs is None or theirs is False or harmless else "no such option"
    if option.split(".")[-2:-1] == ["muon"]:
        return ""  # Muon's settings act only under --optim muon; OpenRLHF's default optimizer is Adam, as rlmesh's
    rule = _rule(option, set(ours)) if option in NAMES else None
    if isinstance(rule, Refuse):  # refused unless given with its default, which rlmesh does anyway
        given = () if theirs is False else tuple(_values(theirs))
        same = rule.default is not None and len(given) == len(rule.default) and all(map(_same_text, given,
                                                                                        rule.default))
        return "" if theirs is None or theirs is False or same else "not supported"
    if theirs is None or theirs is False:  # unset or off there: unset, off or absent here
        flat = getattr(rule, "flat", None)
        return "" if flat not in ours or _same(ours[flat], theirs) else repr(ours[flat])
    if option not in NAMES:
        return "no such option"
    argv = [f"--{option}"] + ([] if theirs is True else _values(theirs))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            parsed = vars(build_parser(cls).parse_args(translate_argv(cls, argv)))
        except ConfigError as exc:
            return f"refused: {exc}"
    changed = {k: v for k, v in parsed.items() if v is not None and k != "config"}
    if not changed:  # a joint option (--algo.advantage.is_correction_*): its companion's translation takes
        return ""      # OpenRLHF's default when it is absent
    wrong = {k: ours[k] for k, v in changed.items() if not _same(ours[k], v)}
    return ", ".join(f"{k} {v!r}" for k, v in sorted(wrong.items()))


def documented() -> dict[tuple[str, str], str]:
    """(command, option) -> reason, from the table rows `| command | --option | OpenRLHF | rlmesh | reason |`."""
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and re.fullmatch(r"train_\w+(, train_\w+)*", cells[0]) and cells[1].startswith("`--"):
            commands = re.findall(r"train_\w+", cells[0])
            for command in commands:
                rows[(command, cells[1].strip("`").removeprefix("--"))] = cells[4]
    return rows


def all_differences() -> dict[tuple[str, str], str]:
    return {(c, o): d for c, options in DEFAULTS.items() for o, v in options.items() if (d := difference(c, o, v))}


def test_every_default_is_openrlhfs_or_documented():
    found, listed = all_differences(), documented()
    undocumented = {k: v for k, v in found.items() if k not in listed}
    assert not undocumented, f"defaults that differ from OpenRLHF 0.11's and are not in {DOC.name}: {undocumented}"
    stale = sorted(set(listed) - set(found))
    assert not stale, f"{DOC.name} lists differences that are gone (remove their rows): {stale}"
    assert all(len(reason) > 15 for reason in listed.values()), "each difference needs its reason"


@pytest.mark.parametrize("command, option, theirs", [("train_sft", "train.max_epochs", 2),
                                                      ("train_dpo", "adam.lr", 1e-5),
                                                      ("train_ppo_ray", "eval.temperature", 0.6)])
def test_the_comparison_sees_a_difference(command, option, theirs):
    """The check itself: a default that differs is found (these are documented ones)."""
    assert difference(command, option, theirs)
    assert difference(command, option, _defaults(COMMANDS[command])[NAMES[option].flat]) == ""
