"""services/common/log.py: one line per event; `level` is the logging level, never a field."""

import logging

import pytest

from services.common.log import get_logger, log_event


def test_an_event_is_one_line_with_its_fields(capsys):
    log = get_logger("logtest")
    log_event(log, "engine.sleep", request_id="r1", sleep_level=1, note="two words", empty="")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].endswith('INFO logtest engine.sleep request_id=r1 sleep_level=1 note="two words" empty=""'), err


def test_a_field_named_level_is_refused_not_dropped(capsys):
    """A field called `level` (a sleep level of 1, say) would become the record's logging level,
    below DEBUG, and the line would vanish without a word."""
    log = get_logger("logtest2")  # a logger of its own: get_logger binds the stderr of its first call
    with pytest.raises(ValueError, match="level=1 is not a logging level"):
        log_event(log, "engine.sleep", level=1)
    log_event(log, "config.warning", level=logging.WARNING, message="kept")
    assert "WARNING logtest2 config.warning message=kept" in capsys.readouterr().err
