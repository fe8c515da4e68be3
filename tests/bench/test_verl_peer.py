"""bench/gpu/verl_peer.py reads veRL's step lines as Ray forwards them from its TaskRunner actor."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench" / "gpu"))

import verl_peer  # noqa: E402


def test_step_lines_with_ray_colour_codes_and_repeats(tmp_path):
    # As seen on the GPU: Ray colours the actor prefix, and may forward a line twice.
    line = ("\x1b[36m(TaskRunnerV1 pid=6450)\x1b[0m step:{n} - global_seqlen/min:147552.0 - "
            "timing_s/gen:np.float64({gen}) - timing_s/step:{step} - response_length/mean:np.float32(274.5) - "
            "actor/pg_loss:nan")
    text = "\n".join(["(WorkerDict pid=1) some warning", line.format(n=1, gen=14.1, step=68.4),
                      line.format(n=2, gen=8.1, step=40.2), line.format(n=2, gen=8.1, step=40.2),
                      "step:3 - timing_s/gen:10.0 - timing_s/step:44.1"])
    log = tmp_path / "verl.log"
    log.write_text(text)
    rows = verl_peer.read_steps(log, 0)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[1]["timing_s/gen"] == 8.1 and rows[1]["timing_s/step"] == 40.2
    assert rows[0]["response_length/mean"] == 274.5 and rows[0]["actor/pg_loss"] != rows[0]["actor/pg_loss"]
    assert [r["step"] for r in verl_peer.read_steps(log, 2)] == [3]
