"""Pass-key retrieval: a number hidden at a depth of filler text, asked for at the end.

The prompt (token ids) is: an instruction, filler sentences up to ``context`` tokens in all with
the pass-key sentence inserted after ``depth`` of the filler (0 = at the start, 1 = just before
the question), then the question. The model answers by greedy decoding through the engine's
scheduler (a real generation, prefill + decode over the KV cache); the trial passes when the
answer contains the key's digits. After Mohtashami & Jaggi, arXiv:2305.16300 (landmark
attention), in our own filler.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field

from kvledger.engine.sample.sampling_params import SamplingParams
from kvledger.errors import InvalidParameterError

INSTRUCTION = "A pass key is hidden somewhere in the long text below. Find it and remember it.\n"
FILLER = ("The kettle sat on the stove. Rain tapped on the window. A dog slept by the door. "
          "The clock in the hall kept time. ")
NEEDLE = "The pass key is {key}. Remember it: {key} is the pass key. "
QUESTION = "\nWhat is the pass key? The pass key is"
ANSWER_TOKENS = 10


@dataclass
class PasskeyTrial:
    """One hidden key: where it was, what came back."""

    depth: float
    key: str
    answer: str
    retrieved: bool


@dataclass
class PasskeyResult:
    """All trials of one run; ``accuracy`` is the retrieved share."""

    kv_format: str
    context: int
    trials: list[PasskeyTrial] = field(default_factory=list)

    @property
    def accuracy(self) -> float:
        """Share of trials whose answer held the key."""
        return sum(t.retrieved for t in self.trials) / len(self.trials)

    def to_json(self) -> dict:
        """The ``--json`` object: every attribute plus ``accuracy``."""
        return {**asdict(self), "accuracy": self.accuracy}


def check_depth(depth: float) -> None:
    """Raises InvalidParameterError unless ``depth`` is in [0, 1]."""
    if not 0.0 <= depth <= 1.0:
        raise InvalidParameterError(f"--depth must be in [0, 1], got {depth}")


def passkey_prompt(tokenizer, context: int, depth: float, key: str) -> list[int]:
    """Token ids of a ``context - ANSWER_TOKENS``-token prompt hiding ``key`` at ``depth``.

    Raises:
        InvalidParameterError: depth outside [0, 1], or a context too short for the frame.
    """
    check_depth(depth)

    def enc(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    head, needle, tail, filler = enc(INSTRUCTION), enc(NEEDLE.format(key=key)), \
        enc(QUESTION), enc(FILLER)
    room = context - ANSWER_TOKENS - len(head) - len(needle) - len(tail)
    if room < len(filler):
        raise InvalidParameterError(f"--context {context} is too short for a pass-key prompt")
    body = (filler * (room // len(filler) + 1))[:room]
    at = round(depth * (room // len(filler))) * len(filler)  # a sentence-group boundary
    at = min(at, room)
    return head + body[:at] + needle + body[at:] + tail


def passkey(engine, context: int, depths: list[float], trials: int = 1,
            seed: int = 0) -> PasskeyResult:
    """Hide ``trials`` random 5-digit keys at each depth and ask for each (greedy).

    Raises:
        InvalidParameterError: bad depth, context or trial count.
    """
    params = SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0.0)
    result = PasskeyResult(engine.kv_format, context)
    for depth, key, ids in passkey_prompts(engine.tokenizer, context, depths, trials, seed):
        answer = _generate(engine, ids, params)
        result.trials.append(PasskeyTrial(depth, key, answer, key in answer))
    return result


def passkey_prompts(tokenizer, context: int, depths: list[float], trials: int = 1,
                    seed: int = 0) -> list[tuple[float, str, list[int]]]:
    """The (depth, key, prompt ids) of every trial :func:`passkey` runs, in its order:
    ``trials`` random 5-digit keys per depth, drawn from ``random.Random(seed)``.

    Raises:
        InvalidParameterError: bad depth, context or trial count.
    """
    if trials < 1:
        raise InvalidParameterError(f"--trials must be >= 1, got {trials}")
    rng = random.Random(seed)
    out = []
    for depth in depths:
        for _ in range(trials):
            key = str(rng.randrange(10000, 100000))
            out.append((depth, key, passkey_prompt(tokenizer, context, depth, key)))
    return out


def _generate(engine, ids: list[int], params: SamplingParams) -> str:
    engine.add_request("kvledger-passkey", ids, params)
    text = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                if out.error:
                    raise InvalidParameterError(f"pass-key request failed: {out.error}")
                text = out.text
    return text
