"""The serving benchmark's HTTP client: streams ``POST /v1/completions`` on the stream's
schedule (async httpx) and records per request the send time, the first streamed token,
the gaps between chunks (ITL), the end and the output tokens of the final usage chunk."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from _log import log
from _serving_workload import Call, Tenant


@dataclass
class Record:
    index: int
    tenant: str
    model: str
    prompt_tokens: int
    max_tokens: int
    sent: float
    first: float | None = None
    end: float | None = None
    output_tokens: int = 0
    gaps: list[float] = field(default_factory=list)
    error: str | None = None
    text: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None and self.first is not None and self.end is not None

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.output_tokens < 2:
            return None
        assert self.first is not None and self.end is not None
        return (self.end - self.first) / (self.output_tokens - 1)

    @property
    def e2e(self) -> float | None:
        return None if self.end is None else self.end - self.sent


def request_body(call: Call, tenant: str, vllm: bool = False) -> dict[str, Any]:
    """The completion request of ``call``. To vLLM (no tenants), the adapter goes by its
    bare name and the tenant's name is the prefix-cache salt, so its cache is shared within
    a tenant only, as loraplex's (which derives the salt from the key)."""
    body: dict[str, Any] = {"model": call.model, "prompt": call.prompt,
                            "max_tokens": call.max_tokens, "temperature": 0.0,
                            "stream": True, "ignore_eos": True,
                            "stream_options": {"include_usage": True}}
    if vllm:
        body["model"] = call.model.rsplit("/", 1)[-1]
        body["cache_salt"] = tenant
    return body


async def one_request(client: httpx.AsyncClient, url: str, key: str, call: Call,
                      rec: Record, t_start: float, vllm: bool = False) -> None:
    await asyncio.sleep(max(0.0, t_start + call.at - time.monotonic()))
    rec.sent = time.monotonic()
    body = request_body(call, rec.tenant, vllm)
    last = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body,
                                 headers={"Authorization": f"Bearer {key}"}) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                rec.error = f"HTTP {resp.status_code}: {text[:200]}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.error = f"stream error: {str(chunk['error'])[:200]}"
                    return
                now = time.monotonic()
                if chunk.get("choices"):
                    rec.text += chunk["choices"][0].get("text") or ""
                    if rec.first is None:
                        rec.first = now
                    elif last is not None:
                        rec.gaps.append(now - last)
                    last = now
                if chunk.get("usage"):
                    rec.output_tokens = int(chunk["usage"]["completion_tokens"])
        rec.end = last if last is not None else time.monotonic()
        if rec.output_tokens != call.max_tokens:
            rec.error = f"expected {call.max_tokens} tokens, got {rec.output_tokens}"
    except asyncio.CancelledError:
        rec.error = "cancelled at the drain limit"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"


async def run_stream(url: str, tenants: Sequence[Tenant], calls: Sequence[Call],
                     drain_timeout: float, label: str,
                     vllm: bool = False) -> tuple[list[Record], float]:
    """Sends ``calls`` on schedule; returns the records and the span (first send to the last
    completion, or to the drain limit)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(connect=10, read=None, write=10, pool=None)
    records = [Record(i, tenants[c.tenant].name, c.model, len(c.prompt), c.max_tokens, 0.0)
               for i, c in enumerate(calls)]
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        t_start = time.monotonic() + 0.2
        tasks = [asyncio.create_task(one_request(client, url, tenants[c.tenant].key, c, r,
                                                 t_start, vllm))
                 for c, r in zip(calls, records, strict=True)]
        deadline = t_start + calls[-1].at + drain_timeout
        progress = asyncio.create_task(_progress(records, t_start, label))
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic()))
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        progress.cancel()
    ends = [r.end for r in records if r.end is not None]
    span = (max(ends) if ends else time.monotonic()) - t_start
    if pending:
        span = max(span, deadline - t_start)
    return records, span


async def _progress(records: Sequence[Record], t_start: float, label: str) -> None:
    while True:
        await asyncio.sleep(10)
        now = time.monotonic()
        sent = sum(1 for r in records if r.sent)
        done = sum(1 for r in records if r.end is not None or r.error is not None)
        log(f"  {label}: t={now - t_start:5.0f}s sent {sent}/{len(records)}, "
            f"done {done}, in flight {sent - done}")
