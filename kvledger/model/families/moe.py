"""Mixtral and Qwen3-MoE: the Llama decoder (Qwen3-MoE with Qwen3's per-head q/k RMSNorm) whose
MLP is, on its MoE layers, routed experts (``kvledger.model.layers.experts``; Mixtral,
arXiv:2401.04088 §2; Qwen team, "Qwen3 Technical Report", arXiv:2505.09388 §2; transformers'
``MixtralModel`` / ``Qwen3MoeModel``).

- Routing: softmax over all experts, the top ``num_experts_per_tok``; Mixtral renormalises
  them (the softmax over the chosen k), Qwen3-MoE when its config's ``norm_topk_prob`` says so.
- Qwen-MoE's MoE layers are those with ``(i + 1) % decoder_sparse_step == 0`` not in
  ``mlp_only_layers``; the others keep a dense MLP of ``intermediate_size``
  (``ModelSpec.experts.mlp_only_layers``). Mixtral's layers are all MoE, each expert of
  ``intermediate_size``.
- No shared expert (Qwen2-MoE's): refused.

Mixtral checkpoints name their experts ``block_sparse_moe.experts.{e}.w1/w3/w2``
(``MixtralBlockSparseTop2MLP``: ``w2(silu(w1 x) * w3 x)``) and the router
``block_sparse_moe.gate``; they are brought to Qwen-MoE's ``mlp.experts.{e}.gate_proj`` /
``up_proj`` / ``down_proj`` and ``mlp.gate`` when loaded. GGUF: ``qwen3moe``; a Mixtral file is
``llama`` with experts (``kvledger.model.families.llama``).
"""

from __future__ import annotations

from kvledger.model.layers import plain_decoder
from kvledger.spec import (
    Config,
    Family,
    ModelSpec,
    any_value,
    full_and_sliding,
    uniform_window,
    use_sliding_window,
)

_MIXTRAL = {"w1.": "gate_proj.", "w3.": "up_proj.", "w2.": "down_proj."}


def experts_key(c: Config) -> str:
    """The key of the routed-expert count: transformers 4 writes ``num_experts`` (Qwen MoE) or
    ``num_local_experts`` (Mixtral, gpt-oss); transformers 5 writes ``num_local_experts``
    for all of them."""
    return "num_local_experts" if "num_local_experts" in c.cfg else "num_experts"


def qwen_moe_fields(c: Config, n: int) -> dict:
    """Qwen2-MoE / Qwen3-MoE / Qwen3-Next: experts on layers ``(i + 1) % decoder_sparse_step ==
    0`` not listed in ``mlp_only_layers``; an optional gated shared expert."""
    step = int(c.get("decoder_sparse_step", 1))
    dense_only = set(c.get("mlp_only_layers", []))
    dense = tuple(i for i in range(n) if i in dense_only or (i + 1) % step)
    shared = int(c.get("shared_expert_intermediate_size", 0))
    return {
        "num_experts": c.int(experts_key(c)),
        "num_experts_per_tok": c.int("num_experts_per_tok"),
        "moe_intermediate_size": c.int("moe_intermediate_size"),
        "num_shared_experts": 1 if shared else 0,
        "shared_expert_intermediate_size": shared,
        "shared_expert_gate": bool(shared),
        "mlp_only_layers": dense,
        "norm_topk_prob": bool(c.get("norm_topk_prob", False)),
    }


def _config_fields(c: Config, n: int) -> dict:
    if c.model_type == "mixtral":
        return {"num_experts": c.int(experts_key(c)), "norm_topk_prob": True,
                "moe_intermediate_size": c.int("intermediate_size"),
                "num_experts_per_tok": c.int("num_experts_per_tok")}
    return qwen_moe_fields(c, n) | {"qk_norm": True}


def _layer_types(c: Config, n: int) -> tuple[str, ...] | None:
    if c.model_type == "mixtral":
        return uniform_window(c, n)
    return use_sliding_window(c, n, first=0)  # transformers' Qwen3-MoE: every layer


def _weight_names(state: dict, spec: ModelSpec) -> None:
    """Mixtral's expert and router names -> Qwen-MoE's (module docstring)."""
    for name in list(state):
        stem, found, rest = name.partition("block_sparse_moe.")
        if not found:
            continue
        if rest.startswith("gate."):
            state[stem + "mlp." + rest] = state.pop(name)
            continue
        expert, _, proj = rest.removeprefix("experts.").partition(".")
        kind, _, suffix = proj.partition(".")
        state[f"{stem}mlp.experts.{expert}.{_MIXTRAL[kind + '.']}{suffix}"] = state.pop(name)


FAMILY = Family(
    name="moe",
    model_types=("mixtral", "qwen3_moe"),
    runs={"layer_types": full_and_sliding, "sliding_window": any_value, "qk_norm": any_value,
          "num_experts": any_value, "num_experts_per_tok": any_value,
          "moe_intermediate_size": any_value, "mlp_only_layers": any_value,
          "norm_topk_prob": any_value},  # routed experts, no shared one
    config_fields=_config_fields,
    layer_types=_layer_types,
    gguf_archs={"qwen3moe": "qwen3_moe"},
    weight_names=_weight_names,
    model=plain_decoder,
)
