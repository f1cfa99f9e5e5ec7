#!/usr/bin/env python3
"""Load test of a running `kiln serve` (or any OpenAI-compatible server), Python stdlib only.

N concurrent clients each send ROUNDS streaming /v1/completions requests: a prompt of
PROMPT_TOKENS random token ids (from a seed, drawn from the ids /tokenize gives for random
words with special tokens not parsed, so none is special), MAX_TOKENS generated
with ignore_eos. Per concurrency it prints aggregate generated tokens/s (wall time from the
first request to the last token, prefill included), time to first token p50/p99 and
inter-token latency p50/p99, as a markdown table.

    scripts/load-test.py --url http://127.0.0.1:8080 [--concurrency 1,8,32,64] [--rounds 3]
"""
import argparse
import http.client
import json
import random
import sys
import threading
import time
import urllib.parse


def percentile(values, p):
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * p / 100.0
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


class Client:
    def __init__(self, url, api_key, timeout):
        u = urllib.parse.urlparse(url)
        self.host, self.port = u.hostname, u.port or 80
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = "Bearer " + api_key
        self.timeout = timeout

    def get_json(self, path):
        c = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        c.request("GET", path, headers=self.headers)
        r = c.getresponse()
        body = r.read()
        c.close()
        return r.status, json.loads(body or b"null")

    def stream(self, body):
        """One streaming request: (time to first token, [token arrival times], tokens)."""
        c = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        start = time.perf_counter()
        c.request("POST", "/v1/completions", body=json.dumps(body), headers=self.headers)
        r = c.getresponse()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
        arrivals = []
        while True:
            line = r.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']}")
            if event.get("choices") and event["choices"][0].get("finish_reason") is None:
                arrivals.append(time.perf_counter())
        c.close()
        if not arrivals:
            raise RuntimeError("no tokens streamed")
        return arrivals[0] - start, arrivals


def ordinary_token_ids(client, seed):
    """Ids of ordinary (non-special) tokens: /tokenize of random words, special tokens not parsed."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(1, 9))) for _ in range(4000)]
    body = json.dumps({"content": " ".join(words) + " .,;:!?()[]", "add_special": False, "parse_special": False})
    c = http.client.HTTPConnection(client.host, client.port, timeout=client.timeout)
    c.request("POST", "/tokenize", body=body, headers=client.headers)
    r = c.getresponse()
    data = r.read()
    c.close()
    if r.status != 200:
        sys.exit(f"/tokenize answered {r.status}: {data[:300]!r}")
    return sorted(set(json.loads(data)["tokens"]))


def run_level(client, n, args, pool, rng_seed):
    ttfts, itls, counts, errors = [], [], [], []
    lock = threading.Lock()
    barrier = threading.Barrier(n + 1)

    def worker(i):
        rng = random.Random(rng_seed * 1000003 + i)
        barrier.wait()
        for _ in range(args.rounds):
            prompt = [rng.choice(pool) for _ in range(args.prompt_tokens)]
            body = {"prompt": prompt, "max_tokens": args.max_tokens, "ignore_eos": True, "stream": True, "temperature": args.temperature}
            try:
                ttft, arrivals = client.stream(body)
            except Exception as e:  # noqa: BLE001 - reported below
                with lock:
                    errors.append(str(e))
                continue
            with lock:
                ttfts.append(ttft)
                itls.extend(b - a for a, b in zip(arrivals, arrivals[1:]))
                counts.append(len(arrivals))

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    return {"n": n, "tokens": sum(counts), "wall": wall, "ttfts": ttfts, "itls": itls, "errors": errors}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--concurrency", default="1,8,32,64", help="comma-separated client counts")
    ap.add_argument("--rounds", type=int, default=3, help="requests per client")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=1, help="requests sent alone before measuring")
    ap.add_argument("--timeout", type=float, default=600.0)
    args = ap.parse_args()

    client = Client(args.url, args.api_key, args.timeout)
    status, models = client.get_json("/v1/models")
    if status != 200:
        sys.exit(f"/v1/models answered {status}: {models}")
    model = models["data"][0]
    pool = ordinary_token_ids(client, args.seed)
    levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    warm = argparse.Namespace(**{**vars(args), "rounds": args.warmup})
    if args.warmup > 0:
        run_level(client, 1, warm, pool, rng_seed=args.seed + 999)

    print(f"model {model['id']}, prompt {args.prompt_tokens} tokens (ids), {args.max_tokens} generated (ignore_eos), {args.rounds} rounds per client\n")
    print("| clients | requests | generated tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | errors |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    failed = False
    for n in levels:
        r = run_level(client, n, args, pool, rng_seed=args.seed + n)
        ms = lambda v, p: percentile(v, p) * 1000.0  # noqa: E731
        rate = r["tokens"] / r["wall"] if r["wall"] > 0 else 0.0
        print(
            f"| {n} | {len(r['ttfts'])} | {rate:,.0f} | {ms(r['ttfts'], 50):.0f} | {ms(r['ttfts'], 99):.0f} "
            f"| {ms(r['itls'], 50):.1f} | {ms(r['itls'], 99):.1f} | {len(r['errors'])} |",
            flush=True,
        )
        if r["errors"]:
            failed = True
            print(f"  first error: {r['errors'][0]}", file=sys.stderr)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
