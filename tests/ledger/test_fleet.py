"""The fleet plan (``ledger/fleet.py``, ``kvledger plan --replicas``): hit rates, service,
capacity and TTFT worked out by hand for a small mix, and the refusals."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from kvledger.cli import app
from kvledger.errors import InvalidParameterError
from kvledger.ledger.fleet import ReplicaSize, SharedPrefixMix, StepPrices, fleet_plan

# 4 system prompts of 500 tokens (31 full blocks of 16 = 496 tokens), 50 own tokens, 32 out
MIX = SharedPrefixMix(prefixes=4, prefix_tokens=500, unique_tokens=50, output_tokens=32)
PRICES = StepPrices(prefill_token_s=0.001, step_s=0.010, decode_seq_s=0.002)


def rows(plan):
    return {r.routing: r for r in plan.rows}


def test_a_roomy_replica_hits_every_prefix_block_either_way():
    replica = ReplicaSize(pool_blocks=1000, block_size=16, max_num_seqs=8)
    # own blocks per request: ceil((550 + 32 - 496) / 16) = 6; 8 fit easily
    plan = fleet_plan(MIX, replica, PRICES, replicas=2)
    assert plan.concurrency == 8
    for row in plan.rows:
        assert row.hit_rate == pytest.approx(496 / 550)
    rr = rows(plan)["round_robin"]
    service = 550 * (1 - 496 / 550) * 0.001 + 32 * (0.010 / 8 + 0.002)  # 54 ms + 104 ms
    assert rr.service_s == pytest.approx(service)
    assert rr.fleet_rps == pytest.approx(2 / service)


def test_cold_misses_count_once_per_replica_that_sees_the_prefix():
    replica = ReplicaSize(pool_blocks=1000, block_size=16, max_num_seqs=8)
    mix = SharedPrefixMix(4, 500, 50, 32, requests=40)
    r = rows(fleet_plan(mix, replica, PRICES, replicas=2))
    assert r["round_robin"].hit_rate == pytest.approx(496 / 550 * (1 - 4 * 2 / 40))
    assert r["prefix_aware"].hit_rate == pytest.approx(496 / 550 * (1 - 2 * 2 / 40))


def test_a_small_pool_keeps_the_prefixes_of_its_own_share_only():
    replica = ReplicaSize(pool_blocks=100, block_size=16, max_num_seqs=8)
    # room for prefixes: 100 - 8 x 6 = 52 blocks; round robin needs 4 x 31, aware 2 x 31
    r = rows(fleet_plan(MIX, replica, PRICES, replicas=2))
    assert r["round_robin"].hit_rate == pytest.approx(496 / 550 * 52 / 124)
    assert r["prefix_aware"].hit_rate == pytest.approx(496 / 550 * 52 / 62)
    assert r["prefix_aware"].fleet_rps > r["round_robin"].fleet_rps


def test_ttft_is_an_mm1_wait_over_the_busy_time_and_none_over_capacity():
    replica = ReplicaSize(pool_blocks=1000, block_size=16, max_num_seqs=8)
    rr = rows(fleet_plan(MIX, replica, PRICES, replicas=2, target_rps=6))["round_robin"]
    prefill = 550 * (1 - 496 / 550) * 0.001
    rho = 6 / 2 * rr.service_s
    wait = math.log(rho / 0.1) * rr.service_s / (1 - rho)
    assert rr.ttft_p90_s == pytest.approx(prefill + 0.010 + wait)
    assert rr.ttft_p50_s == pytest.approx(prefill + 0.010)  # rho < 0.5: no median wait
    over = rows(fleet_plan(MIX, replica, PRICES, replicas=2, target_rps=100))["round_robin"]
    assert over.ttft_p90_s is None


def test_replicas_needed_is_the_fewest_that_meet_the_ttft():
    replica = ReplicaSize(pool_blocks=100, block_size=16, max_num_seqs=8)
    mix = SharedPrefixMix(prefixes=16, prefix_tokens=500, unique_tokens=50, output_tokens=32)
    plan = fleet_plan(mix, replica, PRICES, replicas=1, target_rps=10, ttft_p90_s=1.5)
    for row in plan.rows:
        n = row.replicas_needed
        assert n is not None
        at = rows(fleet_plan(mix, replica, PRICES, n, 10))[row.routing].ttft_p90_s
        assert at is not None and at <= 1.5
        if n > 1:
            before = rows(fleet_plan(mix, replica, PRICES, n - 1, 10))[row.routing].ttft_p90_s
            assert before is None or before > 1.5
    assert rows(plan)["prefix_aware"].replicas_needed <= rows(plan)["round_robin"].replicas_needed


@pytest.mark.parametrize("kwargs, message", [
    ({"replicas": 0}, "--replicas must be >= 1"),
    ({"replicas": 1, "ttft_p90_s": 1.0}, "--ttft-p90 needs --target-rps"),
    ({"replicas": 1, "target_rps": -1}, "--target-rps must be positive"),
])
def test_refusals(kwargs, message):
    replica = ReplicaSize(pool_blocks=1000, block_size=16, max_num_seqs=8)
    with pytest.raises(InvalidParameterError, match=message):
        fleet_plan(MIX, replica, PRICES, **kwargs)
    with pytest.raises(InvalidParameterError, match="cannot hold one request"):
        fleet_plan(MIX, ReplicaSize(30, 16, 8), PRICES, 1)
    with pytest.raises(InvalidParameterError, match="--prefix-tokens must be positive"):
        SharedPrefixMix(prefix_tokens=0)


def test_plan_replicas_cli_prints_both_routings_and_refuses_by_name():
    result = CliRunner().invoke(app, ["plan", "--replicas", "2", "--prefixes", "4",
                                      "--replica-blocks", "100", "--max-num-seqs", "8", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert [r["routing"] for r in out["rows"]] == ["round_robin", "prefix_aware"]
    assert out["rows"][1]["hit_rate"] > out["rows"][0]["hit_rate"]
    result = CliRunner().invoke(app, ["plan", "--replicas", "2", "--ttft-p90", "1"])
    assert result.exit_code == 2 and "error: --ttft-p90 needs --target-rps" in result.output
    result = CliRunner().invoke(app, ["plan", "--target-rps", "5", "--ttft-p90", "2"])
    assert result.exit_code == 0 and "replicas needed" in result.output


def test_step_prices_given_on_the_command_line_price_the_plan():
    given = {"prefill_token_s": 0.001, "step_s": 0.010, "decode_seq_s": 0.002, "request_s": 0.05}
    result = CliRunner().invoke(app, [
        "plan", "--replicas", "2", "--prefixes", "4", "--prefix-tokens", "500",
        "--unique-tokens", "50", "--output-tokens", "32", "--replica-blocks", "1000",
        "--max-num-seqs", "8", "--step-prices", json.dumps(given), "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["prices_source"] == "given (--step-prices)"
    rr = out["rows"][0]
    # 54 uncached tokens x 1 ms + 50 ms for the request + 32 x (10 ms / 8 + 2 ms)
    assert rr["service_s"] == pytest.approx(0.054 + 0.05 + 32 * (0.010 / 8 + 0.002))
    del given["request_s"]  # may be left out: 0
    result = CliRunner().invoke(app, ["plan", "--replicas", "2", "--max-num-seqs", "8",
                                      "--step-prices", json.dumps(given), "--json"])
    assert json.loads(result.output)["prices"]["request_s"] == 0


@pytest.mark.parametrize("text, message", [
    ("{", "--step-prices is not JSON"),
    ('{"step_s": 1}', "--step-prices must be an object with the keys"),
    ('{"prefill_token_s": 0, "step_s": 1, "decode_seq_s": 0, "other": 1}',
     "--step-prices must be an object"),
    ('{"prefill_token_s": -1, "step_s": 1, "decode_seq_s": 0}', "--step-prices: prefill_token_s"),
    ('{"prefill_token_s": 0, "step_s": true, "decode_seq_s": 0}', "--step-prices: step_s must"),
    ('{"prefill_token_s": 0, "step_s": 0, "decode_seq_s": 0}', "--step-prices: a decode step"),
])
def test_step_prices_refusals(text, message):
    result = CliRunner().invoke(app, ["plan", "--replicas", "2", "--step-prices", text])
    assert result.exit_code == 2 and f"error: {message}" in result.output
