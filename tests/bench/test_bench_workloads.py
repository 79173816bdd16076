"""Workload generators: skips beyond the context, exact lengths, growing chats."""

from __future__ import annotations

from test_bench_prompts import Words

from kvledger.bench.records import RequestRecord
from kvledger.bench.workloads import WorkloadConfig, make_levels


def test_sweep_skips_lengths_beyond_the_context_and_subtracts_the_template():
    cfg = WorkloadConfig([512, 256, 2048], output_len=64, concurrency=[1, 3], requests=2,
                         max_model_len=1000, prompt_overhead=10)
    levels = list(make_levels("sweep", cfg, Words(), chat=True))
    assert [(lv.prompt_len, lv.concurrency, len(lv.specs)) for lv in levels] == [
        (256, 1, 2), (512, 1, 2), (256, 3, 3), (512, 3, 3)]
    assert any("2048 prompt + 64 output" in n for n in cfg.notes)
    for lv in levels:
        for spec in lv.specs:
            assert Words().count(spec.prompt) == lv.prompt_len - 10  # + 10 template tokens
            assert spec.prompt_tokens == lv.prompt_len
    assert len({s.uid for lv in levels for s in lv.specs}) == 10


def test_shared_prefix_shares_the_system_prompt_and_sends_one_cold_request_first():
    cfg = WorkloadConfig([300], output_len=8, concurrency=[2], requests=2, turn_tokens=20)
    (level,) = list(make_levels("shared-prefix", cfg, Words(), chat=True))
    assert level.cold_first and [s.phase for s in level.specs] == ["cold", "warm", "warm"]
    systems = {s.prompt[0]["content"] for s in level.specs}
    questions = {s.prompt[1]["content"] for s in level.specs}
    assert len(systems) == 1 and len(questions) == 3
    assert Words().count(systems.pop()) == 300


def answered(level, text):
    return [RequestRecord(level.label, level.workload, i, s.uid, s.phase, level.concurrency,
                          level.prompt_len, s.prompt_tokens, 8, 0.0, 0.0, True, None, 0.1, 0.2,
                          0.01, 8, None, 8, answer=f"{text} {i}")
            for i, s in enumerate(level.specs)]


def test_chat_growth_appends_each_answer_and_a_new_question():
    cfg = WorkloadConfig([1], output_len=8, concurrency=[2], requests=1, turn_tokens=30,
                         turns=5, max_model_len=120)
    gen = make_levels("chat-growth", cfg, Words(), chat=True)
    first = next(gen)
    assert first.turn == 1 and len(first.specs) == 2 and len(first.specs[0].prompt) == 1
    second = gen.send(answered(first, "answer one"))
    messages = second.specs[1].prompt
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[1]["content"] == "answer one 1"
    assert second.prompt_len == 30 + 8 + 30
    third = gen.send(answered(second, "answer two"))
    assert len(third.specs[0].prompt) == 5
    # turn 4 would need 30 + 3 * 38 = 144 prompt tokens > 120 - 8: stops with a note
    assert list(_drain(gen, third)) == []
    assert any("chat turn 4" in n for n in cfg.notes)


def _drain(gen, level):
    try:
        while True:
            level = gen.send(answered(level, "more"))
            yield level
    except StopIteration:
        return
