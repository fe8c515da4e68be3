"""Load on the reward path: many concurrent Score callers against one reward service.

Each target is one real reward service process (`rlmesh serve reward`), called over gRPC by
--streams concurrent callers (one channel each, as separate coordinators or scoring pools would)
that share --samples samples in Score requests of --per_request:

    rule     --reward_func math: math-verify in the service's worker processes
    remote   --remote_rm_url: a loopback HTTP reward server started by this script, in OpenRLHF's
             protocol (POST {"query", "prompts", "labels"} -> {"rewards"}), the service's own path
             to remote servers (services/reward/http_source.py). It answers after --latency_ms, a
             --slow_fraction of calls after --slow_ms, and fails some calls: HTTP 500
             (--error_fraction) or the connection closed without an answer (--drop_fraction), at
             most --max_fails times in a row per chunk, so that --remote_rm_retries 3 always gets
             a chunk through and every sample can be accounted for.

Every sample carries an id whose reward is known in advance (rule: a right or a wrong boxed answer;
remote: the server's reward is a function of the id). The check, per target:

    lost       ids never answered          twice   ids answered more than once (first sends)
    wrong      ids answered with another reward, or answers out of order
    scored     the service's rlmesh_reward_scored_samples_total: each sample scored once, also
               when --resend_every-th requests are sent again under the same request_id (a caller
               that lost the reply): those are answered from the service's memory (deduplicated)
    server     remote: each id answered with HTTP 200 once; the service's retry counter
               (rlmesh_reward_remote_retries_total) equals the server's failed calls, and no chunk
               took more than --remote_rm_retries + 1 attempts
    bounded    remote: a request the server always fails ends UNAVAILABLE after exactly
               --remote_rm_retries retries (counted), within the back-off bound

Latency is per Score call as its caller saw it (queueing in the service included), after one
GetRewardInfo per stream has opened its connection. Baselines measured in the same run: one stream
against the same rule service, and the remote server without slow answers or failures.

    .venv/bin/python bench/reward_load.py                     # 64 streams, 10,000 samples per target
    .venv/bin/python bench/reward_load.py --streams 64 --samples 512 --baseline_samples 128
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import json
import pathlib
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from services.common.ready_file import ServiceStartError, wait_for_ready_file, write_ready_file  # noqa: E402

ID = re.compile(r"\[id=(\d+)\]")
FAIL_ALWAYS = "[fail-always]"  # in a prompt: the HTTP server answers 500 to every attempt


def expected_remote_reward(i: int) -> float:
    """The HTTP server's reward of sample i (distinct values, so a mix-up of samples shows)."""
    return (i % 11) / 10


def expected_rule_reward(i: int) -> float:
    """The math rule's reward of sample i: every third answer is wrong."""
    return 0.0 if i % 3 == 0 else 1.0


# ----------------------------------------------------------------------------------------------
# The slow, failing HTTP reward server (a process of its own, like a real remote server)


@dataclasses.dataclass
class Faults:
    latency_ms: float = 20.0
    slow_fraction: float = 0.1
    slow_ms: float = 400.0
    error_fraction: float = 0.05
    drop_fraction: float = 0.05
    max_fails: int = 2
    seed: int = 0

    def argv(self) -> list[str]:
        return [f"--{k}={v}" for k, v in dataclasses.asdict(self).items()]


def serve_http(faults: Faults, ready_file: str) -> None:
    from aiohttp import web

    rng = random.Random(faults.seed)
    stats: collections.Counter = collections.Counter()
    attempts: collections.Counter = collections.Counter()  # chunk (its first id) -> calls
    answered: collections.Counter = collections.Counter()  # id -> answers with HTTP 200

    async def get_reward(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        ids = [int(ID.search(p).group(1)) for p in body["prompts"]]
        key = ids[0] if ids else -1
        attempts[key] += 1
        stats["calls"] += 1
        slow = rng.random() < faults.slow_fraction
        await asyncio.sleep((faults.slow_ms if slow else faults.latency_ms) / 1000)
        always = any(FAIL_ALWAYS in p for p in body["prompts"])
        draw = rng.random()
        # Every earlier call of this chunk failed (a chunk is answered once): at most max_fails in a row.
        if always or (attempts[key] - 1 < faults.max_fails and draw < faults.error_fraction + faults.drop_fraction):
            if always or draw < faults.error_fraction:
                stats["http_500"] += 1
                return web.Response(status=500, text="overloaded, try again")
            stats["dropped"] += 1
            request.transport.close()  # no answer at all: the client sees the connection closed
            return web.Response()
        stats["ok"] += 1
        answered.update(ids)
        return web.json_response({"rewards": [expected_remote_reward(i) for i in ids]})

    async def report(request: web.Request) -> web.Response:
        return web.json_response({**stats, "answers": sum(answered.values()), "ids_answered": len(answered),
                                  "ids_answered_twice": sum(n > 1 for n in answered.values()),
                                  "max_attempts": max(attempts.values(), default=0),
                                  "attempts_by_chunk": {str(k): n for k, n in attempts.items()}})

    async def main() -> None:
        app = web.Application(client_max_size=1024 ** 3)
        app.router.add_post("/get_reward", get_reward)
        app.router.add_get("/stats", report)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        write_ready_file(ready_file, {"port": site._server.sockets[0].getsockname()[1]})
        await asyncio.Event().wait()

    asyncio.run(main())


def http_stats(url: str) -> dict:
    with urllib.request.urlopen(url.replace("/get_reward", "/stats"), timeout=30) as reply:
        return json.loads(reply.read())


# ----------------------------------------------------------------------------------------------
# Processes


class Processes(contextlib.ExitStack):
    """Started processes, stopped with SIGTERM (then killed) on exit."""

    def start(self, argv: list[str], folder: pathlib.Path, name: str) -> dict:
        ready, log = folder / f"{name}.json", folder / f"{name}.log"
        with log.open("w") as out:
            proc = subprocess.Popen([sys.executable, *argv, "--ready_file", str(ready)], cwd=REPO, stdout=out,
                                    stderr=subprocess.STDOUT)
        self.callback(stop, proc)
        try:
            return wait_for_ready_file(ready, proc, 180, name=name, log_path=log, poll_s=0.05)
        except ServiceStartError as exc:
            raise SystemExit(str(exc)) from None


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


REMOTE_POLICY = {"--remote_rm_timeout_s": "10", "--remote_rm_retries": "3", "--remote_rm_backoff_s": "0.05",
                 "--remote_rm_backoff_max_s": "0.4", "--remote_rm_batch_size": "64", "--remote_rm_max_in_flight": "8"}


def retry_bound_s() -> float:
    """The longest a chunk may take under REMOTE_POLICY (services/reward/remote.py): every attempt
    up to its timeout, plus the longest back-offs between them."""
    retries, timeout = int(REMOTE_POLICY["--remote_rm_retries"]), float(REMOTE_POLICY["--remote_rm_timeout_s"])
    base, cap = float(REMOTE_POLICY["--remote_rm_backoff_s"]), float(REMOTE_POLICY["--remote_rm_backoff_max_s"])
    return (retries + 1) * timeout + sum(min(cap, base * 2 ** attempt) for attempt in range(retries))


def start_reward_service(procs: Processes, folder: pathlib.Path, name: str, *source: str) -> dict:
    """`rlmesh serve reward` with `source` flags, its metrics on a free port."""
    return procs.start(["-m", "services.cli", "serve", "reward", "--host", "127.0.0.1", "--port", "0",
                        "--metrics_port", "0", *source], folder, name)


def start_remote(procs: Processes, folder: pathlib.Path, name: str, faults: Faults) -> tuple[dict, str]:
    """The HTTP reward server with `faults` and a reward service calling it; (service info, URL)."""
    info = procs.start([__file__, "--serve_http", *faults.argv()], folder, f"{name}-http")
    url = f"http://127.0.0.1:{info['port']}/get_reward"
    policy = [x for kv in REMOTE_POLICY.items() for x in kv]
    return start_reward_service(procs, folder, name, "--remote_rm_url", url, *policy), url


def service_metrics(info: dict) -> dict[str, float]:
    """The reward service's counters, summed over their labels (outcomes kept apart)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{info['metrics_port']}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    totals: dict[str, float] = collections.defaultdict(float)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            name = sample.name
            if "outcome" in sample.labels:
                name += f"{{{sample.labels['outcome']}}}"
            totals[name] += sample.value
    return dict(totals)


# ----------------------------------------------------------------------------------------------
# The callers (the service's client modules are imported here, not at the top: the HTTP server
# process of this script needs none of them)


def rule_batch(ids: list[int]):
    from services.reward.source import ScoreBatch

    prompts = [f"[id={i}] What is {i % 97} + {i % 13}? " for i in ids]
    labels = [str(i % 97 + i % 13) for i in ids]
    responses = [f"The answer is \\boxed{{{int(label) + 1 if i % 3 == 0 else label}}}" for i, label in zip(ids, labels)]
    return ScoreBatch.from_texts(prompts, responses, labels, sample_ids=[f"s{i}" for i in ids])


def remote_batch(ids: list[int], marker: str = ""):
    from services.reward.source import ScoreBatch

    prompts = [f"[id={i}]{marker} Say something. " for i in ids]
    return ScoreBatch.from_texts(prompts, ["something"] * len(ids), [str(i) for i in ids],
                                 sample_ids=[f"s{i}" for i in ids])


@dataclasses.dataclass
class Load:
    """What the callers saw."""

    seconds: float = 0.0
    latencies: list[float] = dataclasses.field(default_factory=list)
    answers: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # id -> answers
    wrong: list[int] = dataclasses.field(default_factory=list)
    failed: list[str] = dataclasses.field(default_factory=list)
    resent: int = 0
    resent_same: int = 0  # resent requests answered exactly as the first time


async def drive(address: str, run: str, streams: int, samples: int, per_request: int, batch_of, expected,
                resend_every: int = 0, deadline_s: float = 300.0) -> Load:
    """`streams` callers score samples 0..samples-1 in requests of `per_request`, taking the next
    request as they finish one; request ids start with `run` (the service keeps answers by id)."""
    from grpc import RpcError

    from services.common.tensors import from_proto
    from services.reward.client import RewardClient, score_request

    requests = iter(range(0, samples, per_request))
    load = Load()

    async def stream(client: RewardClient) -> None:
        for start in requests:  # one iterator shared by every stream (one event loop: no race)
            ids = list(range(start, min(start + per_request, samples)))
            request = score_request(batch_of(ids), request_id=f"{run}-{start}")
            t0 = time.perf_counter()
            try:
                reply = await client.stub.Score(request, timeout=deadline_s)
            except RpcError as exc:
                load.failed.append(f"{exc.code().name}: {exc.details()}")
                continue
            load.latencies.append(time.perf_counter() - t0)
            rewards = from_proto(reply.rewards).numpy().tolist()
            if list(reply.sample_ids) != [f"s{i}" for i in ids]:
                load.wrong += ids
            load.answers.update(ids)
            load.wrong += [i for i, r in zip(ids, rewards) if abs(r - expected(i)) > 1e-6]
            if resend_every and (start // per_request) % resend_every == 0:
                again = await client.stub.Score(request, timeout=deadline_s)  # as a caller that lost the reply
                load.resent += 1
                load.resent_same += again.SerializeToString() == reply.SerializeToString()

    clients = [RewardClient(address, timeout_s=deadline_s, channel_retries=False) for _ in range(streams)]
    try:
        await asyncio.gather(*(c.info() for c in clients))  # connected before the clock starts
        t0 = time.perf_counter()
        await asyncio.gather(*(stream(c) for c in clients))
        load.seconds = time.perf_counter() - t0
    finally:
        await asyncio.gather(*(c.close() for c in clients))
    return load


async def always_failing_call(address: str, samples: int = 4) -> tuple[str, float]:
    """One Score the HTTP server fails at every attempt: (status and message, seconds)."""
    from grpc import RpcError

    from services.reward.client import RewardClient, score_request

    client = RewardClient(address, timeout_s=120, channel_retries=False)
    request = score_request(remote_batch(list(range(10 ** 7, 10 ** 7 + samples)), FAIL_ALWAYS), "fail-always")
    t0 = time.perf_counter()
    try:
        await client.stub.Score(request, timeout=120)
        return "OK (expected UNAVAILABLE)", time.perf_counter() - t0
    except RpcError as exc:
        return f"{exc.code().name}: {exc.details()}", time.perf_counter() - t0
    finally:
        await client.close()


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty list."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(-(-q * len(ordered) // 100)) - 1))]


def summary(target: str, streams: int, samples: int, load: Load, before: dict, after: dict,
            server: dict | None = None) -> dict:
    """One row: latency, throughput and the exactly-once checks."""
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    row = {"target": target, "streams": streams, "samples": samples, "requests": len(load.latencies),
           "seconds": load.seconds, "samples_per_s": sum(load.answers.values()) / max(load.seconds, 1e-9),
           "p50_ms": 1000 * percentile(load.latencies, 50) if load.latencies else float("nan"),
           "p99_ms": 1000 * percentile(load.latencies, 99) if load.latencies else float("nan"),
           "max_ms": 1000 * max(load.latencies, default=float("nan")),
           "lost": sum(1 for i in range(samples) if load.answers[i] == 0),
           "twice": sum(1 for n in load.answers.values() if n > 1), "wrong": len(set(load.wrong)),
           "failed_calls": len(load.failed), "failures": load.failed[:3],
           "resent": load.resent, "resent_same": load.resent_same,
           "deduplicated": delta.get("rlmesh_reward_deduplicated_requests_total", 0.0),
           "scored": delta.get("rlmesh_reward_scored_samples_total", 0.0),
           "retries": delta.get("rlmesh_reward_remote_retries_total", 0.0),
           "remote_calls": {k.split("{")[1][:-1]: v for k, v in delta.items()
                            if k.startswith("rlmesh_reward_remote_requests_total{") and v}}
    if server is not None:
        row.update(server_calls=server.get("calls", 0), server_failed=server.get("http_500", 0) + server.get("dropped", 0),
                   server_500=server.get("http_500", 0), server_dropped=server.get("dropped", 0),
                   server_answers=server.get("answers", 0), server_ids_twice=server.get("ids_answered_twice", 0),
                   server_ids=server.get("ids_answered", 0), max_attempts=server.get("max_attempts", 0))
    return row


def run_rule(folder: pathlib.Path, streams: int, samples: int, per_request: int, resend_every: int,
             baseline_samples: int = 0) -> list[dict]:
    """The math rule service: a one-stream baseline (when baseline_samples), then `streams` callers."""
    rows = []
    with Processes() as procs:
        info = start_reward_service(procs, folder, "rule", "--reward_func", "math")
        runs = ([(1, baseline_samples, "rule, 1 stream (baseline)")] if baseline_samples else [])
        runs.append((streams, samples, f"rule, {streams} streams"))
        for n_streams, n_samples, name in runs:
            before = service_metrics(info)
            load = asyncio.run(drive(info["address"], name, n_streams, n_samples, per_request, rule_batch,
                                     expected_rule_reward, resend_every))
            rows.append(summary(name, n_streams, n_samples, load, before, service_metrics(info)))
    return rows


def run_remote(folder: pathlib.Path, streams: int, samples: int, per_request: int, resend_every: int,
               faults: Faults, baseline: bool = False) -> list[dict]:
    """The remote HTTP path with `faults` (and first without any, when baseline), then the
    always-failing request against the faulty one: the bound on retries."""
    rows = []
    with Processes() as procs:
        calm = Faults(latency_ms=faults.latency_ms, slow_fraction=0, error_fraction=0, drop_fraction=0, seed=faults.seed)
        runs = [("remote, no faults (baseline)", calm)] if baseline else []
        runs.append((f"remote, {streams} streams, faults", faults))
        for name, run_faults in runs:
            info, url = start_remote(procs, folder, f"remote-{len(rows)}", run_faults)
            before = service_metrics(info)
            load = asyncio.run(drive(info["address"], name, streams, samples, per_request, remote_batch,
                                     expected_remote_reward, resend_every))
            after = service_metrics(info)
            server = http_stats(url)
            row = summary(name, streams, samples, load, before, after, server)
            rows.append(row)
        # The bound: a chunk the server always fails, on the faulty pair's service.
        status, seconds = asyncio.run(always_failing_call(info["address"]))
        final = service_metrics(info)
        chunk = http_stats(url)["attempts_by_chunk"].get(str(10 ** 7), 0)
        row.update(bounded_status=status, bounded_seconds=seconds, bounded_attempts=chunk,
                   bounded_retries=final.get("rlmesh_reward_remote_retries_total", 0)
                   - after.get("rlmesh_reward_remote_retries_total", 0))
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| target | streams | samples | Score calls | wall s | samples/s | p50 ms | p99 ms | max ms | lost | "
             "twice | wrong | failed calls | scored (metric) | resent / deduplicated | retries (metric) | "
             "server failures (500 + dropped) | max attempts per chunk |",
             "|---|" + "---:|" * 17]
    for r in rows:
        remote = "server_failed" in r
        lines.append(
            f"| {r['target']} | {r['streams']} | {r['samples']} | {r['requests']} | {r['seconds']:.1f} | "
            f"{r['samples_per_s']:.0f} | {r['p50_ms']:.0f} | {r['p99_ms']:.0f} | {r['max_ms']:.0f} | {r['lost']} | "
            f"{r['twice']} | {r['wrong']} | {r['failed_calls']} | {r['scored']:.0f} | "
            f"{r['resent']} / {r['deduplicated']:.0f} | " + (
                f"{r['retries']:.0f} | {r['server_failed']} ({r['server_500']} + {r['server_dropped']}) | "
                f"{r['max_attempts']} |" if remote else "- | - | - |"))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=64, help="concurrent callers")
    parser.add_argument("--samples", type=int, default=10_000, help="samples per target, over all streams")
    parser.add_argument("--per_request", type=int, default=8, help="samples per Score request")
    parser.add_argument("--resend_every", type=int, default=25, help="every Nth request is sent twice (0: none)")
    parser.add_argument("--baseline_samples", type=int, default=1000, help="the one-stream rule baseline's samples")
    parser.add_argument("--targets", default="rule,remote", help="comma-separated: rule, remote")
    parser.add_argument("--json", default="", help="also write the rows as JSON here")
    parser.add_argument("--serve_http", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ready_file", default="", help=argparse.SUPPRESS)
    for field in dataclasses.fields(Faults):
        parser.add_argument(f"--{field.name}", type=type(field.default), default=field.default,
                            help=f"remote server: {field.name} (default {field.default})")
    args = parser.parse_args()
    faults = Faults(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Faults)})
    if args.serve_http:
        serve_http(faults, args.ready_file)
        return

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        targets = args.targets.split(",")
        if "rule" in targets:
            rows += run_rule(pathlib.Path(tmp), args.streams, args.samples, args.per_request, args.resend_every,
                             args.baseline_samples)
        if "remote" in targets:
            rows += run_remote(pathlib.Path(tmp), args.streams, args.samples, args.per_request, args.resend_every,
                               faults, baseline=True)
    print(table(rows))
    by_target = {r["target"]: r for r in rows}
    for r in rows:
        if r["failures"]:
            print(f"{r['target']}: failed calls, e.g. {r['failures']}")
        if "bounded_status" in r:
            print(f"bounded: a chunk failed at every attempt took {r['bounded_attempts']} attempts "
                  f"({r['bounded_retries']:.0f} retries counted) in {r['bounded_seconds']:.2f} s (bound: "
                  f"{retry_bound_s():.2f} s), then {r['bounded_status'][:160]}")
    base, loaded = by_target.get("rule, 1 stream (baseline)"), by_target.get(f"rule, {args.streams} streams")
    if base and loaded:
        print(f"rule: {args.streams} streams / 1 stream: {loaded['samples_per_s'] / base['samples_per_s']:.2f}x "
              f"samples/s, p50 {loaded['p50_ms'] / base['p50_ms']:.1f}x")
    base = by_target.get("remote, no faults (baseline)")
    loaded = by_target.get(f"remote, {args.streams} streams, faults")
    if base and loaded:
        print(f"remote: faults / no faults: {loaded['samples_per_s'] / base['samples_per_s']:.2f}x samples/s, "
              f"p50 {loaded['p50_ms'] / base['p50_ms']:.2f}x, p99 {loaded['p99_ms'] / base['p99_ms']:.2f}x")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1, default=str))


if __name__ == "__main__":
    main()
