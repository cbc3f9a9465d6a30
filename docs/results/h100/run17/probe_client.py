"""Run 17's client probe: ``python3 probe_client.py URL OUT.jsonl [STREAMS] [REQUESTS] [SYSTEM]``:
the bench's chat-shared-prefix workload (a SYSTEM-token system prompt, default 1,500; 128 tokens
out, greedy), one
untimed request per stream first, then STREAMS streams of REQUESTS requests each; one JSON line
per timed request: ``start`` (before the POST), ``first`` (the first text event), ``end``, the
usage's cached tokens (``time.perf_counter()``, comparable with probe_server.py's lines)."""

import asyncio
import json
import sys

import httpx

from service.bench.common import Stream, stream_request
from service.bench.load import Workload


async def main(url: str, out: str, streams: int, requests: int, system: int = 1500) -> None:
    work = Workload("chat-shared-prefix", max_tokens=128, system_tokens=system)
    records: list[Stream] = []
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:

        async def stream(n: int, keep: bool) -> None:
            for _ in range(n):
                path, body = work.request(0)
                rec = await stream_request(client, path, body)
                if keep:
                    records.append(rec)

        await asyncio.gather(*(stream(1, False) for _ in range(streams)))
        await asyncio.gather(*(stream(requests, True) for _ in range(streams)))
    with open(out, "w") as f:
        for r in records:
            first = r.arrivals[0] if r.arrivals else None
            f.write(json.dumps({"start": r.start, "first": first, "end": r.end, "cached": r.cached_tokens}) + "\n")


if __name__ == "__main__":
    url, out, *rest = sys.argv[1:]
    asyncio.run(main(url, out, *(int(x) for x in rest)))
