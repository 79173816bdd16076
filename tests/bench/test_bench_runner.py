"""Arrivals and the client's concurrency slots (slot wait is not TTFT)."""

from __future__ import annotations

import asyncio
import itertools
import random

import httpx
import pytest

from kvledger.bench.records import Level, RequestSpec
from kvledger.bench.runner import LevelRunner, arrival_offsets
from kvledger.bench.target import Target


def test_closed_loop_arrivals_are_all_at_zero():
    assert arrival_offsets(3, None, random.Random(0)) == [0.0, 0.0, 0.0]


def test_poisson_arrivals_are_seeded_and_have_the_asked_rate():
    a = arrival_offsets(20_000, 4.0, random.Random(7))
    assert a == arrival_offsets(20_000, 4.0, random.Random(7))
    assert a[0] == 0.0 and all(x < y for x, y in itertools.pairwise(a))
    mean_gap = a[-1] / (len(a) - 1)
    assert mean_gap == pytest.approx(1 / 4.0, rel=0.03)  # exponential gaps of mean 1/rate


def test_slot_wait_is_reported_apart_from_ttft(fake_server):
    async def go():
        target = Target.from_url(fake_server.url)
        target.model = "role-pause"  # every request: >= 300 ms before its first token
        level = Level("sweep", 8, 1, [RequestSpec(str(i), "hi", 8) for i in range(3)])
        async with httpx.AsyncClient(timeout=10) as client:
            return await LevelRunner(client, target, 4, watch_metrics=False).run(level)

    records, summary = asyncio.run(go())
    assert all(r.ok and r.ttft_s >= 0.25 for r in records)
    assert records[0].slot_wait_s < records[1].slot_wait_s < records[2].slot_wait_s
    # one slot: request i+1 is sent only after request i streamed its last token
    for prev, nxt in itertools.pairwise(records):
        assert nxt.send_s >= prev.send_s + prev.e2e_s
    assert summary["slot_wait_s"]["n"] == 3
