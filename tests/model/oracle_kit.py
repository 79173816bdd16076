"""What the model tests against transformers share: the tiny models built once per test module,
the seeded prompts, the logit comparison step by step (``logit_diffs``: our runner prefills in
chunks into scattered blocks and decodes on the oracle's own argmax, transformers recomputing
the whole sequence every step), and the engine cases: the prompts with transformers' greedy
tokens (``greedy_case``), an fp32 engine over the loaded model and the greedy run of several
prompts together (``run_together``); for a model with state layers, a runner over a KV store and
state slots (``state_runner``) and its logit comparison (``state_diffs``); for a model with a
router, the oracle that says where it has a tie (``router_reference``).

A step is *excepted* when the oracle says its routing has a tie (two router scores within
``TIE``: the two sides may break it differently); every later step is then excepted too, its
context being different.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from family_kit import hf_greedy, hf_logits

from kvledger.engine.config import EngineConfig
from kvledger.engine.engine import LLMEngine
from kvledger.engine.kv.state_store import StateStore
from kvledger.engine.kv.store import KVStore
from kvledger.engine.model_load import build_model
from kvledger.engine.request import Request
from kvledger.engine.runner import ModelRunner
from kvledger.engine.sample.sampling_params import SamplingParams
from kvledger.ledger.kv_groups import kv_groups, layer_places, state_group
from kvledger.model.weights.loader import load_weights

TOL = 1e-4  # max |fp32 logit difference| against transformers
TIE = 1e-5  # router scores closer than this are a tie
DECODE_STEPS = 16
SCATTERED = [9, 3, 20, 7, 12, 1, 30, 4]  # a block table out of order, with gaps

Reference = Callable[[list[int]], tuple[torch.Tensor, bool]]
"""The oracle: ids -> (its last logits after them, whether this step is excepted)."""


def dense_reference(hf) -> Reference:
    """transformers' logits (``family_kit.hf_logits``), no step excepted: a model without a
    router."""
    return lambda ids: (hf_logits(hf, ids), False)


def router_reference(hf, k: int) -> Reference:
    """transformers' logits, a step excepted when any position's router (``output_router_logits``)
    has its k-th and (k+1)-th probabilities within :data:`TIE` in any MoE layer."""
    def reference(ids: list[int]) -> tuple[torch.Tensor, bool]:
        with torch.no_grad():
            out = hf(torch.tensor([ids]), use_cache=False, output_router_logits=True)
        tie = False
        for logits in out.router_logits:
            top = torch.softmax(logits.float(), dim=-1).topk(k + 1, dim=-1).values
            tie |= bool(((top[:, k - 1] - top[:, k]) < TIE).any())
        return out.logits[0, -1], tie
    return reference


def tiny_models(make_tiny: Callable):
    """A module-scoped fixture ``tiny``: ``tiny(name)`` is (folder, transformers model, spec,
    fp32 weights) of ``make_tiny(name, folder)``, built once per name."""
    built: dict = {}

    @pytest.fixture(scope="module")
    def tiny(tmp_path_factory):
        def get(name: str):
            if name not in built:
                folder = tmp_path_factory.mktemp(name)
                hf = make_tiny(name, folder)
                built[name] = (folder, hf, *load_weights(folder, torch.float32))
            return built[name]
        return get
    return tiny


class Chunk:
    """The part of a ``ScheduledChunk`` the runner reads: the next ``n`` tokens of ``req``."""

    def __init__(self, req, n):
        self.request, self.num_new_tokens = req, n


def seeded_prompt(n: int) -> list[int]:
    """``n`` token ids in [3, 320) drawn with seed ``n`` (the tiny models' vocabulary)."""
    return torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(n)).tolist()


def logit_diffs(runner, req: Request, reference: Reference, chunks,
                steps: int = DECODE_STEPS) -> tuple[list[float], list[int]]:
    """(max |logit difference| per compared step, the excepted steps): ``req`` prefilled in
    ``chunks`` (token counts, in order), then ``steps`` decodes, each on the oracle's argmax."""
    for n in chunks:
        logits = runner.execute([Chunk(req, n)])
        req.num_computed_tokens += n
    diffs, excepted = [], []
    for step in range(steps + 1):
        ref, tie = reference(req.all_token_ids)
        if tie or excepted:
            excepted.append(step)
        else:
            diffs.append(float((logits[0] - ref).abs().max()))
        req.output_token_ids.append(int(ref.argmax()))
        logits = runner.execute([Chunk(req, 1)])
        req.num_computed_tokens += 1
    return diffs, excepted


def scattered_diffs(spec, weights, store, prompt: list[int], reference: Reference,
                    attention: str = "reference",
                    steps: int = DECODE_STEPS) -> tuple[list[float], list[int]]:
    """:func:`logit_diffs` of the family's fp32 model over ``store`` (blocks of 16): the prompt
    prefilled in two chunks (a third, the rest) into the :data:`SCATTERED` blocks."""
    model = build_model(spec, dict(weights), torch.float32, attention=attention)
    req = Request("r", list(prompt), SamplingParams(max_tokens=max(steps, 1)))
    req.block_table = list(SCATTERED)
    first = len(prompt) // 3
    chunks = [n for n in (first, len(prompt) - first) if n]
    return logit_diffs(ModelRunner(model, store, 16), req, reference, chunks, steps)


def state_runner(spec, weights, num_slots: int = 2) -> tuple[ModelRunner, StateStore]:
    """(a runner of the family's fp32 model over a KV store of 32 blocks of 16 and
    ``num_slots`` state slots, the slots) for a model with state layers."""
    model = build_model(spec, dict(weights), torch.float32, attention="reference")
    store = KVStore(spec.num_layers, 32, 16, spec.num_kv_heads, spec.head_dim, torch.float32,
                    places=layer_places(kv_groups(spec), spec.num_layers))
    states = StateStore(state_group(spec), num_slots, torch.float32)
    return ModelRunner(model, store, 16, states), states


def state_diffs(spec, weights, prompt: list[int], reference: Reference,
                steps: int = DECODE_STEPS) -> tuple[list[float], list[int]]:
    """:func:`logit_diffs` of a model with state layers (:func:`state_runner`): the prompt
    prefilled in two chunks (a third, the rest) into the :data:`SCATTERED` blocks, its state in
    a slot carried from step to step."""
    runner, states = state_runner(spec, weights)
    req = Request("r", list(prompt), SamplingParams(max_tokens=steps + 1))
    req.block_table = list(SCATTERED)
    req.state_slot = states.allocate()
    first = len(prompt) // 3
    return logit_diffs(runner, req, reference, [first, len(prompt) - first], steps)


def run_together(engine, prompts: list[list[int]], params: SamplingParams, first: int = 0,
                 check: Callable | None = None) -> list[list[int]]:
    """The token ids ``engine`` generates for ``prompts`` added together (ids ``r{first}``, ...),
    in the prompts' order; ``check(engine, req)`` runs for every running request between
    steps."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{first + i}", p, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        for req in engine.scheduler.running if check else ():
            check(engine, req)
    return [done[f"r{first + i}"] for i in range(len(prompts))]


def greedy_case(make_tiny: Callable, name: str, tmp_path_factory, lengths,
                steps: int) -> tuple:
    """(folder, spec, fp32 weights, a :func:`seeded_prompt` per length, transformers' ``steps``
    greedy tokens after each) of ``make_tiny(name, folder)``."""
    folder = tmp_path_factory.mktemp(name)
    hf = make_tiny(name, folder)
    spec, weights = load_weights(folder, torch.float32)
    prompts = [seeded_prompt(n) for n in lengths]
    return folder, spec, weights, prompts, [hf_greedy(hf, p, steps) for p in prompts]


def fp32_engine(folder, spec, weights, **options) -> LLMEngine:
    """An fp32 engine over the loaded model (attention ``paged-native`` unless ``options``
    say otherwise)."""
    options.setdefault("attention", "paged-native")
    return LLMEngine(EngineConfig(model=str(folder), dtype="fp32", **options), spec=spec,
                     weights=weights)


def hit_logprob_diff(engine, hf) -> float:
    """Most |logprob - transformers'| of the 4 tokens a second turn generates after a prefix
    hit on the first turn's blocks (the hit asserted)."""
    first = seeded_prompt(37)
    run_together(engine, [first], SamplingParams(max_tokens=8, temperature=0.0))
    second = first + seeded_prompt(11)
    engine.add_request("b", second, SamplingParams(max_tokens=4, temperature=0.0, logprobs=1))
    out = None
    while engine.has_unfinished_requests():
        out = [o for o in engine.step() if o.finished] or out
    assert out[0].metrics.num_cached_tokens > 0
    ids, diffs = list(second), []
    for entry in out[0].logprobs:
        ref = torch.log_softmax(hf_logits(hf, ids), -1)[entry.token_id]
        diffs.append(abs(entry.logprob - float(ref)))
        ids.append(entry.token_id)
    return max(diffs)


def check_hit_and_zero_state_ablation(folder, hf, spec, weights, monkeypatch) -> None:
    """After a prefix hit the logprobs equal transformers' (within :data:`TOL`); a hit whose
    state slot starts from zeros instead of the checkpoint's copy leaves them (> 10 TOL)."""
    options = {"block_size": 4, "max_num_batched_tokens": 16}
    assert hit_logprob_diff(fp32_engine(folder, spec, weights, **options), hf) < TOL
    allocate = StateStore.allocate
    monkeypatch.setattr(StateStore, "allocate", lambda self, block_id=None: allocate(self))
    assert hit_logprob_diff(fp32_engine(folder, spec, weights, **options), hf) > 10 * TOL


def check_bf16_state_run(folder) -> None:
    """A bf16 engine over the folder's bf16 weights (the device's weight formats) runs two
    sequences, keeps its recurrent state in bf16, and gives every state slot back."""
    spec, weights = load_weights(folder, torch.bfloat16)
    engine = LLMEngine(EngineConfig(model=str(folder), dtype="bf16", max_num_seqs=2),
                       spec=spec, weights=weights)
    assert engine.states.recurrent[0].dtype == torch.bfloat16
    got = run_together(engine, [seeded_prompt(70), seeded_prompt(7)],
                       SamplingParams(max_tokens=4, temperature=0.0))
    assert [len(t) for t in got] == [4, 4]
    assert engine.states.num_free == engine.states.num_slots

