"""``kvledger generate``: run prompts through the engine and print the KV bill beside the answer.

One prompt streams to stdout token by token; ``--prompts-file`` runs every line as one
continuous batch. At the end a summary gives prompt/output tokens, TTFT, TPOT, decode tok/s and
the KV bytes the request held in the pool tensors next to the ledger's figure for its tokens.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from kvledger.commands.engine_options import engine_options
from kvledger.engine.config import EngineConfig
from kvledger.errors import InvalidParameterError

Opt = typer.Option


@engine_options()
def generate(
    prompt: Annotated[str | None, typer.Argument(help="Prompt text, or '-' to read stdin")] = None,
    chat: Annotated[bool, Opt("--chat", help="Wrap the prompt in the model's chat template")] = False,
    system: Annotated[str | None, Opt(help="System message (implies --chat)")] = None,
    prompts_file: Annotated[Path | None, Opt(
        help="One prompt per line (blank lines skipped), run as one batch")] = None,
    max_tokens: Annotated[int, Opt(help="Most new tokens per prompt")] = 128,
    temperature: Annotated[float, Opt(help="0 = greedy")] = 0.0,
    top_p: Annotated[float, Opt()] = 1.0,
    top_k: Annotated[int, Opt(help="0 = disabled")] = 0,
    seed: Annotated[int | None, Opt()] = None,
    json_out: Annotated[bool, Opt("--json", help="Print one JSON object instead")] = False,
    *,
    engine_config: EngineConfig,
) -> None:
    """Generate text with the engine; print TTFT, TPOT and the KV bytes held vs the ledger."""
    prompts = _read_prompts(prompt, prompts_file)
    if max_tokens <= 0:
        raise InvalidParameterError(f"--max-tokens must be >= 1, got {max_tokens}")
    from kvledger.engine.engine import LLMEngine
    from kvledger.engine.sample.sampling_params import SamplingParams

    t0 = time.perf_counter()
    engine = LLMEngine(engine_config)
    load_s = time.perf_counter() - t0
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                            top_k=top_k, seed=seed)
    if chat or system:
        prompts = [_messages(p, system) for p in prompts]
    ids = [f"cli-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    final = _run(engine, stream=len(prompts) == 1 and not json_out)
    results = [final[rid] for rid in ids]
    from kvledger.commands.generate_report import print_json, print_summary

    if json_out:
        print_json(engine, results, load_s)
    else:
        print_summary(engine, results, load_s)


def _read_prompts(prompt: str | None, prompts_file: Path | None) -> list[str]:
    if prompts_file is not None and prompt is not None:
        raise InvalidParameterError("give a PROMPT or --prompts-file, not both")
    if prompts_file is not None:
        if not prompts_file.exists():
            raise InvalidParameterError(f"prompts file not found: {prompts_file}")
        lines = [ln for ln in prompts_file.read_text().splitlines() if ln.strip()]
        if not lines:
            raise InvalidParameterError(f"prompts file has no prompts: {prompts_file}")
        return lines
    if prompt is None:
        raise InvalidParameterError("give a PROMPT, '-' to read stdin, or --prompts-file")
    text = sys.stdin.read().rstrip("\r\n") if prompt == "-" else prompt
    if not text.strip():
        raise InvalidParameterError("the prompt is empty")
    return [text]


def _messages(text: str, system: str | None) -> list[dict]:
    head = [{"role": "system", "content": system}] if system else []
    return head + [{"role": "user", "content": text}]


def _run(engine, stream: bool) -> dict:
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if stream and out.new_text:
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
            if out.finished:
                final[out.request_id] = out
    if stream:
        sys.stdout.write("\n")
        sys.stdout.flush()
    return final

