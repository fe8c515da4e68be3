"""A real HTTP reward server (aiohttp) for the reward tests, with one route per behaviour.

    python -m tests.reward.http_reward_server --port 0 --ready_file FILE

Good answers give reward = 1.0 when the label occurs in the query else 0.0, score = len(query),
and extra_logs {"query_len": len(query)}. Routes:

    /ok             the good answer
    /slow?s=2       the good answer after s seconds
    /flaky?fails=2&key=k   HTTP 500 for the first `fails` calls with this key, then the good answer
    /garbage        200 with a body that is not JSON
    /empty          200 with an empty body
    /short          one reward fewer than samples
    /nan?label=x    NaN for the samples labelled x (without ?label: for the last sample)
    /string         a string instead of a number for the first sample
    /missing        a JSON object without "rewards"
    /reject         HTTP 400
    /cut            sends half of the answer, then closes the connection
    /scalar         as an OpenRLHF 0.10 server, which gets one sample per request: single numbers for
                    rewards, scores and every extra_logs entry (those of the first sample)
    /by_label       the behaviour named by the first sample's label, e.g. "mode:slow:2", "mode:flaky:2:k",
                    "mode:garbage" (any route above; its parameters in order); other labels: /ok
    /stats          JSON {route: calls, "max_concurrent": n, "in_flight": n, "batch_sizes": [...]}; ?reset=1 clears
"""

import argparse
import asyncio
import json
import os
import pathlib
from collections import Counter

from aiohttp import web

calls: Counter = Counter()
flaky_seen: Counter = Counter()
batch_sizes: list[int] = []
concurrency = {"now": 0, "max": 0}


def good_answer(body: dict) -> dict:
    queries, labels = body["query"], body["labels"]
    return {"rewards": [1.0 if label and label in q else 0.0 for q, label in zip(queries, labels)],
            "scores": [float(len(q)) for q in queries],
            "extra_logs": {"query_len": [float(len(q)) for q in queries]}}


def route_from_label(label: str) -> tuple[str, dict]:
    """'mode:slow:2' -> ("slow", {"s": "2"}); 'mode:flaky:2:k' -> ("flaky", {"fails": "2", "key": "k"})."""
    if not label.startswith("mode:"):
        return "ok", {}
    name, *args = label.split(":")[1:]
    keys = {"slow": ["s"], "flaky": ["fails", "key"], "nan": ["label"]}.get(name, [])
    return name, dict(zip(keys, args))


async def reward(request: web.Request) -> web.StreamResponse:
    route = request.match_info["route"]
    body = await request.json()
    params = dict(request.query)
    if route == "by_label":
        route, params = route_from_label(body["labels"][0] if body["labels"] else "")
    calls[route] += 1
    concurrency["now"] += 1
    concurrency["max"] = max(concurrency["max"], concurrency["now"])
    try:
        n = len(body["query"])
        batch_sizes.append(n)
        answer = good_answer(body)
        if route == "slow":
            await asyncio.sleep(float(params.get("s", "2")))
        elif route == "flaky":
            key = params.get("key", "")
            flaky_seen[key] += 1
            if flaky_seen[key] <= int(params.get("fails", "2")):
                return web.Response(status=500, text="internal error, try again")
        elif route == "garbage":
            return web.Response(text="<html>this is not json</html>")
        elif route == "empty":
            return web.Response(body=b"")
        elif route == "short":
            answer["rewards"] = answer["rewards"][:-1]
        elif route == "nan":
            if "label" in params:
                bad = [i for i, label in enumerate(body["labels"]) if label == params["label"]]
            else:
                bad = [n - 1]
            for i in bad:
                answer["rewards"][i] = float("nan")
        elif route == "string":
            answer["rewards"][0] = "high"
        elif route == "missing":
            answer = {"score": answer["rewards"]}
        elif route == "reject":
            return web.Response(status=400, text="bad request: labels required")
        elif route == "scalar":
            answer = {"rewards": answer["rewards"][0], "scores": answer["scores"][0],
                      "extra_logs": {"query_len": answer["extra_logs"]["query_len"][0]}}
        elif route == "cut":
            data = json.dumps(answer).encode()
            response = web.StreamResponse(headers={"Content-Type": "application/json"})
            response.content_length = len(data)
            await response.prepare(request)
            await response.write(data[: len(data) // 2])
            request.transport.close()
            return response
        return web.json_response(answer)
    finally:
        concurrency["now"] -= 1


async def stats(request: web.Request) -> web.Response:
    out = {**calls, "max_concurrent": concurrency["max"], "in_flight": concurrency["now"],
           "batch_sizes": list(batch_sizes)}
    if request.query.get("reset"):
        calls.clear()
        flaky_seen.clear()
        batch_sizes.clear()
        concurrency["max"] = 0
    return web.json_response(out)


async def main(port: int, ready_file: str) -> None:
    app = web.Application(client_max_size=1024 ** 3)
    app.router.add_get("/stats", stats)
    app.router.add_post("/{route}", reward)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]
    tmp = pathlib.Path(ready_file + ".tmp")
    tmp.write_text(json.dumps({"port": bound, "pid": os.getpid()}))
    os.replace(tmp, ready_file)
    await asyncio.Event().wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--ready_file", required=True)
    args = parser.parse_args()
    asyncio.run(main(args.port, args.ready_file))
