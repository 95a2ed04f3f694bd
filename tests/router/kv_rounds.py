"""Multi-turn conversations for the cache-aware routing tests (tests/router/test_e2e.py).

Each conversation opens with a long user turn (~200 tokens) and continues with short ones, the
shape of a chat: what a later turn shares with its earlier ones dwarfs what it adds, and the
template's shared system prompt is one block of it. A round sends every conversation's next
turn at once through the official openai client.
"""

from __future__ import annotations

import concurrent.futures as cf
import re

import httpx

MODEL = "SmolLM2-135M-Instruct"
BLOCK = 16  # tests/cluster.py BASE_ARGS
TOPICS = ["rivers of Europe", "the history of clocks", "how bees build hives",
          "sailing in strong wind"]


def user_turn(topic: str, turn: int) -> str:
    if turn == 1:
        return (f"Tell me about {topic}. " + f"I want to learn about {topic} in depth, with "
                "surprising details, common mistakes and a short story. " * 8)
    return f"Turn {turn}: and what else about {topic}?"


def run_round(url: str, conversations: list[list[dict]], turn: int) -> list[tuple[int, int]]:
    """Every conversation's next turn at once: (prompt tokens, cached tokens) of each."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)

    def one(i: int) -> tuple[int, int]:
        messages = conversations[i]
        messages.append({"role": "user", "content": user_turn(TOPICS[i % len(TOPICS)], turn)})
        done = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                              max_tokens=8)
        messages.append({"role": "assistant", "content": done.choices[0].message.content})
        return done.usage.prompt_tokens, done.usage.prompt_tokens_details.cached_tokens

    with cf.ThreadPoolExecutor(len(conversations)) as pool:
        return list(pool.map(one, range(len(conversations))))


def assert_home(previous: list[tuple[int, int]], current: list[tuple[int, int]]) -> None:
    """Each turn was served where its previous turn's prompt is cached: the engine reports
    those full blocks as cached (less one of slack: a token may merge across the boundary)."""
    for (prev_tokens, _), (_, cached) in zip(previous, current, strict=True):
        assert cached >= BLOCK * (prev_tokens // BLOCK) - BLOCK, (previous, current)


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of a router metric's samples whose labels include `labels`."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        match = re.match(rf"{name}(?:{{(.*)}})? (\S+)$", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            total += float(match.group(2))
    return total


def credited_tokens(url: str) -> float:
    """Prompt tokens the router's index credited the prompt engines it chose with."""
    return BLOCK * metric(url, "baton_router_routing_credited_blocks_total", role="prompt")
