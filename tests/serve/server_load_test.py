#!/usr/bin/env python3
"""`fp8moe serve` under load, with a real HTTP client (the standard library's http.client).

Starts the server on a free loopback port (random weights of a small config), then N streaming
clients arrive at random times; meanwhile malformed requests (bad JSON, unknown model, prompt
beyond the context, bad sampling parameters) and clients that disconnect mid-stream. Checks that
every well-formed request is answered completely (finish_reason "length", completion_tokens =
max_tokens, "data: [DONE]"), that each bad request gets an OpenAI error body with its 4xx, that
the disconnected requests are freed (no cache blocks in use, nothing queued afterwards), that the
non-streaming answer equals the streamed one for the same seed, and that SIGTERM stops the server
with status 0. Prints throughput and time to first token / inter-token latency at p50 and p99.

Run: tests/serve/server_load_test.py --fp8moe build/bin/fp8moe --config configs/tiny.json [--clients 16]
(registered with ctest as serve_http_load).
"""
import argparse
import http.client
import json
import random
import re
import signal
import subprocess
import sys
import threading
import time


def percentile(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def post(port, path, body, timeout=120):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request("POST", path, body=body if isinstance(body, (bytes, str)) else json.dumps(body),
              headers={"Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, data


def get(port, path):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("GET", path)
    r = c.getresponse()
    data = r.read().decode()
    c.close()
    return r.status, data


def stream(port, path, body, disconnect_after=None):
    """Streams one request; returns (text, finish_reason, usage, ttft, itls, done)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    t0 = time.monotonic()
    c.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"status {r.status}: {r.read()!r}")
    text, reason, usage, ttft, itls, done, events = "", None, None, None, [], False, 0
    last = None
    while True:
        line = r.readline()
        if not line:
            break
        line = line.strip()
        if not line.startswith(b"data: "):
            continue
        payload = line[6:]
        if payload == b"[DONE]":
            done = True
            break
        ev = json.loads(payload)
        ch = ev["choices"][0]
        piece = ch.get("text") if "text" in ch else ch.get("delta", {}).get("content", "")
        now = time.monotonic()
        if piece:
            if ttft is None:
                ttft = now - t0
            else:
                itls.append(now - last)
            last = now
            text += piece
        if ch.get("finish_reason"):
            reason = ch["finish_reason"]
            usage = ev.get("usage")
        events += 1
        if disconnect_after is not None and events >= disconnect_after:
            c.sock.close()  # gone mid-stream
            return text, None, None, ttft, itls, False
    c.close()
    return text, reason, usage, ttft, itls, done


def metric(port, name):
    _, m = get(port, "/metrics")
    found = re.search(rf"^{re.escape(name)} (\S+)$", m, re.M)
    return float(found.group(1)) if found else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fp8moe", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--arrival-window", type=float, default=3.0, help="seconds over which clients arrive")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rng = random.Random(args.seed)

    srv = subprocess.Popen([args.fp8moe, "serve", "--dummy", args.config, "--port", "0", "--cache-blocks", "24",
                            "--max-step-tokens", "128"], stdout=subprocess.PIPE, text=True)
    line = srv.stdout.readline()
    found = re.search(r"listening on http://[\d.]+:(\d+)", line)
    if not found:
        srv.kill()
        sys.exit(f"server did not start: {line!r}")
    port = int(found.group(1))
    print(line.strip())
    failures = []

    def check(cond, what):
        if not cond:
            failures.append(what)
            print("FAIL:", what)

    results = {}

    def client(i, delay):
        time.sleep(delay)
        n = rng.randint(8, 32)
        body = {"model": "fp8moe", "prompt": f"client {i}: " + "abc" * rng.randint(1, 30), "max_tokens": n,
                "temperature": 0.8, "top_p": 0.95, "seed": i, "stream": True}
        path = "/v1/completions"
        if i % 3 == 0:
            path = "/v1/chat/completions"
            body.pop("prompt")
            body["messages"] = [{"role": "user", "content": f"client {i} says hi"}]
        try:
            results[i] = (n, path, body) + stream(port, path, body)
        except Exception as e:  # noqa: BLE001 - any failure is a lost request
            results[i] = (n, path, body, None, None, None, None, [], False, repr(e))

    bad = [
        (b"{not json", 400, None),
        ({"model": "no-such-model", "prompt": "x"}, 404, "model_not_found"),
        ({"model": "fp8moe", "prompt": "x" * 300, "max_tokens": 8}, 400, "context_length_exceeded"),
        ({"model": "fp8moe", "prompt": "x", "temperature": -1}, 400, None),
        ({"model": "fp8moe", "prompt": "x", "top_p": 1.5}, 400, None),
        ({"model": "fp8moe", "prompt": "x", "max_tokens": 0}, 400, None),
        ({"model": "fp8moe"}, 400, None),
    ]
    bad_results = []

    def bad_client(delay, body, status, code):
        time.sleep(delay)
        st, data = post(port, "/v1/completions", body)
        err = json.loads(data).get("error", {})
        bad_results.append((body, status, code, st, err))

    def disconnecting(delay, k):
        time.sleep(delay)
        stream(port, "/v1/completions", {"model": "fp8moe", "prompt": "leaving early", "max_tokens": 120,
                                         "stream": True}, disconnect_after=k)

    t_start = time.monotonic()
    threads = [threading.Thread(target=client, args=(i, rng.uniform(0, args.arrival_window)))
               for i in range(args.clients)]
    threads += [threading.Thread(target=bad_client, args=(rng.uniform(0, args.arrival_window),) + b) for b in bad]
    threads += [threading.Thread(target=disconnecting, args=(rng.uniform(0, args.arrival_window), k)) for k in (2, 3, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t_start

    ttfts, itls, tokens = [], [], 0
    for i in range(args.clients):
        n, path, body, text, reason, usage, ttft, il, done, *err = results[i]
        check(not err, f"client {i}: {err}")
        if err:
            continue
        check(done, f"client {i}: no [DONE]")
        check(reason == "length", f"client {i}: finish_reason {reason}")
        check(usage is not None and usage["completion_tokens"] == n,
              f"client {i}: completion_tokens {usage and usage['completion_tokens']} != {n}")
        tokens += n
        if ttft is not None:
            ttfts.append(ttft)
        itls += il
    for body, status, code, st, err in bad_results:
        check(st == status, f"bad request {body!r}: status {st}, expected {status}")
        check(bool(err.get("message")) and err.get("type") == "invalid_request_error",
              f"bad request {body!r}: error body {err}")
        if code:
            check(err.get("code") == code, f"bad request {body!r}: code {err.get('code')}, expected {code}")

    # The same seed answers the same text, streamed or not.
    body = dict(results[1][2])
    body["stream"] = False
    st, data = post(port, results[1][1], body)
    check(st == 200, f"non-streaming status {st}")
    check(json.loads(data)["choices"][0]["text"] == results[1][3], "non-streaming text differs from the streamed one")

    # Cancelled streams free their blocks: nothing in use, nothing queued once all is answered.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (metric(port, "fp8moe_cache_blocks_in_use") or metric(port, "fp8moe_running_requests")):
        time.sleep(0.1)
    check(metric(port, "fp8moe_cache_blocks_in_use") == 0, "cache blocks still in use")
    check(metric(port, "fp8moe_queue_length") == 0, "requests still queued")
    cancelled = metric(port, 'fp8moe_requests_finished_total{reason="cancelled"}')
    check(cancelled is not None and cancelled >= 3, f"cancelled requests {cancelled}, expected >= 3")
    st, _ = get(port, "/health")
    check(st == 200, "health after the load")

    print(f"{args.clients} streaming clients, {len(bad)} malformed requests, 3 disconnects in {wall:.2f} s: "
          f"{tokens / wall:.1f} tokens/s")
    print(f"TTFT p50 {percentile(ttfts, 0.5) * 1e3:.1f} ms, p99 {percentile(ttfts, 0.99) * 1e3:.1f} ms; "
          f"ITL p50 {percentile(itls, 0.5) * 1e3:.1f} ms, p99 {percentile(itls, 0.99) * 1e3:.1f} ms")

    srv.send_signal(signal.SIGTERM)
    try:
        rc = srv.wait(timeout=30)
    except subprocess.TimeoutExpired:
        srv.kill()
        rc = None
    check(rc == 0, f"server exit status {rc} after SIGTERM")
    if failures:
        sys.exit(f"{len(failures)} failures")
    print("all requests answered")


if __name__ == "__main__":
    main()
