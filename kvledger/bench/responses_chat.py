"""``kvledger bench --api responses``: a growing conversation kept on the server.

Unlike ``--workload chat-growth`` on the chat endpoint (the client resends the history), each
turn sends only its new message with ``previous_response_id``; the server's memory policy
decides what the prompt holds. Per turn it records prompt and cached tokens (the server's
``usage``), TTFT and TPOT measured here on the stream (first delta; (last - first) / (n - 1)),
the KV bytes the request held at its peak and the memory event (``kvledger`` extension).

``--recall`` plants :data:`FACTS` (a locker number per person) in the first turns, pads the
conversation with ``turns`` filler turns (passages of Python's documentation to comment on)
and then asks for every number; a fact counts as recalled when the reply contains its number.
"""

from __future__ import annotations

import csv
import json
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from kvledger.bench.prompts import source_text
from kvledger.errors import KVLedgerError

NAMES = ("Ada", "Boris", "Chen", "Dana", "Emil", "Farah", "Goran", "Hana", "Ivo", "Jana")
FACTS = {name: 100 + 37 * i for i, name in enumerate(NAMES)}  # distinct 3-digit numbers
CHARS_PER_TOKEN = 4  # filler turns are cut by characters; the server reports the real tokens
COLUMNS = ("policy", "turn", "prompt_tokens", "cached_tokens", "output_tokens", "ttft_s",
           "tpot_s", "kv_bytes", "memory_event")


def _events(response: httpx.Response):
    kind = None
    for line in response.iter_lines():
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: ") and kind:
            yield kind, json.loads(line[6:])


def turn(client: httpx.Client, text: str, previous: str | None, memory: str,
         truncation: str, output_len: int) -> tuple[dict, str, str]:
    """One streamed turn: (record, reply text, response id).

    Raises:
        KVLedgerError: the server refused the turn (its status and message).
    """
    body = {"input": text, "previous_response_id": previous, "stream": True, "temperature": 0,
            "max_output_tokens": output_len, "truncation": truncation, "memory": memory}
    sent = time.perf_counter()
    first = last = None
    final = None
    with client.stream("POST", "/v1/responses", json=body) as response:
        if response.status_code != 200:
            response.read()
            raise KVLedgerError(f"the server answered {response.status_code}: "
                                f"{response.text[:300]}")
        for kind, data in _events(response):
            if kind == "response.output_text.delta":
                last = time.perf_counter()
                first = first or last
            elif kind in ("response.completed", "response.incomplete", "response.failed"):
                final = data["response"]
    if final is None or final["status"] == "failed":
        raise KVLedgerError(f"the turn failed: {final and final.get('error')}")
    usage, ext = final["usage"], final.get("kvledger", {})
    n_out = usage["output_tokens"]
    record = {
        "prompt_tokens": usage["input_tokens"],
        "cached_tokens": usage["input_tokens_details"]["cached_tokens"],
        "output_tokens": n_out,
        "ttft_s": None if first is None else first - sent,
        "tpot_s": (last - first) / (n_out - 1) if first is not None and n_out > 1 else None,
        "kv_bytes": ext.get("kv_bytes"), "memory_event": ext.get("memory_event"),
    }
    text_out = "".join(part["text"] for item in final["output"] for part in item["content"])
    return record, text_out, final["id"]


def filler(i: int, turn_tokens: int) -> str:
    """A filler message of about ``turn_tokens`` tokens."""
    passage = " ".join(source_text(f"turn{i}", turn_tokens * CHARS_PER_TOKEN).split())
    return f"Turn {i}. In one sentence, what is this passage about? {passage}"


def growth(client: httpx.Client, policy: str, turns: int, turn_tokens: int,
           output_len: int, on_row: Callable[[dict], None] = lambda row: None) -> list[dict]:
    """``turns`` filler turns of one conversation; one record per turn (also passed to
    ``on_row`` as soon as it is measured).

    ``policy`` ``window`` is ``full`` with ``truncation="auto"`` (the oldest turns drop out);
    ``full`` runs with ``truncation="disabled"``.
    """
    memory = "full" if policy == "window" else policy
    truncation = "disabled" if policy == "full" else "auto"
    rows, previous = [], None
    for i in range(1, turns + 1):
        record, _, previous = turn(client, filler(i, turn_tokens), previous, memory, truncation,
                                   output_len)
        rows.append({"policy": policy, "turn": i, **record})
        on_row(rows[-1])
    return rows


def recall(client: httpx.Client, policy: str, turns: int, turn_tokens: int,
           output_len: int) -> dict:
    """Plant the facts, pad with ``turns`` filler turns, ask; how many numbers came back."""
    memory = "full" if policy == "window" else policy
    truncation = "disabled" if policy == "full" else "auto"
    previous = None
    for name, number in FACTS.items():
        _, _, previous = turn(client, f"Please remember: the locker number of {name} is "
                              f"{number}.", previous, memory, truncation, output_len)
    for i in range(1, turns + 1):
        _, _, previous = turn(client, filler(i, turn_tokens), previous, memory, truncation,
                              output_len)
    answers = {}
    for name, number in FACTS.items():
        _, reply, previous = turn(client, f"What is the locker number of {name}? Answer with "
                                  "the number only.", previous, memory, truncation, output_len)
        answers[name] = {"expected": number, "reply": reply, "ok": str(number) in reply}
    return {"policy": policy, "recalled": sum(a["ok"] for a in answers.values()),
            "asked": len(FACTS), "answers": answers}


def write(rows: list[dict], out: Path) -> list[Path]:
    """``responses_growth.csv`` and a plot of prompt/cached tokens, TTFT and KV per turn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    csv_path = out / "responses_growth.csv"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for policy in dict.fromkeys(r["policy"] for r in rows):
        mine = [r for r in rows if r["policy"] == policy]
        x = [r["turn"] for r in mine]
        axes[0].plot(x, [r["prompt_tokens"] for r in mine], label=f"{policy} prompt")
        axes[0].plot(x, [r["cached_tokens"] for r in mine], "--", label=f"{policy} cached")
        axes[1].plot(x, [(r["ttft_s"] or 0) * 1000 for r in mine], label=policy)
        axes[2].plot(x, [(r["kv_bytes"] or 0) / 2**20 for r in mine], label=policy)
    for ax, title in zip(axes, ("tokens", "TTFT (ms)", "peak KV of the turn (MiB)"),
                         strict=True):
        ax.set_title(title)
        ax.set_xlabel("turn")
        ax.legend(fontsize=7)
    png = out / "responses_growth.png"
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return [csv_path, png]


POLICIES = ("full", "summary", "segment", "window")


def run_cli(url: str, api_key: str | None, policies: str, turns: int, turn_tokens: int,
            output_len: int, with_recall: bool, out: Path, console) -> None:
    """What ``kvledger bench --api responses`` does: growth (or recall) per policy, printed
    and written to ``out``."""
    chosen = [p.strip() for p in policies.split(",") if p.strip()]
    bad = [p for p in chosen if p not in POLICIES]
    if bad or not chosen:
        raise KVLedgerError(f"--memory takes a comma list of {', '.join(POLICIES)}; got "
                            f"{policies!r}")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    base = url.rstrip("/").removesuffix("/v1")
    def show(r: dict) -> None:
        ttft = f"{r['ttft_s'] * 1000:.0f}" if r["ttft_s"] is not None else "-"
        console.print(f"{r['policy']:8} turn {r['turn']:3}  prompt {r['prompt_tokens']:5}  "
                      f"cached {r['cached_tokens']:5}  TTFT {ttft:>6} ms  "
                      f"KV {(r['kv_bytes'] or 0) / 2**20:7.1f} MiB  {r['memory_event'] or ''}")

    out.mkdir(parents=True, exist_ok=True)
    with httpx.Client(base_url=base, headers=headers, timeout=600.0) as client:
        if with_recall:  # the file is rewritten after each policy, so a failure keeps the rest
            path, results = out / "responses_recall.json", []
            for p in chosen:
                results.append(recall(client, p, turns, turn_tokens, output_len))
                path.write_text(json.dumps(results, indent=1))
                console.print(f"{p}: recalled {results[-1]['recalled']}/{results[-1]['asked']}")
            console.print(f"wrote {path}")
            return
        rows = []
        for p in chosen:
            rows += growth(client, p, turns, turn_tokens, output_len, show)
            write(rows, out)
    for path in write(rows, out):
        console.print(f"wrote {path}")
