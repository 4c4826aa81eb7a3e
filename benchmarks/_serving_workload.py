"""The serving benchmark's callers and request streams: tenants, adapters, and the seeded
Poisson stream of completion calls (plus the warm-up calls) sent to every server alike."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from _workload import WorkItem


@dataclass(frozen=True)
class Tenant:
    name: str
    key: str


@dataclass(frozen=True)
class Adapter:
    name: str
    owner: str  # tenant name
    public: bool


@dataclass(frozen=True)
class Call:
    """One request of the stream: when it is sent, by whom, to which model, what."""

    at: float  # seconds after the stream starts
    tenant: int
    model: str
    prompt: list[int]
    max_tokens: int



def build_calls(items: Sequence[WorkItem], system_prompt: list[int], tenants: Sequence[Tenant],
                adapters: Sequence[Adapter], base_model: str, base_fraction: float,
                rate: float, seed: int) -> list[Call]:
    """A Poisson stream at ``rate`` req/s over ``items`` (in order). A request to a private
    adapter comes from its owner; to a public one, from any tenant; to the base model
    (``base_fraction`` of requests), from any tenant."""
    rng = random.Random(seed)
    names = [t.name for t in tenants]
    calls = []
    t = 0.0
    for item in items:
        t += rng.expovariate(rate)
        if item.adapter is None or rng.random() < base_fraction:
            caller, model = rng.randrange(len(tenants)), base_model
        else:
            a = adapters[item.adapter]
            caller = rng.randrange(len(tenants)) if a.public else names.index(a.owner)
            model = a.name if names[caller] == a.owner else f"{a.owner}/{a.name}"
        calls.append(Call(t, caller, model, system_prompt + item.prompt_ids, item.max_tokens))
    return calls


def warmup_calls(tenants: Sequence[Tenant], adapters: Sequence[Adapter], base_model: str,
                 seed: int) -> list[Call]:
    """One short request per adapter and one to the base model, 0.5 s apart, so adapters
    are read from disk and installed in slots here, not in the measured runs. The prompts
    do not share the system prompt: the prefix cache starts cold at the first rate."""
    rng = random.Random(seed + 99)
    names = [t.name for t in tenants]
    models = [(names.index(a.owner), a.name) for a in adapters] + [(0, base_model)]
    return [Call(0.5 * i, caller, model, [rng.randrange(1000, 2000) for _ in range(16)], 2)
            for i, (caller, model) in enumerate(models)]
