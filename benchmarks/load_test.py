"""Serving load test on loopback: concurrent streaming chat, stream == non-stream check, disconnect storm.

    python benchmarks/load_test.py [--model GGUF] [--clients 32] [--max-tokens 32] [--disconnects 50]
    python benchmarks/load_test.py --url http://127.0.0.1:8000     # an `edgellm serve` already running

Without --url it starts `edgellm serve` in a subprocess on a free loopback port and stops it at the end.
Phases (all bounded in count and time; only loopback addresses are accepted):
  1. reference: one non-streamed greedy chat completion per prompt (sent concurrently);
  2. load: `--clients` concurrent streaming greedy chat requests; each must end with `data: [DONE]`, none may be
     lost, and each stream's text must equal the non-streamed text of the same prompt. Reports P50/P95/P99
     time-to-first-token and inter-token latency as the client sees them, and aggregate tokens/s;
  3. disconnects: `--disconnects` streaming clients hang up mid-stream; once idle, /metrics must show zero KV
     blocks in use, and the server must still answer.
Exit code 0 when every check passes. `--json FILE` writes the figures.
"""
from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import random
import socket
import subprocess
import sys
import time
from urllib.parse import urlparse

import httpx

TOPICS = ["the sea", "a mountain", "coffee", "rain", "a library", "the moon", "bread", "a train", "winter",
          "a garden", "music", "a river", "the desert", "snow", "a city at night", "an old map", "a candle",
          "the wind", "a bicycle", "autumn leaves", "a lighthouse", "tea", "a forest", "a clock", "the sun",
          "a bridge", "a cat", "a violin", "the stars", "a market", "a storm", "a small boat"]


def prompts(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"Write one sentence about {TOPICS[i % len(TOPICS)]}"
                                         f"{'' if i < len(TOPICS) else f' (take {i // len(TOPICS) + 1})'}."}]
            for i in range(n)]


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def check_loopback(url: str) -> None:
    host = urlparse(url).hostname or ""
    if host == "localhost":
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    sys.exit(f"load_test: refusing {url}: only loopback addresses (127.0.0.0/8, ::1, localhost)")


# -- server process ------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_server(options: list[str], *, timeout: float, name: str) -> tuple[subprocess.Popen, str]:
    """`edgellm serve` on a free loopback port with extra options; returns (process, base URL) once healthy."""
    port = free_port()
    cmd = [sys.executable, "-m", "edgellm.cli_serve", "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning", *options]
    proc = subprocess.Popen(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"{name}: server exited with code {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    sys.exit(f"{name}: server did not become healthy in time")


def stop_server(proc: subprocess.Popen | None) -> None:
    """Terminate a server started by launch_server (kill it if it does not exit within 15 s)."""
    if proc is None:
        return
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()


def start_server(args) -> tuple[subprocess.Popen, str]:
    options = ["--max-batch", str(args.max_batch), "--ctx-size", str(args.ctx_size)]
    options += ["--model", args.model] if args.model else []
    options += ["--threads", str(args.threads)] if args.threads else []
    return launch_server(options, timeout=args.load_timeout, name="load_test")


# -- clients -------------------------------------------------------------------------------------------------------
async def chat(client: httpx.AsyncClient, url: str, messages, max_tokens: int) -> dict:
    r = await client.post(url + "/v1/chat/completions",
                          json={"messages": messages, "max_tokens": max_tokens, "temperature": 0})
    r.raise_for_status()
    body = r.json()
    return {"text": body["choices"][0]["message"]["content"], "tokens": body["usage"]["completion_tokens"]}


async def stream_chat(client: httpx.AsyncClient, url: str, messages, max_tokens: int) -> dict:
    """One streaming request: text, [DONE] seen, arrival times of content chunks, usage."""
    t0 = time.perf_counter()
    text, times, done, usage, finish = [], [], False, None, None
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            ev = json.loads(data)
            if "error" in ev:
                raise RuntimeError(ev["error"]["message"])
            if ev.get("usage"):
                usage = ev["usage"]
            for ch in ev.get("choices", []):
                piece = ch["delta"].get("content")
                if piece:
                    text.append(piece)
                    times.append(time.perf_counter())
                finish = ch.get("finish_reason") or finish
    return {"text": "".join(text), "done": done, "t0": t0, "times": times, "usage": usage, "finish": finish}


async def hang_up(client: httpx.AsyncClient, url: str, messages, rng: random.Random) -> str:
    """Stream, then disconnect after a few content chunks or a short random wait, whichever comes first."""
    want, patience = rng.randint(1, 4), rng.uniform(0.5, 8.0)
    body = {"messages": messages, "temperature": 0.7, "stream": True, "ignore_eos": True}  # to the context end
    got = 0

    async def read() -> str:
        nonlocal got
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                    got += 1
                    if got >= want:
                        return "after-tokens"  # leaving the block closes the connection
        return "finished"

    try:
        return await asyncio.wait_for(read(), patience)
    except asyncio.TimeoutError:
        return "while-waiting" if got == 0 else "after-tokens"


async def metric(client: httpx.AsyncClient, url: str, name: str) -> float:
    text = (await client.get(url + "/metrics")).text
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


async def run(args, url: str) -> dict:
    limits = httpx.Limits(max_connections=args.clients + args.disconnects + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout), limits=limits) as client:
        msgs = prompts(args.clients)
        # 1. reference answers, not streamed
        t = time.perf_counter()
        refs = await asyncio.gather(*(chat(client, url, m, args.max_tokens) for m in msgs))
        ref_s = time.perf_counter() - t
        # 2. concurrent streams
        t = time.perf_counter()
        results = await asyncio.gather(*(stream_chat(client, url, m, args.max_tokens) for m in msgs),
                                       return_exceptions=True)
        wall = time.perf_counter() - t
        ok = [r for r in results if isinstance(r, dict)]
        errors = [repr(r) for r in results if not isinstance(r, dict)]
        no_done = sum(not r["done"] for r in ok)
        mismatch = [i for i, (r, ref) in enumerate(zip(results, refs))
                    if isinstance(r, dict) and r["text"] != ref["text"]]
        ttft = [r["times"][0] - r["t0"] for r in ok if r["times"]]
        itl = [b - a for r in ok for a, b in zip(r["times"], r["times"][1:])]
        tokens = sum((r["usage"] or {}).get("completion_tokens", 0) for r in ok)
        # 3. disconnect storm
        rng = random.Random(0)
        dmsgs = prompts(args.disconnects)
        how = await asyncio.gather(*(hang_up(client, url, m, rng) for m in dmsgs), return_exceptions=True)
        deadline = time.time() + args.idle_timeout
        while time.time() < deadline:
            busy = (await metric(client, url, "edgellm_requests_running")
                    + await metric(client, url, "edgellm_requests_waiting"))
            if busy == 0:
                break
            await asyncio.sleep(0.2)
        used = await metric(client, url, "edgellm_kv_blocks_used")
        after = await chat(client, url, msgs[0], args.max_tokens)
    kinds = {k: sum(1 for h in how if h == k) for k in ("after-tokens", "while-waiting", "finished")}
    return {
        "clients": args.clients, "max_tokens": args.max_tokens, "max_batch": args.max_batch,
        "reference_s": round(ref_s, 2), "wall_s": round(wall, 2),
        "completed": len(ok), "errors": errors, "missing_done": no_done, "text_mismatches": mismatch,
        "completion_tokens": tokens, "tokens_per_s": round(tokens / wall, 2) if wall else 0.0,
        "ttft_s": {f"p{p}": round(pct(ttft, p), 4) for p in (50, 95, 99)},
        "itl_s": {f"p{p}": round(pct(itl, p), 4) for p in (50, 95, 99)},
        "disconnects": {"clients": args.disconnects, **kinds,
                        "errors": [repr(h) for h in how if isinstance(h, BaseException)],
                        "kv_blocks_used_when_idle": used},
        "answers_after_disconnects": after["text"] == refs[0]["text"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running server (loopback only); default: start one")
    ap.add_argument("--model", help="GGUF for the started server (default: the bundled model)")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--disconnects", type=int, default=50)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--ctx-size", type=int, default=4096)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--load-timeout", type=float, default=600, help="seconds to wait for /health")
    ap.add_argument("--request-timeout", type=float, default=600)
    ap.add_argument("--idle-timeout", type=float, default=60, help="seconds to wait for idle after disconnects")
    ap.add_argument("--timeout", type=float, default=1800, help="the whole run")
    ap.add_argument("--json", help="write the figures to this file")
    args = ap.parse_args()
    proc = None
    if args.url:
        check_loopback(args.url)
        url = args.url.rstrip("/")
    else:
        proc, url = start_server(args)
    try:
        res = asyncio.run(asyncio.wait_for(run(args, url), args.timeout))
    finally:
        stop_server(proc)
    print(json.dumps(res, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    checks = {
        "all streams completed": res["completed"] == args.clients and not res["errors"],
        "every stream ended with [DONE]": res["missing_done"] == 0,
        "stream text == non-stream text": not res["text_mismatches"],
        "zero KV blocks used after disconnects": res["disconnects"]["kv_blocks_used_when_idle"] == 0,
        "no client errors in the disconnect phase": not res["disconnects"]["errors"],
        "clients hung up mid-stream": res["disconnects"]["finished"] == 0,
        "server answers after disconnects": res["answers_after_disconnects"],
    }
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    t, i = res["ttft_s"], res["itl_s"]
    print(f"TTFT p50/p95/p99 {t['p50']:.3f}/{t['p95']:.3f}/{t['p99']:.3f} s   "
          f"ITL p50/p95/p99 {i['p50'] * 1e3:.1f}/{i['p95'] * 1e3:.1f}/{i['p99'] * 1e3:.1f} ms   "
          f"{res['tokens_per_s']:.1f} tokens/s over {res['clients']} streams")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
