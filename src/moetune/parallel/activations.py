"""Bytes each decoder layer saves for backward per token, by the module that saves it, under each activation
checkpointing mode and expert parallelism: the activation terms of the memory estimate (estimate.py adds them up with
the weights, the loss and the working sets). No torch: every term is arithmetic on the model config.

Notation: b bytes of the compute dtype (2 for bf16), H hidden, nH/nKV heads, D head_dim, I dense intermediate, Im
expert intermediate, k experts per token, Is shared intermediate, E routed experts, r the LoRA rank.

Expert parallelism (ep > 1): a rank's experts process the rows it receives, as many as it sends under balanced
  routing, times a skew margin 1 + 0.1·log2(ep) (an assumption, not a measurement: the busiest rank of more ranks
  is further above the mean), applied to the per-row activations (expert terms below) and to the MoE backward
  working set; plus the rows received, b·H per token and rank it reaches (`ranks_per_token`: a token travels once
  to each rank holding any of its experts, 2.0 for Air at ep 2, 5.3 at ep 8). The exchange
  (model/expert_parallel.py, `ep_expert_bytes_per_token`) keeps the routing weights (4k) and, per the experts:
    frozen: never recomputed, the rows received released: gate_up's output 2b·k·Im, as without recompute;
    trainable (LoRA on the experts, full fine-tuning), without recompute of the expert work (none, attention): the
      rows received, and the expanded pair rows and the SwiGLU output saved as recipes (a gather of the rows, an
      element-wise recompute: recompute.Rebuilt) instead of their memory, so the local "expert inputs" b·k·H +
      b·k·Im become the rows received; gate_up's output 2b·k·Im and LoRA's r-wide intermediates stay;
    trainable, full: the rows received (the checkpointed expert work keeps them, b·H·ranks_per_token);
    trainable, selective: the rows received (the checkpoint's input) and the GEMM outputs, as locally.
  A MoE layer under EP recomputes its attention and its expert work apart (recompute.split_modes). With full
  checkpointing the MoE half of the layer is not checkpointed: it saves the post-attention norm's input (eager:
  4H + 4, + b·H in full mode; compiled: b·H + 4, the bf16 residual, which is the compiled graph's output at the
  dispatcher's graph break and from which Inductor recomputes the fp32 chain), the normed input (b·H: the shared
  expert's checkpoint keeps it), the router (8E + 32k) and the expert rows. Compiled, the dispatcher is a graph
  break and the shared expert runs inside it, eagerly: 3b·Is, not 2b·Is; under attention checkpointing the residual
  after attention is likewise kept as the graph's output (b·H). The compiled terms come from a census of what
  Inductor's partition saves on the CPU (torch 2.13, one-rank EP mesh), done by hand, not by a test.

Activations: bytes saved for backward per token and layer, each term named after the module that saves it
(layer_terms, selective_terms) and checked against a census of saved tensors on CPU in
tests/unit/test_observability_inspect.py: eager, module by module without recompute and under attention
checkpointing, and layer by layer in every recompute mode and in splits of two, GQA, MLA and DSA, and the EP exchange
on a one-rank mesh, within 3 % (CENSUS_MARGIN):
  input_layernorm           4H + 4 (fp32 input, rstd) [+ b·H in full mode, the input its weight's gradient needs]
  self_attn                 b·H (normed input, when q/k/v have LoRA or in full mode) + b·D·(2nH + 2nKV) (q, k, v
                            after RoPE, attention output) + 4·nH (log-sum-exp) + b·r per LoRA linear (x·Aᵀ)
  post_attention_layernorm  as input_layernorm
  mlp (dense)               3b·I (gate, up, silu(gate)) [+ b·H + b·I in full mode or with LoRA on it] + 3b·r (LoRA)
  mlp.gate                  4E + 12k + 4 (fp32 scores, the top-k weights and indices, their normaliser)
  mlp.experts               2b·k·Im (gate_up's output: the weighted SwiGLU's own backward recomputes the rest, since
                            82752e3a) + 28k (the permutation's bookkeeping) [+ b·k·H + b·k·Im (expert inputs) in full
                            mode or with LoRA on the experts, + 2b·k·r' (their x·Aᵀ, r' the rank padded to 16 bytes)];
                            where the LoRA reads its rows through the token map inside the grouped GEMMs (a GPU's
                            default for LoRA in the TMA kernel's epilogue, `token_rows`), the tokens b·H, not b·k·H
  mlp.shared_experts        3b·Is [+ b·H + b·Is in full mode or with LoRA on it; b·H not again where `token_rows`]
                            + 3b·r (LoRA)
  final      4H (norm) + b·H (the loss's saved input gradient) + 2b·rotary_dim (RoPE cos/sin, once)
  Layer 0 of a LoRA run saves nothing for its input norm (no gradient flows into the embeddings).
  torch.compile (per layer) recomputes the element-wise chains instead of saving them: per layer it keeps
             2b·H (layer input, residual after attention) + b·D·(2nH + 2nKV) + 4nH + [2b·I dense |
             2b·k·Im + 2b·Is + 8E + 24k MoE] (+ the same full-mode/LoRA expert inputs), + b·H (the attention's normed
             input) when q/k/v (MLA: q_proj, q_a_proj, kv_a_proj_with_mqa) have LoRA or in full mode: Inductor's
             partitioner never recomputes a tensor the backward must materialise for a matmul anyway (LoRA A's or the
             weight's gradient reads it), so it keeps it as eager does. Checked against a census of what Inductor's
             partition saves on the CPU (the same partitioner as on GPU), none and attention checkpointing, GQA and MLA.
  selective activation checkpointing keeps the checkpoint's input and every GEMM and attention output, by module
             (selective_terms): checkpoint input b·H; self_attn b·D(2nH + 2nKV) + 4nH + b·H (q, k, v, SDPA's output
             and LSE, o_proj); mlp 2b·I + b·H (gate, up, down) | mlp.gate 4E, mlp.experts k·(2b·Im + b·H),
             mlp.shared_experts b·(2Is + H); and each LoRA linear's x·Aᵀ (b·r). LoRA's B products, (x·Aᵀ)·Bᵀ,
             reduce over the rank: up to names.SELECTIVE_RECOMPUTE_MAX_K (64; the experts' rank padded to 16 bytes)
             they are recomputed, above it their full-width outputs (b·out) are kept too (selective_lora_outputs).
             A LoRA linear run as one op (model/lora.py's LORA_LINEAR "op": a bf16 base, or an fp8 one whose
             operands the row kernel quantises, without LoRA dropout) has no B output of its own, whatever the rank:
             above the bound the term is an upper bound for it (b·out over).
             Norms, RoPE, SwiGLU and the gathers are recomputed: full fine-tuning keeps no expert inputs here. Every
             base GEMM of a GLM model reduces over more than the bound (the smallest: MLA's kv_lora_rank, 512).
  attention  activation checkpointing recomputes the attention block (its norm, q/k/v/o, RoPE, attention) from the
             layer input, which its checkpoint keeps (b·H, in layer 0 too), and keeps the MLP/MoE half as without
             recompute (eager: its norm and everything after). Compiled, Inductor recomputes the residual after
             attention from the layer input too (CPU census): b·H + [2b·I dense | 2b·k·Im + 2b·Is + 8E + 24k MoE]
             (+ the full-mode/LoRA inputs). One attention block is recomputed at a time.
  full activation checkpointing keeps each layer's input (b·H) and recomputes one layer at a time (under EP a MoE
             layer's attention and expert work one after the other: the larger of the two).
  A per-layer split ({mode: layers}, ac_modes) counts each layer in its own mode; one layer's recompute, the
             largest of any layer's, is added once.
  A checkpoint (selective, attention, full) keeps all its inputs, whether the layer reads them or not: a DSA model
             past index_topk hands each "full" indexer layer's top-k to the next layer, kept there, 8·index_topk
             per token (`receives_topk`).
MLA attention (GLM-4.7-Flash, GLM-5; nH heads, qk = nope + rope, v per head, latents r_q = q_lora_rank (if any) and
  r_kv = kv_lora_rank), in place of GQA's b·D·(2nH + 2nKV) + 4nH:
             b·nH·(2qk + nope + v + v) (q, k, the kv_b_proj output v is a view of, the attention output) + 4nH
             + per latent 4r + 4 (its RMSNorm's fp32 input, rstd; + b·r in full mode) + b·r when its B projection
             (q_b_proj, kv_b_proj) trains; b·H (normed input) when q_proj / q_a_proj / kv_a_proj_with_mqa train.
             Layer 0 of a LoRA run keeps q, k, v and a latent's norm only when a projection upstream of them trains.
             Compiled: the latent norms keep the projection's bf16 output + 4: b·r_q + 4, and b·(r_kv + rope) + 4 for
             the kv latent, a view of kv_a_proj_with_mqa's whole output (RoPE key included). Selective: the GEMM outputs b·(r_q + r_kv + rope +
             nH·(qk + nope + v + v)) + 4nH.
  DSA (GLM-5) past index_topk tokens: each layer attends through its own mask of the selected keys, saved as the
             attention's float bias: b·S per token (S the sequence length), + S (bool) once for the document mask.
             The indexer runs without gradient: it saves nothing, and its transient — a chunk of fp32 scores
             (names.INDEXER_CHUNK_SCORES), the top-k indices 8·k·S and masks (2 + b)·S per token of a sequence — is
             a forward working set, counted when larger than the backward's.
"""

from __future__ import annotations

import math

from moetune.model.config import GLM_MOE_DSA
from moetune.names import ATTENTION_TARGETS, MLA_PROJECTIONS, SELECTIVE_RECOMPUTE_MAX_K

EP_SKEW_PER_DOUBLING = 0.1  # received rows above the mean on the busiest rank, per doubling of ep (assumed)


def sparse_attention(m, seq: int) -> bool:
    """Whether a DSA model selects keys at this sequence length (longer than index_topk): it then attends through a
    dense mask per layer, and its indexers run."""
    return m.model_type == GLM_MOE_DSA and seq > m.index_topk


def attention_bytes_per_token(m, mode: str, b: int, lora: set, full: bool, first: bool = False, seq: int = 0,
                              rank: int = 16):
    """(bytes one layer's attention saves per token past its input norm, whether it also keeps the normed input):
    the module docstring's attention terms, GQA or MLA."""
    nH = m.num_attention_heads
    if not m.is_mla:
        D, nKV = m.head_dim, m.num_key_value_heads
        core = b * D * (2 * nH + 2 * nKV) + 4 * nH + b * rank * len(lora & set(ATTENTION_TARGETS))
        return core, bool(full or lora & {"q_proj", "k_proj", "v_proj"})
    qk, nope, v, R = m.qk_head_dim, m.qk_nope_head_dim, m.v_head_dim, m.qk_rope_head_dim
    core = b * rank * len(lora & set(MLA_PROJECTIONS))
    frozen_input = first and not full  # layer 0 of a LoRA run: no gradient flows into its input
    # (selective keeps every GEMM output whether a gradient needs it or not: layer 0 like the others)
    if frozen_input and mode != "selective" and not lora & {"q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
                                                            "kv_b_proj"}:
        return core + (b * nH * v if "o_proj" in lora else 0), False  # o_proj's LoRA keeps its input
    latents = [(m.kv_lora_rank, "kv_a_proj_with_mqa", "kv_b_proj")]
    latents += [(m.q_lora_rank, "q_a_proj", "q_b_proj")] if m.q_lora_rank else []
    core += 4 * nH + (b * seq if sparse_attention(m, seq) else 0)  # LSE; a DSA layer's mask, as float bias
    if mode == "selective":  # the GEMM outputs and the attention's
        core += b * (sum(r for r, _, _ in latents) + R + nH * (qk + nope + v + v))
    else:  # q, k (all heads), the kv_b_proj output v is a view of, the attention output
        core += b * nH * (2 * qk + nope + v + v)
        for r, producer, consumer in latents:
            if not frozen_input or producer in lora:  # RMSNorm: fp32 input, rstd
                if mode == "compiled":  # recomputed from the projection's bf16 output, which Inductor keeps whole:
                    # the kv latent is a view of kv_a_proj_with_mqa's output, the RoPE key's R columns included
                    core += b * (r + (R if producer == "kv_a_proj_with_mqa" else 0)) + 4
                else:
                    core += 4 * r + 4 + (b * r if full else 0)
            core += b * r if full or consumer in lora else 0  # the normed latent, for the B projection's gradient
    return core, bool(full or lora & {"q_proj", "q_a_proj", "kv_a_proj_with_mqa"})


def lora_small_bytes_per_token(m, moe: bool, b: int, lora: set, rank: int) -> float:
    """LoRA's rank-sized intermediates (x·Aᵀ) of an MLP or MoE half, one per adapted linear; the experts' rank is
    padded to 16 bytes (two per (token, expert) pair: gate_up's and down's)."""
    linears = 3 * ("shared_experts" in lora if moe else "dense_mlp" in lora)
    return b * rank * linears + (2 * b * m.num_experts_per_tok * _padded_rank(rank, b) if moe and "experts" in lora
                                 else 0)


def _padded_rank(rank: int, b: int) -> int:
    return -(-rank * b // 16) * 16 // b


def layer_terms(m, moe: bool, mode: str, b: int, lora: set, full: bool, first: bool = False, rank: int = 16,
                seq: int = 0, token_rows: bool = False) -> tuple[dict[str, float], dict[str, float]]:
    """What one layer saves for backward per token without recompute (mode eager | compiled), by the module that
    saves it, as (attention half, MLP/MoE half): the attention half from the layer input through o_proj, the other
    from the residual after attention through the MLP or MoE. Eager, the census of saved tensors checks each
    module's term (tests/unit/test_observability_inspect.py); compiled, a layer is one graph, whose terms are named
    after what Inductor's partition keeps (a census by hand). token_rows: the routed experts' LoRA reads its rows
    through the token map inside the grouped GEMMs (estimate.gathers_expert_inputs), so the experts keep the tokens,
    b·H, instead of the expanded rows, b·k·H; the shared expert's LoRA keeps the same tokens, counted once, with
    the experts, which run first."""
    H = m.hidden_size
    k, Im, E = m.num_experts_per_tok, m.moe_intermediate_size, m.n_routed_experts
    Is, I = m.moe_intermediate_size * m.n_shared_experts, m.intermediate_size
    attention, qkv_input = attention_bytes_per_token(m, mode, b, lora, full, first, seq, rank)
    expert_rows = b * H if token_rows else b * k * H
    expert_inputs = (expert_rows + b * k * Im) if (full or "experts" in lora) else 0
    mlp_inputs = (b * H + b * I) if (full or "dense_mlp" in lora) else 0
    shared_inputs = ((0 if token_rows else b * H) + b * Is) if (full or "shared_experts" in lora) else 0
    lora_a = b * rank * 3  # the three adapted linears' x·Aᵀ of a dense MLP or shared expert
    experts_lora_a = 2 * b * k * _padded_rank(rank, b) if "experts" in lora else 0
    shared_lora_a = lora_a if "shared_experts" in lora else 0
    dense_lora_a = lora_a if "dense_mlp" in lora else 0
    if mode == "compiled":  # each half keeps its bf16 input (the layer input is not needed in layer 0 of LoRA)
        # The normed input is kept as in eager, not recomputed from the layer input: Inductor's partitioner never
        # recomputes a tensor that the backward must materialise for a matmul anyway (here LoRA A's or the weight's
        # gradient).
        attn = {"layer input (compiled graph)": 0 if first and not full else b * H,
                "self_attn": (b * H if qkv_input else 0) + attention}
        ffn = {"residual after attention (compiled graph)": b * H}
        if moe:
            ffn.update({"mlp.gate": 8 * E + 24 * k, "mlp.experts": 2 * b * k * Im + expert_inputs + experts_lora_a,
                        "mlp.shared_experts": 2 * b * Is + shared_inputs + shared_lora_a})
        else:
            ffn["mlp"] = 2 * b * I + mlp_inputs + dense_lora_a
        return attn, ffn
    norm = 4 * H + 4 + (b * H if full else 0)  # fp32 input and rstd (+ the bf16 cast the norm weight's gradient needs)
    attn = {"input_layernorm": 0 if first and not full else norm,
            "self_attn": (b * H if qkv_input else 0) + attention}  # + the normed input q/k/v's LoRA or weight needs
    ffn = {"post_attention_layernorm": norm}
    if moe:
        # the router: fp32 scores 4E, the top-k weights and indices, their normaliser; the experts: gate_up's output
        # (the weighted SwiGLU's backward recomputes the rest) and the permutation's bookkeeping, 28 bytes a pair
        ffn.update({"mlp.gate": 4 * E + 12 * k + 4,
                    "mlp.experts": 2 * b * k * Im + 28 * k + expert_inputs + experts_lora_a,
                    "mlp.shared_experts": 3 * b * Is + shared_inputs + shared_lora_a})  # gate, up, silu(gate)
    else:
        ffn["mlp"] = 3 * b * I + mlp_inputs + dense_lora_a  # gate, up, silu(gate)
    return attn, ffn


def layer_halves(m, moe: bool, mode: str, b: int, lora: set, full: bool, first: bool = False, rank: int = 16,
                 seq: int = 0, token_rows: bool = False) -> tuple[float, float]:
    """(attention half, MLP/MoE half) of layer_terms, summed."""
    attn, ffn = layer_terms(m, moe, mode, b, lora, full, first, rank, seq, token_rows)
    return sum(attn.values()), sum(ffn.values())


def activation_bytes_per_token(m, moe: bool, mode: str, b: int, lora: set, full: bool, first: bool = False,
                               rank: int = 16, seq: int = 0, ac: str = "none", topk_in: bool = False,
                               token_rows: bool = False) -> float:
    """Bytes one layer saves for backward per token (see the module docstring); mode: eager | compiled | selective
    (selective activation checkpointing); ac attention | full: the checkpoint keeps the layer input (b·H, layer 0's
    too) and the rest of its inputs; attention keeps the MLP/MoE half as without recompute. topk_in: a checkpoint
    (selective, attention, full) keeps the DSA top-k the layer receives, 8 bytes per selected key
    (`receives_topk`). seq: the sequence length (DSA's sparse attention saves a mask row per token). token_rows: as
    layer_terms (selective keeps the GEMMs' outputs either way)."""
    topk = 8 * min(m.index_topk, seq) if topk_in else 0
    if mode == "selective":  # a checkpoint too: it keeps the top-k it receives
        return selective_bytes_per_token(m, moe, b, lora, full, first, rank, seq) + topk
    H = m.hidden_size
    inputs = b * H + topk
    if ac == "full":
        return inputs
    attn, mlp = layer_halves(m, moe, mode, b, lora, full, first, rank, seq, token_rows)
    if ac == "attention":
        # Compiled, the residual after attention is recomputed from the layer input rather than saved (a CPU census
        # of Inductor's partition): the MLP half's own input is not kept.
        return inputs + mlp - (b * H if mode == "compiled" else 0)
    return attn + mlp


def moe_half_outside_bytes_per_token(m, mode: str, b: int, full: bool) -> float:
    """What a MoE half under expert parallelism, whose expert work recomputes apart from its attention
    (recompute.split_modes: `full` and `selective`), keeps outside its checkpoints, per token, before the router: the post-attention norm (eager: its
    fp32 input and rstd, + the bf16 cast its weight's gradient needs in full mode; compiled: the bf16 residual and
    rstd, from which Inductor recomputes the fp32 chain) and the normed input (the expert work's and the shared
    expert's checkpoints keep it, one tensor)."""
    H = m.hidden_size
    norm = b * H + 4 if mode == "compiled" else 4 * H + 4 + (b * H if full else 0)
    return norm + b * H


def receives_topk(m, layer: int, seq: int) -> bool:
    """Whether `layer` receives a top-k that no earlier layer's checkpoint holds: a DSA model past index_topk hands
    each "full" indexer layer's selection on to the next layer (model/mla.py), whose checkpoint keeps it whether the
    layer reads it or not."""
    return sparse_attention(m, seq) and layer > 0 and m.indexer_type(layer - 1) == "full"


def lora_output_widths(m, moe: bool, lora: set) -> dict[str, float]:
    """Per token, the width of each adapted linear's LoRA output (x·Aᵀ)·Bᵀ, by module (per routed pair for the
    experts: gate_up's B and down's B, k pairs a token)."""
    H, k, Im, Is, I = (m.hidden_size, m.num_experts_per_tok, m.moe_intermediate_size,
                       m.moe_intermediate_size * m.n_shared_experts, m.intermediate_size)
    nH = m.num_attention_heads
    if m.is_mla:
        qk, nope, v, R = m.qk_head_dim, m.qk_nope_head_dim, m.v_head_dim, m.qk_rope_head_dim
        widths = {"q_proj": nH * qk, "q_a_proj": m.q_lora_rank or 0, "q_b_proj": nH * qk,
                  "kv_a_proj_with_mqa": m.kv_lora_rank + R, "kv_b_proj": nH * (nope + v), "o_proj": H}
    else:
        D, nKV = m.head_dim, m.num_key_value_heads
        widths = {"q_proj": nH * D, "k_proj": nKV * D, "v_proj": nKV * D, "o_proj": H}
    out = {f"self_attn.{name}": w for name, w in widths.items() if name in lora}
    if moe and "shared_experts" in lora:
        out["mlp.shared_experts"] = 2 * Is + H
    if moe and "experts" in lora:
        out["mlp.experts"] = k * (2 * Im + H)
    if not moe and "dense_mlp" in lora:
        out["mlp"] = 2 * I + H
    return out


def selective_lora_outputs(m, moe: bool, b: int, lora: set, rank: int) -> dict[str, float]:
    """Per token, by module, the bytes of LoRA's B outputs that selective checkpointing keeps: none up to a rank of
    SELECTIVE_RECOMPUTE_MAX_K, whose products model/recompute.py recomputes (they reduce over the rank, the experts'
    padded to 16 bytes), the full width of each adapted linear's above it."""
    return {name: b * width for name, width in lora_output_widths(m, moe, lora).items()
            if (_padded_rank(rank, b) if name == "mlp.experts" else rank) > SELECTIVE_RECOMPUTE_MAX_K}


def selective_terms(m, moe: bool, b: int, lora: set, full: bool, first: bool = False, rank: int = 16,
                    seq: int = 0) -> dict[str, float]:
    """Selective activation checkpointing, per token, by the module that keeps it: the checkpoint's input, every
    GEMM and attention output (model/recompute._saved_ops) but LoRA's B products up to rank 64
    (selective_lora_outputs); norms, RoPE, SwiGLU and the permutation gathers are recomputed, so full fine-tuning
    keeps no more than LoRA but its adapters' x·Aᵀ."""
    H = m.hidden_size
    k, Im, E = m.num_experts_per_tok, m.moe_intermediate_size, m.n_routed_experts
    Is, I = m.moe_intermediate_size * m.n_shared_experts, m.intermediate_size
    attention, _ = attention_bytes_per_token(m, "selective", b, lora, full, first, seq, rank)
    terms = {"checkpoint input": b * H, "self_attn": attention + b * H}  # q/k/v (or MLA's), SDPA, o_proj's output
    if moe:
        terms["mlp.gate"] = 4 * E  # the fp32 router logits
        terms["mlp.experts"] = k * (2 * b * Im + b * H)  # gate_up's and down's grouped GEMM outputs
        terms["mlp.shared_experts"] = b * (2 * Is + H)  # gate, up, down
    else:
        terms["mlp"] = b * (2 * I + H)  # gate, up, down
    for name, nbytes in selective_lora_outputs(m, moe, b, lora, rank).items():
        terms[name] = terms.get(name, 0) + nbytes
    small = lora_small_bytes_per_token(m, moe, b, lora, rank)
    if small:
        terms["mlp LoRA x·Aᵀ"] = small
    return terms


def selective_bytes_per_token(m, moe: bool, b: int, lora: set, full: bool, first: bool = False, rank: int = 16,
                              seq: int = 0) -> float:
    """Selective activation checkpointing: the GEMM and attention outputs (selective_terms)."""
    return sum(selective_terms(m, moe, b, lora, full, first, rank, seq).values())


def expert_row_bytes_per_token(m, mode: str, b: int, lora: set, full: bool, rank: int = 16) -> float:
    """The part of a MoE layer's `activation_bytes_per_token` that lives on the k routed rows of a token: under
    expert parallelism, on the rank that holds the expert."""
    k, Im, H = m.num_experts_per_tok, m.moe_intermediate_size, m.hidden_size
    experts_lora = "experts" in lora
    lora_a = 2 * b * k * _padded_rank(rank, b) if experts_lora else 0
    if mode == "selective":  # selective_terms' "mlp.experts": the grouped GEMMs' outputs (LoRA's B's above rank 64)
        b_outputs = selective_lora_outputs(m, True, b, lora, rank).get("mlp.experts", 0)
        return k * (2 * b * Im + b * H) + b_outputs + lora_a
    return ((b * k * H + b * k * Im) if (full or experts_lora) else 0) + lora_a + 2 * b * k * Im


def ep_expert_bytes_per_token(m, ac: str, b: int, lora: set, full: bool, ep: int, rank: int = 16) -> float:
    """What a rank's local expert work keeps per token of its own batch under expert parallelism (balanced routing,
    before the skew margin), from model/expert_parallel.py's exchange; `ac` the layer's activation checkpointing.

    Trainable experts (LoRA on them, or full fine-tuning): recomputed (full) they keep the rows received, b·H per
    token and rank it reaches; without recompute (none, attention) the exchange keeps the same rows and saves the
    expanded (token, expert) pair rows and the SwiGLU output as recipes (a gather, an element-wise op) instead of
    their memory, so of the local formula's rows only gate_up's output 2b·k·Im and LoRA's small intermediates stay;
    selective keeps them (its checkpoint's input) and the GEMM outputs. Frozen experts are never recomputed and free
    the rows received: gate_up's output. Plus the routing weights of the pairs, 4k."""
    k, Im, H = m.num_experts_per_tok, m.moe_intermediate_size, m.hidden_size
    trainable = full or "experts" in lora
    mode = "none" if not trainable or ac == "attention" else ac  # recompute.split_modes: attention keeps the MoE half
    received = b * H * ranks_per_token(m, ep)
    if mode == "full":
        return received + 4 * k
    if mode == "none" and trainable:
        return received + 2 * b * k * Im + (2 * b * k * _padded_rank(rank, b) if "experts" in lora else 0) + 4 * k
    if mode == "selective" and trainable:  # the checkpoint keeps its input, the rows received, and the GEMM outputs
        return received + expert_row_bytes_per_token(m, "selective", b, lora, full, rank) + 4 * k
    return expert_row_bytes_per_token(m, "eager", b, lora, full, rank) + 4 * k


def ep_layer_bytes_per_token(m, mode: str, ac: str, b: int, lora: set, full: bool, ep: int, first: bool = False,
                             rank: int = 16, seq: int = 0, topk_in: bool = False) -> float:
    """What a MoE layer saves per token under expert parallelism (mode eager | compiled, `ac` the layer's activation
    checkpointing), its expert rows with the skew margin (the module docstring)."""
    H, Is, k, E = m.hidden_size, m.moe_intermediate_size * m.n_shared_experts, m.num_experts_per_tok, m.n_routed_experts
    experts = ep_skew(ep) * ep_expert_bytes_per_token(m, ac, b, lora, full, ep, rank)
    if ac == "full":
        # The layer input for the attention's recompute; the MoE half is not checkpointed: what its norm keeps and the
        # normed input (compiled, the bf16 residual is a graph output at the dispatcher's graph break), the router and
        # the exchange's plan; then the expert rows.
        inputs = b * H + (8 * min(m.index_topk, seq) if topk_in else 0)
        return inputs + moe_half_outside_bytes_per_token(m, mode, b, full) + 8 * E + 32 * k + experts
    if ac == "selective":
        # The attention block is one selective checkpoint; the MoE half is not checkpointed as a piece: the
        # post-attention norm and the router keep what they keep eagerly, the shared expert is its own selective
        # checkpoint (its input, its GEMM outputs), the local expert work the expert rows above.
        terms = selective_terms(m, True, b, lora, full, first, rank, seq)
        attention = sum(v for name, v in terms.items() if name == "checkpoint input" or name.startswith("self_attn"))
        shared = b * H + terms["mlp.shared_experts"] + (b * rank * 3 if "shared_experts" in lora else 0)
        norm = 4 * H + 4 + (b * H if full else 0)
        topk = 8 * min(m.index_topk, seq) if topk_in else 0
        return attention + topk + norm + shared + 8 * E + 32 * k + experts
    local_mode = mode
    local = activation_bytes_per_token(m, True, local_mode, b, lora, full, first, rank, seq, ac, topk_in)
    # Compiled, the dispatcher is a graph break: the shared expert runs inside it, eagerly (3b·Is, not 2b·Is), under
    # attention recompute the residual after attention is the compiled graph's output, kept (b·H), and the exchange's
    # plan keeps one int64 a pair more than the local permutation's two (8E + 32k with the router, as under `full`).
    graph_break = b * Is + (b * H if ac == "attention" else 0) + 8 * k if mode == "compiled" else 0
    return local - expert_row_bytes_per_token(m, local_mode, b, lora, full, rank) + experts + graph_break


def ep_skew(ep: int) -> float:
    """The skew margin on a rank's received rows (EP_SKEW_PER_DOUBLING)."""
    return 1 + EP_SKEW_PER_DOUBLING * math.log2(ep)


def ranks_per_token(m, ep: int) -> float:
    """Expected number of EP ranks holding at least one of a token's k experts under uniform routing, E/ep experts
    per rank: the rows the exchange moves per token (model/expert_parallel.py sends a token once per such rank)."""
    E, k = m.n_routed_experts, m.num_experts_per_tok
    return ep * (1 - math.comb(E - E // ep, k) / math.comb(E, k))
