"""bench/gpu/run_items.py: items and per-job options as arguments, the plan from the estimates and its
warnings, each item's command, the budget left to each item, and the one results file."""

import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench" / "gpu"))

import run_items  # noqa: E402

ESTIMATES = {"lease_s": 1800, "staging_s": 150, "poll_margin_s": 50, "teardown_s": 40,
             "build_s": {"A": 30, "B": 60, "L": 50}, "eval_start_s": 90, "eval_per_checkpoint_s": 5,
             "frameworks": {"A": {"rlmesh": {"startup_s": 100, "step_s": 7.0, "source": "2026-12-04"},
                                  "openrlhf": {"startup_s": 110, "step_s": 14.0, "source": "guess"}},
                            "L": {"rlmesh": {"startup_s": 100, "step_s": 4.0, "source": "guess"},
                                  "trl": {"startup_s": 80, "step_s": 8.0, "source": "guess"}}}}


def test_items_steps_and_job_options_are_parsed():
    args = run_items.parse_args(["--item", "L:rlmesh,trl", "--item", "A:openrlhf", "--steps", "L=12",
                                 "--eval_every", "3", "--args", "A=--rlmesh_engines 1"])
    assert [str(i) for i in args.item] == ["L:rlmesh,trl", "A:openrlhf"]
    assert args.item[0] == run_items.Item("L", ("rlmesh", "trl"))
    assert args.steps == {"A": 4, "B": 4, "L": 12} and args.args == {"A": "--rlmesh_engines 1"}
    for text in ("X:rlmesh", "L", "L:", "L:rlmesh,megatron", "A:trl,trl"):
        with pytest.raises(Exception):
            run_items.parse_item(text)
    with pytest.raises(SystemExit, match="--steps 'L-12'"):
        run_items.parse_args(["--item", "L:rlmesh", "--steps", "L-12"])
    with pytest.raises(SystemExit, match="is not a int"):
        run_items.parse_args(["--item", "L:rlmesh", "--steps", "L=many"])
    with pytest.raises(SystemExit):
        run_items.parse_args(["--item", "L:rlmesh", "--steps", "L=10"])  # not a multiple of --eval_every 4


def test_help_says_what_the_limits_count(capsys):
    with pytest.raises(SystemExit):
        run_items.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "wall-clock limit of ONE framework's run" in text and "~40 s teardown after each run" in text
    assert "wall-clock limit of this whole detached run: builds, framework runs, teardowns and evaluations" in text


def test_the_plan_adds_up_the_estimates_and_warns_past_the_lease_or_budget():
    items = [run_items.Item("L", ("rlmesh", "trl")), run_items.Item("A", ("rlmesh", "openrlhf"))]
    rows = run_items.plan(items, ESTIMATES, {"L": 20, "A": 4}, eval_every=4)
    # L: runs 100 + 20 x 4 = 180 and 80 + 20 x 8 = 240; build 50, 2 teardowns 80, evaluation 90 + 5 x (1 + 2 x 5) = 145
    assert rows[0]["runs_s"] == {"rlmesh": 180.0, "trl": 240.0} and rows[0]["reserve_s"] == 275.0
    assert rows[0]["total_s"] == 695.0
    # A: 128 + 166, build 30, 2 teardowns 80
    assert rows[1]["total_s"] == 128.0 + 166.0 + 110.0
    text, warnings = run_items.plan_text(rows, 0.0, ESTIMATES)
    assert warnings == [] and "ends at ~1099 s" in text and "partly guessed for rlmesh, trl" in text
    _, warnings = run_items.plan_text(rows, 900.0, ESTIMATES)
    assert len(warnings) == 1 and "more than --budget_s 900" in warnings[0]
    long = run_items.plan(items, ESTIMATES, {"L": 100, "A": 4}, eval_every=4)
    _, warnings = run_items.plan_text(long, 0.0, ESTIMATES)
    assert "one GPU machine is held 30 min, of which ~26.7 min are left after staging and polls" in warnings[0]
    assert run_items.item_timeout_s(items[0], ESTIMATES, 20) == 1.5 * 240 + 60


def test_each_item_gets_its_script_frameworks_steps_and_limits(tmp_path):
    args = run_items.parse_args(["--item", "L:rlmesh,trl", "--item", "B:rlmesh", "--steps", "L=8", "--eval_every", "2",
                                 "--args", "L=--learning_rate 3e-6 --model_dir /m", "--dry_run"])
    cmd = run_items.item_command(args.item[0], args, tmp_path / "0-L", tmp_path / "s", 500.4, 300.0)
    assert cmd[1].endswith("learn_peers.py") and cmd[cmd.index("--frameworks") + 1:cmd.index("--frameworks") + 3] == ["rlmesh", "trl"]
    assert cmd[cmd.index("--steps") + 1] == "8" and cmd[cmd.index("--eval_every") + 1] == "2"
    assert cmd[cmd.index("--budget_s") + 1] == "500" and cmd[cmd.index("--timeout_s") + 1] == "300"
    assert cmd[-5:] == ["--dry_run", "--learning_rate", "3e-6", "--model_dir", "/m"]
    cmd = run_items.item_command(args.item[1], args, tmp_path / "1-B", tmp_path / "s", 500.0, 300.0)
    assert cmd[1].endswith("vs_peers.py") and cmd[cmd.index("--jobs") + 1] == "B"
    assert cmd[cmd.index("--timeout_s") + 1:cmd.index("--timeout_s") + 3] == ["300", "300"]


def test_items_past_the_budget_are_reported_not_run_in_the_one_results_file(tmp_path):
    estimates = tmp_path / "estimates.json"
    estimates.write_text(json.dumps(ESTIMATES))
    out = tmp_path / "run"
    # L needs 210 s besides its run, A 70 s: with 120 s, L is left out and A would get 50 s (< 60)
    assert run_items.main(["--item", "L:rlmesh", "--item", "A:openrlhf", "--budget_s", "120", "--out", str(out),
                           "--scratch", str(tmp_path / "scratch"), "--estimates", str(estimates)]) == 0
    report = json.loads((out / "results.json").read_text())
    assert [e["item"] for e in report["items"]] == ["L:rlmesh", "A:openrlhf"]
    assert all(e["error"].startswith("not run:") for e in report["items"])
    assert "WARNING" in (out / "plan.txt").read_text() and report["plan"][0]["item"] == "L:rlmesh"
    with pytest.raises(SystemExit, match="no estimate for A:trl"):
        run_items.main(["--item", "A:trl", "--plan", "--estimates", str(estimates)])


def test_measured_start_ups_and_step_times_for_the_estimates():
    results = [{"job": "A", "framework": "rlmesh", "steps": [{"t_end": 130.0}, {"t_end": 137.0}],
                "step_stats": {"median": 7.0}},
               {"job": "L", "framework": "trl", "steps": [{"t_end": 100.0}], "startup_s": 91.0,
                "step_stats": {"median": 9.0}},
               {"job": "A", "framework": "verl", "error": "stopped"}]
    got = run_items.measured(results, "2026-12-05 10:00")
    assert got == {"A": {"rlmesh": {"startup_s": 123.0, "step_s": 7.0, "source": "2026-12-05 10:00 (run_items.py)"}},
                   "L": {"trl": {"startup_s": 91.0, "step_s": 9.0, "source": "2026-12-05 10:00 (run_items.py)"}}}
