"""Names and numbers several packages must agree on: one definition each, imported everywhere else.

Nothing here imports torch or another moetune module, so any module may import it.
"""

from __future__ import annotations

import re

# ---- labels: a target token the loss skips (prompt, padding, the last position of a document)
IGNORE_INDEX = -100

# ---- tokens per lm_head + cross-entropy chunk: the logits never exist for more tokens than this at once
LOSS_CHUNK_TOKENS = 2048

# ---- fp32 scores the DSA indexer holds at once (index heads × queries × keys): it scores a chunk of queries at a
# time, so seq 4096 × 32 index heads needs 128 MiB, not the 2 GiB of every query's scores together
INDEXER_CHUNK_SCORES = 2**25

# ---- selective activation checkpointing recomputes a product that reduces over at most this many elements (LoRA's
# B, which reduces over the rank) instead of keeping its output: model/recompute.py says why, and the estimate
# (parallel/activations.py) counts what it keeps by the same bound
SELECTIVE_RECOMPUTE_MAX_K = 64

# ---- LoRA targets, in canonical order (the saved config, the resume hash and exports use this order)
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
# MLA (GLM-4.7-Flash, GLM-5): q_proj or q_a_proj + q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj
MLA_ATTENTION_TARGETS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
MLP_TARGETS = ("dense_mlp", "shared_experts", "experts")
LORA_TARGETS = ATTENTION_TARGETS + MLA_ATTENTION_TARGETS + MLP_TARGETS
MLA_PROJECTIONS = ("q_proj",) + MLA_ATTENTION_TARGETS + ("o_proj",)
LORA_ALIASES = {
    "attention": ATTENTION_TARGETS,
    "all": ATTENTION_TARGETS + MLP_TARGETS,
    # every MLA projection (q_proj or q_a_proj/q_b_proj, whichever the model has)
    "mla_attention": MLA_PROJECTIONS,
    "mla_all": MLA_PROJECTIONS + MLP_TARGETS,
}

# ---- parameters no gradient reaches: GLM-5's DSA indexer runs without one (as in transformers). Full fine-tuning
# keeps them frozen, so the optimizer holds no state for them (a checkpoint would lack what a resume expects)
NO_GRADIENT_RE = re.compile(r"\.self_attn\.indexer\.")
# ...of which vLLM's GLM-5 / DeepSeek-V3.2 loader takes the query projection in its checkpoint's fp8 (a linear under
# the quantization config); its wk it upcasts to bf16 (fused with weights_proj, unquantised) whichever it is given
INDEXER_FP8_RE = re.compile(r"\.self_attn\.indexer\.wq_b\.weight$")

# ---- HF parameter names of GLM-4.5 (transformers v5 = ours)
# model.layers.N.<anything>: N is the decoder layer (N == num_hidden_layers is the MTP layer the hub ships)
LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
# the hub's per-expert tensors: model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight
HF_EXPERT_RE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# transformers v5's (and our) stacked experts: model.layers.N.mlp.experts.{gate_up_proj [E, 2I, H], down_proj [E, H, I]}
FUSED_EXPERT_RE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
# the router's weight (model.layers.N.mlp.gate.weight): frozen unless finetune.train_router, never quantised
ROUTER_WEIGHT_SUFFIX = ".mlp.gate.weight"
# the weights an fp8 base stores in fp8, in the hub's names (per-expert or fused): attention projections (GQA and MLA),
# dense MLPs, shared and routed experts — not the router (mlp.gate), DSA's indexer, norms, embeddings or lm_head
FP8_WEIGHT_RE = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.(" + "|".join(ATTENTION_TARGETS + MLA_ATTENTION_TARGETS) + r")\.weight"
    r"|mlp\.(shared_experts\.|experts\.\d+\.)?(gate|up|down)_proj\.weight|mlp\.experts\.(gate_up|down)_proj)$")
# the same with an fp8 stack's scales (`gate_up_proj_scale[_inv]`): the hub stores them per expert beside each weight
FUSED_EXPERT_PART_RE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(_scale|_scale_inv)?$")


def layer_index(name: str) -> int | None:
    """The decoder layer a parameter name belongs to, or None (embeddings, final norm, lm_head)."""
    m = LAYER_RE.match(name)
    return int(m.group(1)) if m else None
