"""bench/reward_load.py at a small size: 64 concurrent Score callers against one real reward service,
with the math rule and with a loopback HTTP reward server that answers slowly and fails (HTTP 500,
dropped connections). Every sample is answered once with its known reward, scored once (also when a
request is sent again under its request_id), the service's retry counter equals the server's
failed calls, and a chunk the server always fails ends after exactly --remote_rm_retries retries."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))

import reward_load  # noqa: E402

STREAMS, SAMPLES, PER_REQUEST, RESEND_EVERY = 64, 512, 4, 10
RETRIES = int(reward_load.REMOTE_POLICY["--remote_rm_retries"])


def assert_exactly_once(row: dict) -> None:
    assert row["failed_calls"] == 0, row["failures"]
    assert (row["lost"], row["twice"], row["wrong"]) == (0, 0, 0), row
    assert row["requests"] == SAMPLES // PER_REQUEST, row
    # Each sample went through the reward source once: the resent requests were answered from memory.
    assert row["scored"] == SAMPLES and row["resent"] == row["resent_same"] == row["deduplicated"] > 0, row


def test_rule_service_under_64_streams(tmp_path):
    (row,) = reward_load.run_rule(tmp_path, STREAMS, SAMPLES, PER_REQUEST, RESEND_EVERY)
    assert_exactly_once(row)
    assert 0 < row["p50_ms"] <= row["p99_ms"] <= row["max_ms"], row


def test_remote_server_slow_and_failing_under_64_streams(tmp_path):
    faults = reward_load.Faults(latency_ms=5, slow_fraction=0.1, slow_ms=150, error_fraction=0.15,
                                drop_fraction=0.15, max_fails=2, seed=1)
    (row,) = reward_load.run_remote(tmp_path, STREAMS, SAMPLES, PER_REQUEST, RESEND_EVERY, faults)
    assert_exactly_once(row)
    # The server answered each id once with HTTP 200, however often its chunk was tried.
    assert (row["server_ids"], row["server_answers"], row["server_ids_twice"]) == (SAMPLES, SAMPLES, 0), row
    # Every failed call was retried once, counted in the service's metric, and no chunk went past the bound.
    assert row["server_500"] > 0 and row["server_dropped"] > 0, row
    assert row["retries"] == row["server_failed"] == row["server_calls"] - SAMPLES // PER_REQUEST, row
    assert row["remote_calls"] == pytest.approx({"ok": SAMPLES // PER_REQUEST, "http_5xx": row["server_500"],
                                                 "connection_error": row["server_dropped"]}), row
    assert 2 <= row["max_attempts"] <= faults.max_fails + 1 <= RETRIES + 1, row
    # A chunk the server always fails: RETRIES + 1 attempts, RETRIES retries counted, then UNAVAILABLE.
    assert row["bounded_status"].startswith(f"UNAVAILABLE: remote reward server(s) unavailable: {RETRIES + 1} "
                                            "attempts"), row["bounded_status"]
    assert (row["bounded_attempts"], row["bounded_retries"]) == (RETRIES + 1, RETRIES), row
    assert row["bounded_seconds"] < reward_load.retry_bound_s(), row
