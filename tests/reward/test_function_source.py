"""Reward function files: loading, arguments, return forms, worker processes, time limits, errors."""

import asyncio
import os
import pathlib
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest

from services.common.config import ConfigError
from services.common.errors import ServiceError
from services.reward.function_source import FunctionRewardSource, load_reward_func
from services.reward.source import ScoreBatch

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "reward_func.py"


def write(tmp_path, body: str) -> str:
    path = tmp_path / "my_reward.py"
    path.write_text(body)
    return str(path)


def run(source, batch, close: bool = False):
    async def go():
        await source.start()
        try:
            return await source.score(batch)
        finally:
            if close:
                await source.close()

    return asyncio.run(go())


def score_error(source, batch) -> ServiceError:
    with pytest.raises(ServiceError) as err:
        run(source, batch)
    return err.value


def test_example_file(tmp_path):
    source = FunctionRewardSource.from_file(str(EXAMPLE), timeout_s=10, batch_size=2)
    responses = ["so \\boxed{4}", "\\boxed{5}", "maybe 4", "\\boxed{4}" + "x" * 300]
    out = run(source, ScoreBatch.from_texts(["2+2="] * 4, responses, ["4"] * 4), close=True)
    np.testing.assert_allclose(out.rewards, [1.0, 0.0, 0.0, 1.0 - 0.001 * (len(responses[3]) - 200)])
    np.testing.assert_array_equal(out.extra["has_boxed"], [1, 1, 0, 1])


def test_positional_only_function_gets_no_extra_arguments_and_may_return_a_tensor(tmp_path):
    path = write(tmp_path, "import torch\n"
                           "def reward_func(queries, prompts, labels):\n"
                           "    return torch.tensor([float(len(q)) for q in queries])\n")
    out = run(FunctionRewardSource.from_file(path, timeout_s=10), ScoreBatch.from_texts(["ab", "c"], ["d", ""]),
              close=True)
    np.testing.assert_array_equal(out.rewards, [3.0, 1.0])


def test_named_optional_arguments_are_passed(tmp_path):
    path = write(tmp_path, "def reward_func(queries, prompts, labels, data_sources, sample_ids):\n"
                           "    return [float(d == 'math') + len(s) for d, s in zip(data_sources, sample_ids)]\n")
    batch = ScoreBatch.from_texts(["a", "b"], ["", ""], sample_ids=["xy", "z"], data_sources=["math", "code"])
    source = FunctionRewardSource.from_file(path, timeout_s=10)
    np.testing.assert_array_equal(run(source, batch, close=True).rewards, [3.0, 1.0])


def test_runs_off_the_event_loop_and_times_out_per_batch(tmp_path):
    path = write(tmp_path, "import time\n"
                           "def reward_func(queries, prompts, labels, **kw):\n"
                           "    time.sleep(float(labels[0]))\n"
                           "    return [1.0] * len(queries)\n")
    source = FunctionRewardSource.from_file(path, timeout_s=1.0)

    async def go():
        await source.start()
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        task = asyncio.create_task(ticker())
        ok = await source.score(ScoreBatch.from_texts(["a"], ["b"], ["0.6"]))
        assert ticks >= 8  # the loop kept running while the function slept 0.6 s
        t0 = time.monotonic()
        with pytest.raises(ServiceError) as err:
            await source.score(ScoreBatch.from_texts(["a"], ["b"], ["30"]))
        assert time.monotonic() - t0 < 2
        task.cancel()
        # A later batch is scored while the stuck call is still running in the background.
        again = await source.score(ScoreBatch.from_texts(["a"], ["b"], ["0"]))
        await source.close()
        return ok, err.value, again

    ok, err, again = asyncio.run(go())
    assert ok.rewards.tolist() == [1.0] and again.rewards.tolist() == [1.0]
    assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "--reward_func_timeout_s 1 s" in err.message and "my_reward.py" in err.message


def test_exception_and_bad_answers(tmp_path):
    path = write(tmp_path, "def reward_func(queries, prompts, labels, **kw):\n"
                           "    if labels[0] == 'raise':\n"
                           "        raise ValueError('cannot grade this')\n"
                           "    if labels[0] == 'short':\n"
                           "        return [1.0] * (len(queries) - 1)\n"
                           "    return {'rewards': [1.0] * len(queries), 'scores': [float('inf')] * len(queries)}\n")
    source = FunctionRewardSource.from_file(path, timeout_s=10)
    cases = {"raise": (grpc.StatusCode.INTERNAL, "raised ValueError: cannot grade this"),
             "short": (grpc.StatusCode.FAILED_PRECONDITION, "'rewards' has 2 values for 3 samples"),
             "inf": (grpc.StatusCode.FAILED_PRECONDITION, "'scores'[0] (sample index 0) is inf")}
    for label, (code, words) in cases.items():
        with pytest.raises(ServiceError) as err:
            run(source, ScoreBatch.from_texts(["a"] * 3, [""] * 3, [label] * 3))
        assert err.value.code == code and words in err.value.message and "my_reward.py" in err.value.message
    asyncio.run(source.close())


def test_file_problems_are_config_errors(tmp_path):
    # Checked in a worker process when the source is built, before the service serves.
    with pytest.raises(ConfigError, match="importing it failed: ZeroDivisionError"):
        FunctionRewardSource.from_file(write(tmp_path, "x = 1 / 0\n"), timeout_s=10)
    with pytest.raises(ConfigError, match="defines no function reward_func"):
        FunctionRewardSource.from_file(write(tmp_path, "def score(x):\n    return x\n"), timeout_s=10)
    with pytest.raises(ConfigError, match="defines no function reward_func"):
        load_reward_func(write(tmp_path, "def score(x):\n    return x\n"))
    with pytest.raises(ConfigError, match="importing it failed: SyntaxError"):
        load_reward_func(write(tmp_path, "def reward_func(:\n"))
    with pytest.raises(ConfigError, match="no such file"):
        load_reward_func(str(tmp_path / "absent.py"))


def test_signal_based_libraries_work_in_the_worker_main_thread(tmp_path):
    # math-verify limits its own time with SIGALRM, which only the main thread may set: in a thread
    # every comparison fails and the reward is a silent 0.
    path = write(tmp_path, "import threading\n"
                           "from math_verify import parse, verify\n"
                           "def reward_func(queries, prompts, labels, responses, **kw):\n"
                           "    assert threading.current_thread() is threading.main_thread()\n"
                           "    return [float(verify(parse('\\\\boxed{' + l + '}'), parse(r)))\n"
                           "            for r, l in zip(responses, labels)]\n")
    source = FunctionRewardSource.from_file(path, timeout_s=60, batch_size=2)
    out = run(source, ScoreBatch.from_texts(["q"] * 3, ["\\boxed{\\frac{1}{2}}", "so \\boxed{3}", "\\boxed{7}"],
                                            ["0.5", "3", "8"]), close=True)
    np.testing.assert_array_equal(out.rewards, [1.0, 1.0, 0.0])


def test_a_hang_or_crash_names_the_file_and_the_sample_and_the_worker_is_replaced(tmp_path):
    path = write(tmp_path, "import os, time\n"
                           "def reward_func(queries, prompts, labels, **kw):\n"
                           "    if 'hang' in labels:\n"
                           "        while True:\n"
                           "            time.sleep(0.1)  # stuck, as in an endless loop\n"
                           "    if 'crash' in labels:\n"
                           "        os._exit(3)\n"
                           "    if 'raise' in labels:\n"
                           "        {}['missing']\n"
                           "    return [1.0] * len(queries)\n")
    source = FunctionRewardSource.from_file(path, timeout_s=2, batch_size=1, max_in_flight=2)

    def batch(label):
        return ScoreBatch.from_texts(["a", "b"], ["", ""], ["ok", label], sample_ids=["p0/0", "p0/1"])

    t0 = time.monotonic()
    hang = score_error(source, batch("hang"))
    assert time.monotonic() - t0 < 10
    assert hang.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "my_reward.py" in hang.message and 'sample 1 (id "p0/1")' in hang.message
    crash = score_error(source, batch("crash"))
    assert crash.code == grpc.StatusCode.INTERNAL and "exit code 3" in crash.message
    assert "my_reward.py" in crash.message and 'sample 1 (id "p0/1")' in crash.message
    raised = score_error(source, batch("raise"))
    assert raised.code == grpc.StatusCode.INTERNAL and "raised KeyError: 'missing'" in raised.message
    assert 'sample 1 (id "p0/1")' in raised.message and "my_reward.py\", line 9" in raised.message
    # The killed workers were replaced; never more than max_in_flight at once.
    np.testing.assert_array_equal(run(source, batch("ok")).rewards, [1.0, 1.0])
    assert source._live <= 2
    asyncio.run(source.close())


OPENRLHF_MATH_FILE = """import torch

def reward_func(queries, prompts, labels, **kwargs):
    # As OpenRLHF's examples/python/math_reward_func.py: one accuracy for the whole batch.
    rewards = torch.tensor([1.0 if q.endswith(l) else 0.0 for q, l in zip(queries, labels)])
    return {"rewards": rewards, "scores": rewards, "extra_logs": {"math_accuracy": rewards.mean()}}
"""


def test_scalar_extra_logs_are_batch_metrics_not_per_sample_values(tmp_path):
    source = FunctionRewardSource.from_file(write(tmp_path, OPENRLHF_MATH_FILE), timeout_s=30, batch_size=3)
    batch = ScoreBatch.from_texts(["q"] * 5, ["4", "5", "4", "4", "x"], ["4"] * 5)
    out = run(source, batch, close=True)
    np.testing.assert_array_equal(out.rewards, [1, 0, 1, 1, 0])
    assert "math_accuracy" not in out.extra
    # Calls of 3 and 2 samples with accuracies 2/3 and 1/2: weighted by their samples, 3/5 overall.
    weighted_sum, samples = out.batch["math_accuracy"]
    assert samples == 5 and weighted_sum == pytest.approx(3.0)


def test_one_sample_calls_may_return_single_numbers(tmp_path):
    path = write(tmp_path, "import torch\n"
                           "def reward_func(queries, prompts, labels, **kw):\n"
                           "    return {'rewards': float(len(queries[0])), 'scores': torch.tensor(0.5),\n"
                           "            'extra_logs': {'n': 2.0}}\n")
    source = FunctionRewardSource.from_file(path, timeout_s=30, batch_size=1)
    out = run(source, ScoreBatch.from_texts(["a", "bb", "c"], ["", "", ""]))
    np.testing.assert_array_equal(out.rewards, [1.0, 2.0, 1.0])
    np.testing.assert_array_equal(out.scores, [0.5, 0.5, 0.5])
    assert out.batch == {"n": (6.0, 3)}
    source.batch_size = 2  # the same answers for two samples per call cannot be split
    err = score_error(source, ScoreBatch.from_texts(["a", "bb"], ["", ""]))
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "'rewards' is one number (1) for 2 samples" in err.message and "--remote_rm_batch_size 1" in err.message
    asyncio.run(source.close())


def test_functions_handed_over_in_python_are_imported_by_name_in_the_workers(tmp_path):
    # A script, as `python my_server.py` runs it with serve_reward_function(reward_func): the workers run
    # the file under another name (its __main__ part stays out) and take reward_func from it.
    script = tmp_path / "my_server.py"
    script.write_text("import asyncio, os, sys\n"
                      "def reward_func(queries, prompts, labels, **kw):\n"
                      "    return [float(os.getpid() != PARENT)] * len(queries)\n"
                      "PARENT = int(os.environ.get('PARENT_PID', '0'))\n"
                      "if __name__ == '__main__':\n"
                      "    os.environ['PARENT_PID'] = str(os.getpid())\n"
                      "    from services.reward.function_source import FunctionRewardSource\n"
                      "    from services.reward.source import ScoreBatch\n"
                      "    source = FunctionRewardSource(reward_func, 'reward_func', timeout_s=30)\n"
                      "    out = asyncio.run(source.score(ScoreBatch.from_texts(['a', 'b'], ['', ''])))\n"
                      "    print('rewards', out.rewards.tolist())\n")
    env = {**os.environ, "PYTHONPATH": str(EXAMPLE.parents[1])}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rewards [1.0, 1.0]" in done.stdout  # scored in another process
    with pytest.raises(ConfigError, match="not defined at module level"):
        FunctionRewardSource(lambda queries, prompts, labels: [0.0] * len(queries), "lambda", timeout_s=10)


def test_a_stuck_worker_ends_when_the_service_is_killed(tmp_path):
    """Nothing can stop a worker stuck in user code once its service is SIGKILLed; it notices and exits."""
    import signal

    hang = write(tmp_path, "import time\n"
                           "def reward_func(queries, prompts, labels, **kw):\n"
                           "    time.sleep(3600)\n")
    script = tmp_path / "service.py"
    script.write_text("import asyncio, sys\n"
                      "from services.reward.function_source import FunctionRewardSource\n"
                      "from services.reward.source import ScoreBatch\n"
                      f"source = FunctionRewardSource.from_file({hang!r}, timeout_s=3600)\n"
                      "print('worker', source._idle[0].process.pid, flush=True)\n"
                      "asyncio.run(source.score(ScoreBatch.from_texts(['a'], [''])))\n")
    env = {**os.environ, "PYTHONPATH": str(EXAMPLE.parents[1])}
    service = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        worker = int(service.stdout.readline().split()[1])
        time.sleep(1.0)  # the call is running in the worker
        os.kill(service.pid, signal.SIGKILL)
        service.wait(10)
        deadline = time.monotonic() + 15
        status = pathlib.Path(f"/proc/{worker}/status")
        while time.monotonic() < deadline:
            try:
                if "\nState:\tZ" in status.read_text():  # exited; the init process has yet to reap it
                    return
            except FileNotFoundError:
                return
            time.sleep(0.2)
        pytest.fail(f"worker {worker} outlived its killed service")
    finally:
        if service.poll() is None:
            service.kill()


VERL_FILE = '''
import re

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # veRL's convention: one sample per call, a number or a dict whose "score" is the reward.
    assert extra_info == {}
    found = re.findall(r"####\\s*(-?\\d+)", solution_str)
    if not found:
        return 0.0
    right = found[-1] == ground_truth
    return {"score": 1.0 if right else 0.1, "acc": right, "pred": found[-1], "gsm": data_source == "openai/gsm8k"}

def strict(solution_str, ground_truth):
    return solution_str.strip() == ground_truth
'''


def test_verl_compute_score_files_are_served(tmp_path):
    """A veRL reward file (custom_reward_function.path, name compute_score) runs unchanged: solution_str
    is the response text, ground_truth the label, data_source the sample's; a dict answer's "score" is
    the reward and its other numeric keys become per-sample logs ("pred", a string, is dropped)."""
    path = write(tmp_path, VERL_FILE)
    batch = ScoreBatch.from_texts(["q"] * 3, ["so #### 4", "#### 5", "no answer"], ["4", "4", "4"],
                                  data_sources=["openai/gsm8k", "math", "openai/gsm8k"])
    out = run(FunctionRewardSource.from_file(path, timeout_s=10, batch_size=2), batch, close=True)
    np.testing.assert_allclose(out.rewards, [1.0, 0.1, 0.0])
    # The second call (one sample, a plain number) logs nothing: NaN there, as for any missing log.
    np.testing.assert_array_equal(out.extra["acc"], [1.0, 0.0, np.nan])
    np.testing.assert_array_equal(out.extra["gsm"], [1.0, 0.0, np.nan])
    assert set(out.extra) == {"acc", "gsm"}
    out = run(FunctionRewardSource.from_file(path, timeout_s=10, batch_size=3), batch, close=True)
    assert out.extra == {}  # one call; "no answer" returned a number: only keys in every answer of a call stay
    both = ScoreBatch.from_texts(["q"] * 2, ["#### 4", "#### 5"], ["4", "4"], data_sources=["openai/gsm8k", "x"])
    out = run(FunctionRewardSource.from_file(path, timeout_s=10), both, close=True)
    np.testing.assert_allclose(out.rewards, [1.0, 0.1])
    np.testing.assert_array_equal(out.extra["acc"], [1.0, 0.0])
    np.testing.assert_array_equal(out.extra["gsm"], [1.0, 0.0])
    assert "pred" not in out.extra
    # Another function of the file by name (veRL's custom_reward_function.name), taking fewer arguments.
    out = run(FunctionRewardSource.from_file(f"{path}:strict", timeout_s=10),
              ScoreBatch.from_texts(["q"] * 2, [" 7 ", "8"], ["7", "7"]), close=True)
    np.testing.assert_array_equal(out.rewards, [1.0, 0.0])
    with pytest.raises(ConfigError, match="my_reward.py defines no function lenient"):
        FunctionRewardSource.from_file(f"{path}:lenient", timeout_s=10)


def test_verl_batch_and_async_compute_score(tmp_path):
    path = write(tmp_path, "import asyncio\n"
                           "async def compute_score(data_sources, solution_strs, ground_truths, extra_infos, **kw):\n"
                           "    await asyncio.sleep(0)\n"
                           "    return [{'score': float(s == g), 'len': len(s)} for s, g in zip(solution_strs, "
                           "ground_truths)]\n"
                           "async def one(data_source, solution_str, ground_truth, extra_info):\n"
                           "    return {'value': 1} if ground_truth == 'bad' else len(solution_str)\n")
    out = run(FunctionRewardSource.from_file(path, timeout_s=10),
              ScoreBatch.from_texts(["q"] * 3, ["a", "bb", "c"], ["a", "b", "c"]), close=True)
    np.testing.assert_array_equal(out.rewards, [1.0, 0.0, 1.0])
    np.testing.assert_array_equal(out.extra["len"], [1.0, 2.0, 1.0])
    source = FunctionRewardSource.from_file(f"{path}:one", timeout_s=10)
    np.testing.assert_array_equal(run(source, ScoreBatch.from_texts(["q"] * 2, ["abc", ""], ["x", "y"])).rewards,
                                  [3.0, 0.0])
    # A dict without "score" fails the request with what to return, never a reward of zero.
    err = score_error(source, ScoreBatch.from_texts(["q"], ["a"], ["bad"]))
    assert err.code == grpc.StatusCode.INTERNAL
    assert "my_reward.py:one answered a dict without 'score' for sample 0" in err.message
    asyncio.run(source.close())


def test_workers_at_start_load_the_file_together_and_serve_the_first_calls(tmp_path):
    """The workers asked for at start are up before the source serves, and concurrent calls run in
    them: no worker is started for the first calls."""
    path = write(tmp_path, "import os, time\n"
                           "time.sleep(0.5)  # a slow import, as with torch\n"
                           "def reward_func(queries, prompts, labels, **kw):\n"
                           "    time.sleep(0.3)\n"
                           "    return [float(os.getpid())] * len(queries)\n")
    t0 = time.monotonic()
    source = FunctionRewardSource.from_file(path, timeout_s=10, batch_size=1, max_in_flight=3, workers_at_start=3)
    started_s = time.monotonic() - t0
    started = {w.process.pid for w in source._workers}
    assert len(started) == 3 and all(w.alive() for w in source._workers)
    assert started_s < 3 * 0.5 + 1.0  # loaded together, not one after another
    out = run(source, ScoreBatch.from_texts(["a", "b", "c"], ["", "", ""]), close=True)
    assert set(out.rewards.astype(int).tolist()) == started  # three calls at once, in the three workers


def test_a_failing_file_stops_every_worker_started_with_it(tmp_path):
    path = write(tmp_path, "raise RuntimeError('no model here')\n")
    with pytest.raises(ConfigError, match="no model here"):
        FunctionRewardSource.from_file(path, timeout_s=10, max_in_flight=4, workers_at_start=4)
    workers = subprocess.run(["pgrep", "-f", "services.reward.function_worker"], capture_output=True, text=True)
    assert not [pid for pid in workers.stdout.split() if _parent(int(pid)) == os.getpid()]


def _parent(pid: int) -> int:
    try:
        return int(pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1
