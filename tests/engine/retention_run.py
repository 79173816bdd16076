"""One greedy request through an engine, step by step, with the scheduler's invariants checked
after every step: the driver of the retention tests (imported by basename, as
``retention_reference``)."""

from __future__ import annotations

from kvledger.engine.sample.sampling_params import SamplingParams


def run(engine, prompt, max_tokens, kv_policy=None, check=None, *, logprobs=None):
    """The final output of request "r" (``prompt`` token ids, ``max_tokens`` greedy tokens,
    EOS ignored); ``check(engine)`` is called after every step."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                            kv_policy=kv_policy, logprobs=logprobs)
    engine.add_request("r", list(prompt), params)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
        engine.scheduler.check_invariants()
        if check is not None:
            check(engine)
    return outs["r"]


def recorder(states: list):
    """A ``check`` for :func:`run` appending (computed tokens, held positions) of every running
    request after each step."""
    def check(engine):
        for req in engine.scheduler.running:
            states.append((req.num_computed_tokens, req.retention.pos.clone()))
    return check
