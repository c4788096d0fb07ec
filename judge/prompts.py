"""The judge's chat rows, written here (no hub, no third-party text): single- and multi-turn
requests over a few dozen everyday topics, some with a system prompt, each with an original
answer written from a template (the dataset's own answers, which regeneration replaces)."""

from __future__ import annotations

import random
from typing import Any

TOPICS = (
    "the ocean", "volcanoes", "honey bees", "bicycles", "the moon", "rain", "coffee", "chess",
    "trains", "libraries", "gardening", "photosynthesis", "the internet", "pizza", "mountains",
    "recycling", "sleep", "music", "friendship", "the sun", "electricity", "bread", "winter",
    "rivers", "birds", "computers", "exercise", "tea", "dinosaurs", "deserts", "clouds",
    "magnets", "maps", "kites", "robots", "forests", "cats", "dogs", "airplanes", "soap",
    "bridges", "museums", "snow", "apples", "the stars", "boats", "painting", "football",
)
# (request, original answer), {t} = the topic.
TASKS = (
    ("What is {t}?", "{T} is a common subject that many people find interesting."),
    ("Explain {t} to a child.", "Imagine {t} as something you can see and learn about every "
                                "day. It is simple once you look closely."),
    ("Write a short poem about {t}.", "Oh {t}, so bright and free,\nyou are a joy to me."),
    ("Give me three facts about {t}.", "1. {T} is well known.\n2. People study {t}.\n"
                                       "3. {T} appears in many stories."),
    ("Why is {t} important?", "{T} matters because it touches our daily lives in many ways."),
    ("Describe {t} in one sentence.", "{T} is something worth knowing about."),
    ("Write a haiku about {t}.", "Quiet {t} waits\nunder the morning light\nall is calm again"),
    ("List some pros and cons of {t}.", "Pros: {t} is useful and fun.\nCons: {t} can take "
                                        "time to understand."),
    ("Tell me a short story about {t}.", "Once upon a time, a girl learned about {t}. She "
                                         "told everyone, and they were happy."),
    ("How would you explain {t} to a friend?", "I would say that {t} is simpler than it "
                                               "sounds, and show an example."),
)
SYSTEMS = (
    "You are a concise assistant.", "You are a friendly teacher.",
    "Answer in a cheerful tone.", "You are a helpful assistant who answers briefly.",
)
FOLLOW_UPS = (
    ("Can you make it shorter?", "Sure: {t}, in short."),
    ("Tell me more.", "There is much more to say about {t}, but that is the heart of it."),
    ("Now give an example.", "For example, think of {t} on an ordinary day."),
    ("Thanks! Summarize that in one line.", "In one line: {t} is worth learning about."),
)


def _fill(text: str, topic: str) -> str:
    return text.format(t=topic, T=topic[0].upper() + topic[1:])


def _arithmetic(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    if rng.random() < 0.5:
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    return f"What is {a} times {b}?", f"{a} times {b} is {a * b}."


def row(i: int, rng: random.Random) -> dict[str, Any]:
    """Row ``i``: one request (a topic task, or arithmetic one time in eight), a system prompt
    one time in three, and one or two follow-up turns one time in three."""
    topic = rng.choice(TOPICS)
    messages: list[dict[str, str]] = []
    if rng.random() < 1 / 3:
        messages.append({"role": "system", "content": rng.choice(SYSTEMS)})
    ask, answer = (_arithmetic(rng) if rng.random() < 1 / 8 else
                   tuple(_fill(x, topic) for x in rng.choice(TASKS)))
    messages += [{"role": "user", "content": ask}, {"role": "assistant", "content": answer}]
    if rng.random() < 1 / 3:
        for ask, answer in rng.sample(FOLLOW_UPS, rng.choice((1, 2))):
            messages += [{"role": "user", "content": _fill(ask, topic)},
                         {"role": "assistant", "content": _fill(answer, topic)}]
    return {"id": f"judge-{i:05d}", "messages": messages}


def split(n_train: int, n_eval: int, seed: int = 0) -> tuple[list[dict[str, Any]],
                                                             list[dict[str, Any]]]:
    """``n_train`` training rows and ``n_eval`` held-out rows (distinct conversations), the same
    for a given seed on every machine."""
    rng = random.Random(seed)
    rows = [row(i, rng) for i in range(n_train + n_eval)]
    return rows[:n_train], rows[n_train:]
