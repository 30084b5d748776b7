"""Writes the small sample traces next to this file (seeded: the same files every time).

    python examples/traces/make_samples.py

mooncake.jsonl     Mooncake / AIPerf trace: timestamp (ms), input_length, output_length, hash_ids (512-token blocks);
                   four shared "system prompts" of 2-3 blocks, each request adding blocks of its own
burstgpt.csv       BurstGPT's columns: Timestamp (s), Model, Request tokens, Response tokens, Total tokens, Log Type;
                   two failed requests (0 response tokens), which a replay skips
conversations.jsonl  ShareGPT-shaped conversations (from/value) and one in OpenAI's messages shape, with timestamps
"""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORDS = ("cache token window engine device server memory clock power request batch queue model prompt reply "
         "stream signal board limit sample").split()


def mooncake(rng: random.Random) -> list[dict]:
    prefixes = [[0, 1], [2, 3, 4], [5, 6], [7, 8, 9]]
    next_id = 10
    out = []
    t = 0
    for _ in range(40):
        t += int(rng.expovariate(1 / 500))  # 2 requests per second on average
        own = rng.randint(0, 2)
        hashes = list(rng.choice(prefixes)) + list(range(next_id, next_id + own))
        next_id += own
        n_in = (len(hashes) - 1) * 512 + rng.randint(64, 512)
        out.append({"timestamp": t, "input_length": n_in, "output_length": rng.randint(16, 128), "hash_ids": hashes})
    return out


def burstgpt(rng: random.Random) -> list[list]:
    rows = []
    t = 0.0
    for i in range(40):
        t += rng.expovariate(2.0) if i % 10 else 0.0  # a burst every ten requests: two at the same second
        model = rng.choice(["ChatGPT", "GPT-4"])
        req = rng.randint(20, 900)
        resp = 0 if i in (13, 27) else rng.randint(8, 200)
        rows.append([round(t, 3), model, req, resp, req + resp, rng.choice(["Conversation log", "API log"])])
    return rows


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def conversations(rng: random.Random) -> list[dict]:
    out = []
    t = 0
    for i in range(8):
        t += int(rng.expovariate(1 / 1500))
        turns = []
        for _ in range(rng.randint(1, 3)):
            turns.append({"from": "human", "value": sentence(rng, rng.randint(8, 40))})
            turns.append({"from": "gpt", "value": sentence(rng, rng.randint(10, 60))})
        if i == 3:
            msgs = [{"role": "system", "content": "You answer briefly."}]
            msgs += [{"role": "user" if x["from"] == "human" else "assistant", "content": x["value"]} for x in turns]
            out.append({"timestamp": t, "messages": msgs})
        else:
            out.append({"timestamp": t, "id": f"conv-{i}", "conversations": turns})
    return out


def main() -> None:
    rng = random.Random(20261204)
    (HERE / "mooncake.jsonl").write_text("".join(json.dumps(r) + "\n" for r in mooncake(rng)), encoding="utf-8")
    with (HERE / "burstgpt.csv").open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type"])
        w.writerows(burstgpt(rng))
    (HERE / "conversations.jsonl").write_text("".join(json.dumps(r) + "\n" for r in conversations(rng)),
                                              encoding="utf-8")


if __name__ == "__main__":
    main()
