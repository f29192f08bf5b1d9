"""The GLM-4.5 mixture-of-experts architecture (GLM-4.5, 4.5-Air, 4.6, 4.7), in plain PyTorch.

Module and parameter names mirror transformers v5's `Glm4MoeForCausalLM`, experts fused as
`gate_up_proj [E, 2I, H]` and `down_proj [E, H, I]`, so a state dict converts to HF by renaming nothing.

    embed → N × [x + Attn(RMSNorm(x)); x + MLP-or-MoE(RMSNorm(x))] → RMSNorm → lm_head
    Attn: GQA, q/k/v bias, optional per-head qk RMSNorm, NeoX RoPE on the first head_dim·partial_rotary_factor dims
          (GLM-4.7-Flash and GLM-5 are this model with MLA, mla.py, and MLA + DSA, glm_moe_dsa.py, in its place)
    MoE:  sigmoid router in fp32 (+e_score_correction_bias for the choice only), group-limited top-k,
          normalised weights × routed_scaling_factor; routed experts via grouped GEMM; + shared expert
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from moetune.model.attention import AttnMeta, KVCache, attend, build_attn_meta
from moetune.model.config import ModelConfig
from moetune.model.loss import linear_cross_entropy, linear_logprobs
from moetune.model.step_inputs import unstaged
from moetune.names import LOSS_CHUNK_TOKENS
from moetune.model.experts import Bags, fp8_routed_experts, fuses_fp8_mlp, permute, routed_experts
from moetune.model.quant.modules import FrozenFp8, expert_weight, scale_name, transposed_copy
from moetune.model.recompute import recompute, split_modes


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        # As transformers: normalise in fp32, cast back, then scale (the order matters for bf16 parity).
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_cos_sin(position_ids, rotary_dim: int, theta: float, dtype):
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float, device=position_ids.device) / rotary_dim
    inv_freq = 1.0 / (theta ** exponents)
    freqs = position_ids[..., None].float() * inv_freq  # [B, S, rotary_dim/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x, cos, sin):
    """NeoX-style (rotate_half) rotation of the first cos.shape[-1] dims of x [B, S, heads, D]; the rest pass."""
    d = cos.shape[-1]
    x_rot, x_pass = x[..., :d], x[..., d:]
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    x1, x2 = x_rot[..., : d // 2], x_rot[..., d // 2 :]
    rotated = torch.cat((-x2, x1), dim=-1)
    return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)


def linears_of_one_input(x, *modules) -> list:
    """[m(x) for m in modules], or what the modules' class computes for all of them at once where it can (a hook,
    `of_one_input(x, modules)`, None where it cannot: LoRA linears as one op, model/lora.py)."""
    together = getattr(type(modules[0]), "of_one_input", None)
    ys = together(x, modules) if together is not None else None
    return ys if ys is not None else [m(x) for m in modules]


class Attention(nn.Module):
    """Grouped-query attention. Every attention class (this, mla.MLAttention, glm_moe_dsa.DSAttention) has this
    forward: `topk` is sparse attention's selection handed from layer to layer (GQA takes and gives none); with a
    `cache` (decoding) the new positions' keys and values are appended to it and the queries attend to every cached
    one. Without a cache it is the training forward."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        H, D = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(H, self.n_heads * D, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(H, self.n_kv * D, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(H, self.n_kv * D, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * D, H, bias=False)
        if cfg.use_qk_norm:
            self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(D, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, cos, sin, attn: AttnMeta, topk=None, cache: KVCache | None = None):
        """x [B, S, H] -> (out [B, S, H], None)."""
        B, S, _ = x.shape
        q, k, v = linears_of_one_input(x, self.q_proj, self.k_proj, self.v_proj)
        q = q.view(B, S, self.n_heads, self.head_dim)
        k, v = k.view(B, S, self.n_kv, self.head_dim), v.view(B, S, self.n_kv, self.head_dim)
        if self.q_norm is not None:  # after the bias, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:  # keys after RoPE: a cached key never moves
            k, v = cache.extend(self, k, v)
        o = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn)
        return self.o_proj(o.transpose(1, 2).reshape(B, S, -1)), None


class MLP(nn.Module):
    """SwiGLU MLP: the dense layers and the shared expert."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        gate, up = linears_of_one_input(x, self.gate_proj, self.up_proj)
        return self.down_proj(F.silu(gate) * up)


# The router's logits are fp32, as transformers computes them (x and W cast to fp32). From bf16 x and W every product
# is exact in fp32, so on CUDA a bf16 tensor-core GEMM that accumulates and writes fp32 (`torch.mm`'s out_dtype) gives
# the same sums up to their order, where fp32 operands run on the SIMT units (~3 ms of GLM-4.7-Flash's step on an H200,
# forward and input gradient). False: always the fp32 GEMM.
ROUTER_TENSOR_CORES = True


class _FrozenRouterLogits(torch.autograd.Function):
    """x [T, H] · Wᵀ in fp32 for a frozen bf16 router weight W [E, H] and bf16 x. The input gradient
    g · W takes the fp32 g as the sum of two 16-bit halves (hi + lo: 16 of fp32's 24 significand bits, where x's
    bf16 gradient keeps 8) in one GEMM over [hi, lo] · [W; W], accumulated in fp32."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(weight)
        if x.is_cuda:
            return torch.mm(x, weight.t(), out_dtype=torch.float32)
        return x.float() @ weight.float().t()  # torch.mm's out_dtype is CUDA's only (the CPU tests' twin)

    @staticmethod
    def backward(ctx, g):
        (weight,) = ctx.saved_tensors
        hi = g.to(weight.dtype)
        lo = (g - hi.float()).to(weight.dtype)
        return torch.cat([hi, lo], 1) @ torch.cat([weight, weight], 0), None


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, H] · weightᵀ in fp32 (transformers' numerics: both operands cast to fp32)."""
    if ROUTER_TENSOR_CORES and x.is_cuda and not weight.requires_grad and x.dtype == weight.dtype == torch.bfloat16:
        return _FrozenRouterLogits.apply(x, weight)
    return F.linear(x.float(), weight.float())


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k, self.n_experts = cfg.num_experts_per_tok, cfg.n_routed_experts
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.norm_topk_prob, self.scaling = cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        # Trained by the load-balancing rule of the original recipe, never by gradients: a buffer.
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def forward(self, x):
        """x [T, H] -> (scores [T, E] fp32, topk weights [T, k] fp32, topk indices [T, k])."""
        logits = router_logits(x, self.weight)
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        if self.n_group > 1:
            grouped = choice.view(-1, self.n_group, self.n_experts // self.n_group)
            group_scores = grouped.topk(2, dim=-1)[0].sum(-1)
            group_idx = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0).bool()
            choice = grouped.masked_fill(~group_mask.unsqueeze(-1), float("-inf")).view(-1, self.n_experts)
        topk_idx = choice.topk(self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, topk_idx)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return scores, weights * self.scaling, topk_idx


class Experts(nn.Module):
    """Routed experts as stacked weights; `lora` (an ExpertLoRA) is attached by `apply_lora` when targeted.

    Under expert parallelism `parallel.apply_ep` shards the weights by expert and injects a `dispatcher`
    (expert_parallel.AllToAllDispatcher) that moves each rank's rows to the rank holding their expert and back; routing
    stays local."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, H, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.num_experts = E
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H))  # gate rows first, then up
        self.down_proj = nn.Parameter(torch.empty(E, H, I))
        self.lora = None
        self.dispatcher = None
        self.quant = None  # an Fp8Scheme when the stack is stored in fp8 with its scales (model/quant)

    def forward(self, x, topk_idx, topk_weights, side_work=None, recompute: str = "none"):
        """(sum of each token's weighted expert outputs [T, H], rows per expert [E], side_work()'s result).
        `side_work` is independent work (the shared expert) the dispatcher runs under its communication;
        `recompute` is the layer's activation checkpointing, applied here around the local expert work only."""
        if self.dispatcher is not None:
            return self.dispatcher(x, topk_idx, topk_weights, self._weights(), self._compute, self.num_experts,
                                   side_work, recompute)
        perm = permute(topk_idx, self.num_experts)
        row_weights = topk_weights.reshape(-1)[perm.order]
        gate_up, down = expert_weight(self, "gate_up_proj"), expert_weight(self, "down_proj")
        if torch.compiler.is_compiling() and fuses_fp8_mlp(x, gate_up, down, self.lora):
            y = fp8_routed_experts(x, perm, row_weights, gate_up, down)
        else:
            y = routed_experts(x, perm.bags, perm.offs, row_weights, gate_up, down, self.lora)
        return y, perm.counts, side_work() if side_work is not None else None

    def _weights(self):
        """The tensors the dispatcher hands `_compute` (this rank's shards): base stacks, their fp8 scales (and kept
        transposed copies), LoRA."""
        lora, q = self.lora, self.quant
        scales = () if q is None else tuple(getattr(self, scale_name(n, q)) for n in ("gate_up_proj", "down_proj"))
        copies = tuple(c for c in (transposed_copy(self, "gate_up_proj"), transposed_copy(self, "down_proj"))
                       if c is not None)
        extra = () if lora is None else lora.pairs()
        return (self.gate_up_proj, self.down_proj, *scales, *copies, *extra)

    def _compute(self, rows, bag, slots, offs, row_weights, gate_up, down, *rest, rebuilt=None):
        if self.quant is not None:
            (gate_up_scale, down_scale), rest = rest[:2], rest[2:]
            copies = (None, None)
            if transposed_copy(self, "gate_up_proj") is not None:
                copies, rest = rest[:2], rest[2:]
            gate_up = FrozenFp8(gate_up, gate_up_scale, self.quant, copies[0])
            down = FrozenFp8(down, down_scale, self.quant, copies[1])
        return routed_experts(rows, Bags(bag, slots), offs, row_weights, gate_up, down, self.lora, rest or None,
                              rebuilt)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)
        # Side outputs of the last forward, read by the trainer (expert-load metrics, auxiliary loss).
        self.last_counts: torch.Tensor | None = None
        self.last_aux_loss: torch.Tensor | None = None
        self.last_router_entropy: torch.Tensor | None = None
        self.compute_aux_loss = False
        self.track_router_entropy = False

    def forward(self, x, recompute: str = "none"):
        y, side = self.forward_with_side(x, recompute)
        self.keep(side)
        return y

    def forward_with_side(self, x, recompute: str = "none"):
        """-> (output, side outputs). Inside a checkpointed region the side outputs are returned, not stored:
        under torch.compile a module attribute set inside a checkpoint is a side effect the checkpoint cannot
        trace, and Dynamo then runs the whole recomputed layer eagerly (measured: 2.7x slower, full-size Air)."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        scores, weights, idx = self.gate(flat)
        routed, counts, shared = self.experts(flat, idx, weights, side_work=lambda: self._shared(x, recompute),
                                              recompute=recompute)
        aux = load_balancing_loss(scores, counts, idx.shape[-1]) if self.compute_aux_loss else None
        entropy = router_entropy(scores.detach()) if self.track_router_entropy else None
        return routed.view(shape) + shared, (counts.detach(), aux, entropy)

    def keep(self, side) -> None:
        """Store a forward's side outputs for the trainer (expert-load metrics, auxiliary loss, router entropy)."""
        self.last_counts, aux, entropy = side
        if aux is not None:
            self.last_aux_loss = aux
        if entropy is not None:
            self.last_router_entropy = entropy

    def _shared(self, x, mode):
        return recompute(self.shared_experts, mode, x)


def router_entropy(scores):
    """Mean over tokens of the entropy of the router's (normalised) scores, in units of log E: 1 = undecided."""
    p = scores / scores.sum(-1, keepdim=True)
    return -(p * p.clamp(min=1e-30).log()).sum(-1).mean() / math.log(scores.shape[-1])


def load_balancing_loss(scores, counts, top_k):
    """Switch-style balance loss E·Σᵢ fᵢ·Pᵢ on the sigmoid scores (normalised per token): 1.0 when uniform."""
    E = scores.shape[-1]
    probs = scores / scores.sum(-1, keepdim=True)
    f = counts.float() / (counts.sum().float().clamp(min=1.0))
    return E * (f * probs.mean(0)).sum()


def exchanges_rows(mlp: nn.Module) -> bool:
    """Whether a layer's MLP is a MoE under expert parallelism (its experts' rows cross ranks)."""
    return isinstance(mlp, MoE) and mlp.experts.dispatcher is not None


def mlp_with(mlp: nn.Module, x, mode: str):
    """A layer's MLP or MoE half under activation checkpointing `mode` (a MoE applies it to its local expert work
    and shared expert, never to an expert-parallel exchange)."""
    return mlp(x, recompute=mode) if isinstance(mlp, MoE) else recompute(mlp, mode, x)


class DecoderLayer(nn.Module):
    """x + Attn(RMSNorm(x)); x + MLP-or-MoE(RMSNorm(x)), whatever the attention (GQA, MLA, MLA + DSA indexer):
    `attention_cls` is built as attention_cls(cfg, layer_idx) and called as Attention.forward says."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, attention_cls=None):
        super().__init__()
        self.self_attn = (attention_cls or Attention)(cfg, layer_idx)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(layer_idx) else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.activation_checkpointing = "none"  # one of ac_modes.AC_MODES, set by parallel.apply_ac

    def _forward(self, x, cos, sin, attn, topk, cache):
        """The whole layer (what a whole-layer recompute re-runs): -> (x, topk, the MoE's side outputs or None),
        which forward stores outside the checkpoint."""
        h, topk = self._attention(x, cos, sin, attn, topk, cache)
        x = x + h
        if isinstance(self.mlp, MoE):
            y, side = self.mlp.forward_with_side(self.post_attention_layernorm(x))
            return x + y, topk, side
        return x + self.mlp(self.post_attention_layernorm(x)), topk, None

    def _attention(self, x, cos, sin, attn, topk, cache):
        return self.self_attn(self.input_layernorm(x), cos, sin, attn, topk, cache)

    def forward(self, x, cos, sin, attn, topk=None, cache: KVCache | None = None):
        """-> (x, the sparse attention's top-k for the next layer or None). The top-k travels as an input and an
        output, so a recomputed layer uses the one its forward used."""
        mode = self.activation_checkpointing if torch.is_grad_enabled() else "none"
        split = split_modes(mode, exchanges_rows(self.mlp))
        if split is None:
            # Routing is a deterministic function of the input, so the recompute chooses the same experts.
            x, topk, side = recompute(self._forward, mode, x, cos, sin, attn, topk, cache)
            if side is not None:
                self.mlp.keep(side)
            return x, topk
        attention_mode, mlp_mode = split
        h, topk = recompute(self._attention, attention_mode, x, cos, sin, attn, topk, cache)
        x = x + h
        return x + mlp_with(self.mlp, self.post_attention_layernorm(x), mlp_mode), topk


class Backbone(nn.Module):
    """`model.*` in HF naming."""

    def __init__(self, cfg: ModelConfig, attention_cls):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, attention_cls) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Glm4MoeForCausalLM(nn.Module):
    """The causal LM; GLM-4.7-Flash and GLM-5 are this with their own `attention_cls`."""

    attention_cls = Attention

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg, self.attention_cls)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.attn_implementation = "auto"  # model.attn_implementation: auto, sdpa, flex, varlen, varlen_fa4, eager
        self.loss_chunk_tokens = LOSS_CHUNK_TOKENS  # per lm_head+CE chunk: logits never exist for the whole batch
        # where the layers' per-step inputs live: step_inputs.StepInputs where they replay as CUDA graphs
        self.step_inputs = unstaged

    def forward(self, input_ids, position_ids=None, labels=None, cache: KVCache | None = None, per_token=False):
        """labels None: logits [B, S, V]. labels given (already shifted, -100 = ignore): the summed fp32
        cross-entropy over the target tokens (the trainer divides by the global token count), or with per_token
        each target's fp32 log-probability [B, S] (0 where ignored); neither makes the [B, S, V] logits.
        cache (decoding: model/generation.py): input_ids continue the cache.length positions the cache holds, which
        each attention extends; the logits are the last position's only, [B, 1, V] (the next token's)."""
        B, S = input_ids.shape
        if position_ids is None:
            start = 0 if cache is None else cache.length
            position_ids = torch.arange(start, start + S, device=input_ids.device).expand(B, S)
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(position_ids, self.config.rotary_dim, self.config.rope_theta, x.dtype)
        if cache is None:
            cos, sin = self.step_inputs("cos", cos), self.step_inputs("sin", sin)
            x = self.run_layers(x, cos, sin, self.attn_meta(position_ids))
        else:
            x = self.run_layers(x, cos, sin, cache.attn_meta(B, S, x.device), cache)[:, -1:]
            cache.length += S
        x = self.model.norm(x)
        if labels is None:
            return self.lm_head(x)
        h, w, targets = x.reshape(-1, x.shape[-1]), self.lm_head.weight, labels.reshape(-1)
        if per_token:
            return linear_logprobs(h, w, targets, self.loss_chunk_tokens).view(labels.shape)
        return linear_cross_entropy(h, w, targets, self.loss_chunk_tokens)

    def attn_meta(self, position_ids) -> AttnMeta:
        return build_attn_meta(position_ids, self.attn_implementation, self.step_inputs)

    def run_layers(self, x, cos, sin, attn, cache: KVCache | None = None):
        # One forward is one step for CUDA graph trees (layers compiled with mode "reduce-overhead"): every layer's
        # outputs, and the side outputs the trainer reads after backward, stay valid until the next forward. Without
        # it a no-grad forward (evaluation) starts a new step at each layer and frees the layer before's outputs.
        # Nothing else reads the mark.
        torch.compiler.cudagraph_mark_step_begin()
        topk = None  # sparse attention's selection: a "shared" DSA layer reuses the one before it
        for layer in self.model.layers:
            x, topk = layer(x, cos, sin, attn, topk, cache)
        return x

    def moe_layers(self):
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, MoE)]
