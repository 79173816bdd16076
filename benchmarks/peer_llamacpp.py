"""llama.cpp as an optional peer: ``llama-bench`` figures and their lines, a ``llama-server``
process, and its converter from a Hugging Face folder to GGUF; ik_llama.cpp (a fork with
run-time repacked rows and its own CPU kernels) as a second ``llama-bench`` peer.

The binaries are found through ``$KVLEDGER_LLAMA_CPP_DIR`` (a folder holding ``llama-bench`` and
``llama-server``, e.g. a CMake ``build/bin``) and ``$KVLEDGER_IK_LLAMA_DIR`` (ik_llama.cpp's);
nothing else is searched. When a variable is unset or the folder lacks a binary, :func:`binary`
returns None and the caller prints why and skips that peer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import httpx

ENV = "KVLEDGER_LLAMA_CPP_DIR"
IK_ENV = "KVLEDGER_IK_LLAMA_DIR"


@dataclass(frozen=True)
class Peer:
    """A llama.cpp-family peer: its name in the output, the variable naming its binaries'
    folder, the ``llama-bench`` words of its best CPU run, and whether its ``llama-bench``
    takes ``-d`` depths (else ``-gp DEPTH,NEW``: decode after a prompt of DEPTH, timed alone)."""

    label: str
    env: str
    flags: tuple[str, ...] = ()
    depth_flag: bool = True


LLAMA_CPP = Peer("llama.cpp", ENV)
IK_LLAMA = Peer("ik_llama.cpp", IK_ENV, ("-rtr", "1", "-fa", "1"), depth_flag=False)
"""ik_llama.cpp with run-time repacking (``-rtr``: rows interleaved for its AVX2 / AVX-512
kernels at load) and flash attention (``-fa``), its author's advice for CPUs."""


def binary(name: str, peer: Peer = LLAMA_CPP) -> Path | None:
    """``$<peer's variable>/name`` if it is an executable file, else None."""
    folder = os.environ.get(peer.env)
    if not folder:
        return None
    path = Path(folder) / name
    return path if path.is_file() and os.access(path, os.X_OK) else None


def skip_reason(name: str, peer: Peer = LLAMA_CPP) -> str:
    """Why :func:`binary` found nothing (a line for the benchmark's output)."""
    folder = os.environ.get(peer.env)
    if not folder:
        return f"{peer.label} skipped: set {peer.env} to a folder with {name}"
    return f"{peer.label} skipped: no executable {name} in {folder}"


def llama_bench(model: Path, threads: int, prompt: int, new: int, depths: tuple[int, ...],
                repeat: int = 2, peer: Peer = LLAMA_CPP) -> list[dict]:
    """Rows of ``llama-bench -o json``: prefill (``n_prompt``) and decode (``n_gen``) tok/s
    (``avg_ts``) at each context depth (``n_depth``). A peer without ``-d`` gives prefill and
    decode from an empty context and decode after a prompt of each depth > 0 (its rows put in
    the same form: ``n_prompt`` 0, ``n_depth`` the depth).

    Raises:
        RuntimeError: llama-bench is absent or failed.
    """
    exe = binary("llama-bench", peer)
    if exe is None:
        raise RuntimeError(skip_reason("llama-bench", peer))
    if peer.depth_flag:
        depth_words = ["-d", ",".join(map(str, depths))]
    else:
        depth_words = [w for d in depths if d > 0 for w in ("-gp", f"{d},{new}")]
    cmd = [str(exe), "-m", str(model), "-t", str(threads), "-p", str(prompt), "-n", str(new),
           *depth_words, "-r", str(repeat), "-o", "json", *peer.flags]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{peer.label} llama-bench failed: {done.stderr.strip()[-400:]}")
    rows = json.loads(done.stdout)
    if not peer.depth_flag:
        for row in rows:
            after = row["n_prompt"] if row["n_prompt"] and row["n_gen"] else 0
            row["n_depth"], row["n_prompt"] = after, 0 if after else row["n_prompt"]
    return rows


def row_line(row: dict, label: str = "llama.cpp") -> str:
    """One ``llama-bench`` row as a line: prefill (``pp512``) with its TTFT or decode
    (``tg64``) with its TPOT, at its context depth."""
    per_token_ms = 1e3 / row["avg_ts"]
    if row["n_prompt"]:
        kind, what = f"pp{row['n_prompt']}", f"TTFT {row['n_prompt'] * per_token_ms:.0f} ms"
    else:
        kind, what = f"tg{row['n_gen']}", f"TPOT {per_token_ms:.2f} ms"
    return f"{label} {kind} at depth {row['n_depth']}: {row['avg_ts']:.1f} tok/s ({what})"


def bench_lines(model: Path, threads: int, prompt: int, new: int, depths: tuple[int, ...],
                repeat: int = 2, label: str | None = None, peer: Peer = LLAMA_CPP) -> list[str]:
    """:func:`row_line` of every :func:`llama_bench` row of ``peer`` (its label unless
    ``label``), or the one line that says why there is none (no llama-bench, or it failed)."""
    label = label or peer.label
    if binary("llama-bench", peer) is None:
        return [skip_reason("llama-bench", peer)]
    try:
        rows = llama_bench(model, threads, prompt, new, depths, repeat, peer)
    except RuntimeError as e:
        return [f"{label}: {e}"]
    return [row_line(row, label) for row in rows]


def convert_hf_to_gguf(folder: Path, out: Path, outtype: str, llama_src: Path | str,
                       sentencepiece: str | None = None, extra: tuple[str, ...] = ()) -> Path:
    """``out``: llama.cpp's ``convert_hf_to_gguf.py`` of the Hugging Face ``folder`` as
    ``outtype`` (``bf16``, ``q8_0``, ...), run from the source tree ``llama_src`` with its
    ``gguf-py`` and the folder ``sentencepiece`` (the converter imports it) on the path;
    ``extra``: more converter words (``--no-mtp``).

    Raises:
        subprocess.CalledProcessError: the converter failed.
    """
    src = Path(llama_src)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(src / "gguf-py"), sentencepiece,
                                                    env.get("PYTHONPATH")) if p)
    subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(folder),
                    "--outtype", outtype, "--outfile", str(out), *extra], env=env, check=True)
    return out


class Server:
    """``llama-server`` on ``port`` with ``parallel`` slots (continuous batching), as a context
    manager that waits for ``/health`` and stops the process on exit.

    Each slot gets ``context / parallel`` tokens of context (llama.cpp's rule). ``extra``:
    more command-line words (``--spec-type ngram-simple``).
    """

    def __init__(self, model: Path, port: int, threads: int, parallel: int = 16,
                 context: int = 32768, log: Path | None = None,
                 extra: tuple[str, ...] = ()) -> None:
        exe = binary("llama-server")
        if exe is None:
            raise RuntimeError(skip_reason("llama-server"))
        self.url = f"http://127.0.0.1:{port}"
        self.cmd = [str(exe), "-m", str(model), "-t", str(threads), "-c", str(context),
                    "-np", str(parallel), "--host", "127.0.0.1", "--port", str(port),
                    *extra]
        self.log = log
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Self:
        out = self.log.open("w") if self.log else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT)
        finally:
            if self.log:
                out.close()  # the child holds its own copy
        wait_healthy(self.url, self.proc)
        return self

    def __exit__(self, *exc) -> None:
        stop(self.proc)


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 600.0) -> None:
    """Poll ``url/health`` until it answers 200.

    Raises:
        RuntimeError: the process exited or the timeout passed first.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {' '.join(proc.args)}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    stop(proc)
    raise RuntimeError(f"server at {url} not healthy after {timeout_s:.0f} s")


def stop(proc: subprocess.Popen | None) -> None:
    """Terminate ``proc`` (this benchmark's own child) and wait for it."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
