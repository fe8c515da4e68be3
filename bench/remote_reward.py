"""Remote reward throughput: the reward service vs one-sample-at-a-time sequential calls.

A loopback HTTP reward server answers every call after a fixed latency (50 ms) whatever the batch
size, like a real reward server dominated by per-call overhead. Baseline: one POST per sample,
each waiting for the previous (how the most used framework calls remote reward servers). rlmesh:
the reward service batches the samples (--batch_size per call), keeps --max_in_flight calls on the
wire, and is called over gRPC with one Score batch. Target: >= 8x the baseline's samples/s.

    .venv/bin/python bench/remote_reward.py [--samples 4096] [--latency_ms 50]
"""

import argparse
import asyncio
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from services.common.ready_file import ServiceStartError, wait_for_ready_file, write_ready_file  # noqa: E402


def serve_http(latency_s: float, ready_file: str) -> None:
    """The fixed-latency HTTP reward server: reward 1 when the label is in the query."""
    from aiohttp import web

    async def get_reward(request: web.Request) -> web.Response:
        body = await request.json()
        await asyncio.sleep(latency_s)
        rewards = [1.0 if label in q else 0.0 for q, label in zip(body["query"], body["labels"])]
        return web.json_response({"rewards": rewards})

    async def main() -> None:
        app = web.Application(client_max_size=1024 ** 3)
        app.router.add_post("/get_reward", get_reward)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        write_ready_file(ready_file, {"port": site._server.sockets[0].getsockname()[1]})
        await asyncio.Event().wait()

    asyncio.run(main())


def start(argv: list[str], ready: pathlib.Path, log: pathlib.Path) -> tuple[subprocess.Popen, dict]:
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, *argv], cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    try:
        return proc, wait_for_ready_file(ready, proc, 120, name=" ".join(argv[:2]), log_path=log, poll_s=0.05)
    except ServiceStartError as exc:
        proc.kill()
        raise SystemExit(str(exc)) from None


def samples(n: int) -> tuple[list[str], list[str], list[str]]:
    prompts = [f"{i % 50}+{i % 7}=" for i in range(n)]
    labels = [str(i % 50 + i % 7) for i in range(n)]
    responses = [f"The answer is \\boxed{{{lab if i % 3 else int(lab) + 1}}}" for i, lab in enumerate(labels)]
    return prompts, responses, labels


def sequential_baseline(url: str, n: int) -> tuple[float, list[float]]:
    """One POST per sample, each after the previous answered."""
    prompts, responses, labels = samples(n)
    rewards = []
    t0 = time.perf_counter()
    for p, r, lab in zip(prompts, responses, labels):
        body = json.dumps({"query": [p + r], "prompts": [p], "labels": [lab]}).encode()
        req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as reply:
            rewards += json.loads(reply.read())["rewards"]
    return time.perf_counter() - t0, rewards


def through_service(address: str, n: int, repeats: int) -> tuple[float, list[float]]:
    """One Score batch of n samples over gRPC; best of `repeats` runs."""
    from services.reward.client import RewardClient
    from services.reward.source import ScoreBatch

    prompts, responses, labels = samples(n)
    batch = ScoreBatch.from_texts(prompts, responses, labels)

    async def run() -> tuple[float, list[float]]:
        client = RewardClient(address)
        try:
            await client.score(batch.slice(0, 8))  # connect once before timing
            best, rewards = float("inf"), []
            for _ in range(repeats):
                t0 = time.perf_counter()
                result = await client.score(batch)
                best, rewards = min(best, time.perf_counter() - t0), result.rewards.tolist()
            return best, rewards
        finally:
            await client.close()

    return asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=4096, help="samples scored through the service")
    parser.add_argument("--baseline_samples", type=int, default=60, help="samples scored one at a time")
    parser.add_argument("--latency_ms", type=float, default=50.0, help="server time per call, any batch size")
    parser.add_argument("--batch_size", type=int, default=64, help="service: samples per remote call")
    parser.add_argument("--max_in_flight", type=int, default=8, help="service: remote calls at once")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--serve_http", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ready_file", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_http:
        serve_http(args.latency_ms / 1000, args.ready_file)
        return

    procs = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        try:
            http, info = start([__file__, "--serve_http", "--latency_ms", str(args.latency_ms),
                                "--ready_file", str(tmp / "http.json")], tmp / "http.json", tmp / "http.log")
            procs.append(http)
            url = f"http://127.0.0.1:{info['port']}/get_reward"
            service, sinfo = start(["-m", "services.reward", "--host", "127.0.0.1", "--port", "0",
                                    "--remote_rm_url", url, "--remote_rm_batch_size", str(args.batch_size),
                                    "--remote_rm_max_in_flight", str(args.max_in_flight),
                                    "--ready_file", str(tmp / "svc.json")], tmp / "svc.json", tmp / "svc.log")
            procs.append(service)

            base_s, base_rewards = sequential_baseline(url, args.baseline_samples)
            svc_s, svc_rewards = through_service(sinfo["address"], args.samples, args.repeats)
            prompts, responses, labels = samples(args.samples)
            want = [1.0 if lab in p + r else 0.0 for p, r, lab in zip(prompts, responses, labels)]
            if svc_rewards != want or base_rewards != want[:args.baseline_samples]:
                raise SystemExit("rewards differ from the server's rule: the benchmark is not measuring scoring")
        finally:
            for proc in procs:
                proc.send_signal(signal.SIGTERM)
            for proc in procs:
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()

    base_rate, svc_rate = args.baseline_samples / base_s, args.samples / svc_s
    print(f"remote HTTP reward server: {args.latency_ms:g} ms per call; service batch {args.batch_size}, "
          f"{args.max_in_flight} calls in flight; {os.cpu_count()} CPUs")
    print(f"{'mode':<38}{'samples':>9}{'seconds':>10}{'samples/s':>12}")
    print(f"{'one sample per call, sequential':<38}{args.baseline_samples:>9}{base_s:>10.3f}{base_rate:>12.1f}")
    print(f"{'reward service (gRPC Score, batched)':<38}{args.samples:>9}{svc_s:>10.3f}{svc_rate:>12.1f}")
    ratio = svc_rate / base_rate
    print(f"ratio: {ratio:.1f}x (target >= 8x) -> {'PASS' if ratio >= 8 else 'FAIL'}")


if __name__ == "__main__":
    main()
