# Copyright (c) brisk developers. BSD-3-Clause license (see LICENSE).
"""Replay N concurrent streaming chat clients against any OpenAI-compatible server.

    python scripts/loadgen.py --url http://127.0.0.1:8000/v1 --clients 8 --requests 64
    python scripts/loadgen.py --url http://127.0.0.1:8080/v1 --clients 8 --requests 64   # llama-server

Each client sends its requests one after the other (the questions below, in turn, from a
different starting point per client), streaming, greedy, with --max_tokens; with --system_words,
behind one system prompt of that many words that every request shares (an application's
instructions, a retrieved document). Reported: completion tokens per second over the wall time,
time to first token (p50 / p99, and the median of each client's first request: a cold server's
burst) and inter-token latency (p50 / p99), errors. Requests and responses go through the official `openai` client, as an application's would.
"""
import argparse
import json
import sys
import threading
import time

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain what a hash table is.",
    "Give me three tips for learning to cook.", "Why is the sky blue?", "What does a compiler do?",
    "Summarize the plot of Romeo and Juliet in two sentences.", "How do vaccines work?",
    "List five prime numbers and say why they are prime.", "What is the difference between weather and climate?",
    "Describe a cat to someone who has never seen one.", "How does a bicycle stay upright?",
]


# A system prompt's words: one passage, repeated as far as --system_words asks.
PASSAGE = ("You answer questions for the readers of a small town library. Be brief and friendly, cite the "
           "shelf where a book stands when you know it, and say so when you do not know something. The library "
           "opens at nine and closes at six, lends books for three weeks, and holds reading hours for children "
           "on Saturday mornings. ").split()


def system_prompt(words: int) -> str:
    return " ".join(PASSAGE[i % len(PASSAGE)] for i in range(words))


def percentile(values: list, q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))] if values else float("nan")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the server's OpenAI base URL")
    p.add_argument("--model", default=None, help="model id (default: the first of /v1/models)")
    p.add_argument("--api_key", default="none")
    p.add_argument("--clients", type=int, default=8, help="concurrent clients")
    p.add_argument("--requests", type=int, default=64, help="requests in all")
    p.add_argument("--max_tokens", type=int, default=64)
    p.add_argument("--system_words", type=int, default=0, help="a system prompt of this many words, in every request")
    p.add_argument("--label", default=None, help="name for this run in the JSON line printed last")
    args = p.parse_args(argv)
    import openai

    client = openai.OpenAI(base_url=args.url, api_key=args.api_key, max_retries=0, timeout=600)
    model = args.model or client.models.list().data[0].id
    ttft, first_ttft, itl, tokens, errors, lock = [], [], [], [0], [], threading.Lock()
    system = [{"role": "system", "content": system_prompt(args.system_words)}] if args.system_words else []

    def one(question: str, first: bool):
        t0 = time.perf_counter()
        times = []
        try:
            stream = client.chat.completions.create(model=model, messages=system + [{"role": "user", "content": question}],
                                                    max_tokens=args.max_tokens, temperature=0, stream=True)
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    times.append(time.perf_counter())
        except openai.OpenAIError as e:
            with lock:
                errors.append(str(e))
            return
        with lock:
            tokens[0] += len(times)
            if times:
                ttft.append(times[0] - t0)
                if first:
                    first_ttft.append(times[0] - t0)
                itl.extend(b - a for a, b in zip(times, times[1:]))

    def client_loop(k: int):
        for i in range(k, args.requests, args.clients):
            one(QUESTIONS[i % len(QUESTIONS)], first=i < args.clients)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client_loop, args=(k,)) for k in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    result = dict(label=args.label or args.url, clients=args.clients, requests=args.requests,
                  tokens=tokens[0], wall_s=wall, tok_s=tokens[0] / wall,
                  ttft_p50_s=percentile(ttft, 50), ttft_p99_s=percentile(ttft, 99),
                  ttft_first_p50_s=percentile(first_ttft, 50), system_words=args.system_words,
                  itl_p50_ms=1e3 * percentile(itl, 50), itl_p99_ms=1e3 * percentile(itl, 99), errors=len(errors))
    print(f"{result['label']}: {args.clients} clients, {args.requests} requests, {tokens[0]} content chunks in "
          f"{wall:.1f} s: {result['tok_s']:.1f} tokens/s; TTFT p50 {result['ttft_p50_s']:.2f} s p99 "
          f"{result['ttft_p99_s']:.2f} s, first requests p50 {result['ttft_first_p50_s']:.2f} s; ITL p50 {result['itl_p50_ms']:.0f} ms p99 {result['itl_p99_ms']:.0f} ms; "
          f"{len(errors)} errors", file=sys.stderr)
    if errors:
        print(f"first error: {errors[0]}", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
