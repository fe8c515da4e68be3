"""bench/gpu/peer_run.py's host monitor (for vs_peers.py and learn_peers.py): the machine's CPU busy and
stolen shares over a run's steps (a GPU machine's host side can slow every framework's step)."""

import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench" / "gpu"))

import peer_run  # noqa: E402


def test_the_monitor_reads_this_machines_cpu_time_and_sees_a_busy_core():
    host = peer_run.HostMonitor(every_s=0.05)
    host.start()
    t0 = time.monotonic()
    while time.monotonic() - t0 < 0.6:  # one core busy
        sum(i * i for i in range(1000))
    t1 = time.monotonic()
    host.stop()
    assert len(host.samples) >= 5 and all(b <= t for _, b, _, t in host.samples)
    share = peer_run.host_share(host.samples, t0, t1)
    # One of the machine's cores was busy at least (others' work may add to it).
    assert 0.8 / share["cores"] <= share["busy"] <= 1.0 and 0.0 <= share["steal"] <= 1.0, share


def test_shares_between_the_samples_nearest_the_window(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 1 2 3\n")
    # user + system = 150 busy, idle + iowait = 850, no steal: 1,000 ticks since boot
    assert peer_run.HostMonitor(path=str(stat)).read() == (150, 0, 1000)
    samples = [(0.0, 150, 0, 1000), (1.0, 400, 100, 2000), (2.0, 900, 300, 3000)]
    assert peer_run.host_share(samples, 0.9, 2.1) == {"busy": 0.5, "steal": 0.2, "cores": os.cpu_count()}
    assert peer_run.host_share(samples[:1], 0.0, 1.0) is None
