"""LoRA for linear layers and for stacked experts (our own; PEFT is used only to verify and to export).

Linear:  y = x·Wᵀ + b + s·(drop(x)·Aᵀ)·Bᵀ,  A [r, in] (Kaiming-uniform, as PEFT), B [out, r] = 0.
Experts: per-expert A and B as 3-D tensors, applied to the tokens already permuted for the grouped GEMM:
         gate_up: A [E, r, H], B [E, 2I, r] (one A feeds gate and up rows, as PEFT's fused target);
         down:    A [E, r, I], B [E, H, r].
s = alpha/r, or alpha/√r with rsLoRA. Base weights stay frozen (bf16 in training); LoRA weights are fp32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from moetune.model.experts import grouped_linear
from moetune.model.quant.matmul import fp8_mm, fp8_mm_dgrad, fp8_mm_in_one_op, fp8_mm_lora, fp8_mm_lora_fits
from moetune.model.quant.modules import Fp8Linear, frozen_linear, transposed_copy, weight_scale
from moetune.model.recompute import register_product

from moetune.names import ATTENTION_TARGETS as ATTENTION, LORA_TARGETS as TARGETS, MLA_ATTENTION_TARGETS as MLA_ATTENTION
from moetune.tensors import is_dtensor, local_tensor

_QUERY_FORMS = ("q_proj", "q_a_proj", "q_b_proj")  # MLA has one form or the other, by q_lora_rank


# How a LoRA linear on a frozen base adds its branch s·(x·Aᵀ)·Bᵀ to the base product x·Wᵀ + b:
# - "op": one opaque op each way (`lora_linear` below; on an fp8 weight where its operands are quantised by the row
#   kernel, quant.matmul.fp8_mm_in_one_op). Its forward's GEMM writes y and LoRA's B product is added onto y in place
#   (cuBLAS's beta = 1), its backward's input gradient the same with A; the graph around it sees one node.
#   One H200, same call against "addmm": GLM-4.7-Flash LoRA on MLA with CUDA graphs 17,146 tokens/s against 16,908,
#   AIR-8 q,k,v,o 41,435 against 41,030, an EP-8 rank of Air equal (BENCHMARKS.md, twenty-sixth session). On an fp8
#   base (Flash, CUDA graphs, no copies) 18,873 against 18,563; the 284 copies of its step gone (twenty-seventh).
# - "addmm": traced, LoRA's product added by an addmm (the sum in the GEMM's epilogue, as Unsloth's fast LoRA).
#   Compiled, Inductor calls aten's out-of-place addmm, which first copies the base output into its own: 284
#   device-to-device copies (3.4 ms) a GLM-4.7-Flash step (BENCHMARKS.md, twenty-fifth session); its backward adds
#   the input gradients of W and A in a pass of their own.
# - "sum": the product written, then added.
# LoRA dropout, a sharded weight, and an fp8 weight whose operands Inductor quantises (fused into the kernels that
# make them) take the traced forms ("op" then means "addmm").
LORA_LINEAR = "op"


def _base_product(x2, weight, scale, bias):
    """x2 · Wᵀ + b: W bf16-like (`scale` None), or fp8 with row scales (quant.matmul's fp8 GEMM)."""
    if scale is not None:
        return fp8_mm(x2, weight, scale, bias)
    return torch.mm(x2, weight.t()) if bias is None else torch.addmm(bias, x2, weight.t())


def _base_input_grad(g, weight, scale, transposed):
    """dy · W: bf16-like, or the fp8 input gradient (on `transposed`, the weight's kept [in, out] copy, or a copy
    made here)."""
    return torch.mm(g, weight) if scale is None else fp8_mm_dgrad(g, weight, scale, transposed=transposed)


# Where a base's output is much wider than its input (MLA's q_b and kv_b: 768 -> 5,120 and 512 -> 8,960), the in-place
# add reads and writes all of y again. There the op makes LoRA's branch inside the base GEMM:
# - a bf16-like base (LORA_ALONG_K): as more columns of its reduction, y = [x | s·x·Aᵀ]·[W | B]ᵀ, and backward
#   [dy·W | dy·s·B] = dy·[W | s·B] (the backward's dy·s·B no longer reads dy again), copying x and W with r more
#   columns instead;
# - an fp8 base (quant.matmul.FP8_LORA_EPILOGUE): the TMA kernel's product with s·(x·Aᵀ)·Bᵀ added in its epilogue.
# One H200, GPU time of one op forward + backward, 4,096 rows, rank 16 (BENCHMARKS.md, twenty-eighth session): bf16
# kv_b 0.243 -> 0.203 ms, q_b 0.176 -> 0.163; fp8 kv_b 0.263 -> 0.229, q_b 0.182 -> 0.167. On the narrower shapes
# (q_a, kv_a, o_proj; Air's q, k, v, o) the fp8 epilogue was 3–7% slower than cuBLAS + the add, and the bf16
# concatenations would move more bytes than the add: there the branch is added in place. Flash LoRA on MLA, harness
# with CUDA graphs: bf16 17,246 tokens/s against 17,039 in place.
LORA_ALONG_K = True


# Where the branch is added in place, its K = r GEMM reads and rewrites all of y (memory-bound: on one EP-8 rank of
# Air 6.5 ms forward and 5.0 backward of a 442 ms step, BENCHMARKS.md, thirty-fourth session). LORA_FIRST writes the
# branch's product first and lets the base GEMM add onto it (beta = 1 on the compute-bound GEMM, whose epilogue reads
# y under its K loop): y is read once less by a kernel that does nothing else. Each way x's gradient the same with A.
# One H100 (BENCHMARKS.md, thirty-fourth session): forward + backward of one op 4-5% faster on Air's q and o, 2-3%
# slower on Flash's narrow q_a and kv_a; the EP-8 rank's step +0.4% and AIR-8's +0.1%, within their spread. Off until
# an H200 measures it where FlashAttention-4 runs.
LORA_FIRST = False


def _branch_then_base(x2, h, weight, bias, lora_B, scaling):
    """y = s·h·Bᵀ + b, then y += x·Wᵀ in place (bf16-like W)."""
    hs = h * scaling
    y = torch.mm(hs, lora_B.t()) if bias is None else torch.addmm(bias, hs, lora_B.t())
    return y.addmm_(x2, weight.t())


def _wide_output(rows: int, weight: torch.Tensor, lora_A: torch.Tensor) -> bool:
    """Whether the branch goes inside the base GEMM: the in-place add moves 2·rows·out values, the concatenations
    2·(rows + out)·(in + r)."""
    out, n_in = weight.shape
    return rows * out > (rows + out) * (n_in + lora_A.shape[0])


def _product_along_k(x2, h, weight, bias, lora_B, scaling):
    """y = [x | s·h]·[W | B]ᵀ + b, h = x·Aᵀ."""
    xc, wc = torch.cat([x2, h * scaling], 1), torch.cat([weight, lora_B], 1)
    return torch.mm(xc, wc.t()) if bias is None else torch.addmm(bias, xc, wc.t())


def _grads_along_k(g, weight, lora_A, lora_B, scaling):
    """x's gradient and dy·s·B from [dy·W | dy·s·B] = dy·[W | s·B], one GEMM reading dy."""
    gc = torch.mm(g, torch.cat([weight, lora_B * scaling], 1))
    grad_h = gc[:, weight.shape[1]:]
    return torch.addmm(gc[:, :weight.shape[1]], grad_h, lora_A), grad_h


# One op each way for a LoRA linear on a frozen weight, bf16-like (`scale` None) or fp8 with row scales (`scale` its
# [out, 1] scales, `transposed` its kept [in, out] copy or None): the base GEMM writes y and LoRA's branch is added in
# place, or made inside that GEMM where the output is wide (above). It returns x·Aᵀ besides y, to save for the
# backward.
@torch.library.custom_op("moetune::lora_linear", mutates_args=())
def _lora_linear_op(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None,
                    transposed: torch.Tensor | None, lora_A: torch.Tensor, lora_B: torch.Tensor,
                    scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    x2 = x.reshape(-1, x.shape[-1])
    h = torch.mm(x2, lora_A.t())  # what B's gradient needs
    wide = _wide_output(x2.shape[0], weight, lora_A)
    if scale is None and wide and LORA_ALONG_K:
        y = _product_along_k(x2, h, weight, bias, lora_B, scaling)
    elif scale is not None and wide and fp8_mm_lora_fits(x2, weight, lora_A.shape[0], bias):
        y = fp8_mm_lora(x2, weight, scale, h * scaling, lora_B.t())
    elif scale is None and LORA_FIRST:
        y = _branch_then_base(x2, h, weight, bias, lora_B, scaling)
    else:
        y = _base_product(x2, weight, scale, bias)
        y.addmm_(h, lora_B.t(), alpha=scaling)  # in place: cuBLAS's beta = 1
    return y.view(*x.shape[:-1], weight.shape[0]), h


@_lora_linear_op.register_fake
def _(x, weight, scale, bias, transposed, lora_A, lora_B, scaling):
    return x.new_empty(*x.shape[:-1], weight.shape[0]), x.new_empty(math.prod(x.shape[:-1]), lora_A.shape[0])


@torch.library.custom_op("moetune::lora_linear_bwd", mutates_args=())
def _lora_linear_bwd_op(grad: torch.Tensor, x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor,
                        scale: torch.Tensor | None, transposed: torch.Tensor | None, lora_A: torch.Tensor,
                        lora_B: torch.Tensor, scaling: float,
                        input_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = grad.reshape(-1, grad.shape[-1])
    if scale is not None:
        g = g.contiguous()  # the fp8 GEMM's operand is quantised row by row
    if input_grad and scale is None and LORA_ALONG_K and _wide_output(g.shape[0], weight, lora_A):
        dx, grad_h = _grads_along_k(g, weight, lora_A, lora_B, scaling)
    else:
        grad_h = torch.mm(g, lora_B * scaling)  # the gradient reaching x·Aᵀ
        if not input_grad:
            dx = None
        elif scale is None and LORA_FIRST:
            dx = torch.mm(grad_h, lora_A).addmm_(g, weight)
        else:
            dx = _base_input_grad(g, weight, scale, transposed).addmm_(grad_h, lora_A)
    grad_A, grad_B = torch.mm(grad_h.t(), x.reshape(-1, x.shape[-1])), torch.mm(g.t(), h * scaling)
    return (dx.view(x.shape) if input_grad else x.new_empty(0)), grad_A, grad_B


@_lora_linear_bwd_op.register_fake
def _(grad, x, h, weight, scale, transposed, lora_A, lora_B, scaling, input_grad):
    return x.new_empty(x.shape if input_grad else (0,)), lora_A.new_empty(lora_A.shape), lora_B.new_empty(lora_B.shape)


def _lora_linear_setup(ctx, inputs, output):
    x, weight, scale, _, transposed, lora_A, lora_B, scaling = inputs
    ctx.save_for_backward(x, output[1], weight, scale, transposed, lora_A, lora_B)
    ctx.scaling = scaling


def _lora_linear_backward(ctx, grad, _grad_h):
    # h is an output only to be saved: nothing outside reads it, so its gradient is zero
    x, h, weight, scale, transposed, lora_A, lora_B = ctx.saved_tensors
    dx, grad_A, grad_B = torch.ops.moetune.lora_linear_bwd(grad, x, h, weight, scale, transposed, lora_A, lora_B,
                                                            ctx.scaling, ctx.needs_input_grad[0])
    return (dx if ctx.needs_input_grad[0] else None), None, None, None, None, grad_A, grad_B, None


_lora_linear_op.register_autograd(_lora_linear_backward, setup_context=_lora_linear_setup)
register_product(torch.ops.moetune.lora_linear.default)


def lora_linear(x, weight, bias, lora_A, lora_B, scaling: float, scale=None, transposed=None) -> torch.Tensor:
    """x·Wᵀ + b + scaling·(x·Aᵀ)·Bᵀ for a frozen W and b (no gradient) as one op each way, in x's dtype. An fp8 W
    gives its row `scale` (and its kept transposed copy, or None): the base product and input gradient then run on
    fp8 tensor cores (quant.matmul.fp8_mm_in_one_op says where)."""
    return torch.ops.moetune.lora_linear(x, weight, scale, bias, transposed, lora_A, lora_B, scaling)[0]


def lora_scaling(rank: int, alpha: float, rslora: bool) -> float:
    return alpha / math.sqrt(rank) if rslora else alpha / rank


class LoRALinear(nn.Module):
    """A linear layer with a LoRA branch; keeps `weight`/`bias` under the base layer's names."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float, rslora: bool):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.quant = getattr(base, "quant", None)  # an fp8 base keeps its scale under the checkpoint's name
        if self.quant is not None:
            setattr(self, self.quant.scale_suffix, weight_scale(base))
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        dev = base.weight.device
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, device=dev, dtype=torch.float32))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, device=dev, dtype=torch.float32))
        self.scaling = lora_scaling(rank, alpha, rslora)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.reset_lora()

    def reset_lora(self):
        if self.lora_A.device.type != "meta":
            nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
            nn.init.zeros_(self.lora_B)

    def forward(self, x):
        A, B = self.lora_A.to(x.dtype), self.lora_B.to(x.dtype)
        if LORA_LINEAR == "op" and self._one_op(x):
            scale = None if self.quant is None else weight_scale(self)
            return lora_linear(x, self.weight, self.bias, A, B, self.scaling, scale, transposed_copy(self, "weight"))
        y = frozen_linear(self, x)
        h = F.linear(self.dropout(x), A)
        if LORA_LINEAR == "sum":
            return y + F.linear(h, B) * self.scaling
        y2 = torch.addmm(y.reshape(-1, y.shape[-1]), h.reshape(-1, h.shape[-1]), B.t(), alpha=self.scaling)
        return y2.view(y.shape)

    def _one_op(self, x) -> bool:
        if not isinstance(self.dropout, nn.Identity) or self.weight.requires_grad or any(
                map(is_dtensor, (self.weight, self.lora_A, self.lora_B))):
            return False
        if self.quant is not None:
            return fp8_mm_in_one_op(x, self.weight, self.quant)
        return x.dtype == self.weight.dtype

    def extra_repr(self):
        return f"in={self.in_features}, out={self.out_features}, r={self.lora_A.shape[0]}, scaling={self.scaling:g}"


class ExpertLoRA(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int, rank: int, alpha: float, dropout: float,
                 rslora: bool, device=None):
        super().__init__()
        E, H, I, r = num_experts, hidden, intermediate, rank
        f32 = dict(device=device, dtype=torch.float32)
        self.gate_up_A = nn.Parameter(torch.empty(E, r, H, **f32))
        self.gate_up_B = nn.Parameter(torch.zeros(E, 2 * I, r, **f32))
        self.down_A = nn.Parameter(torch.empty(E, r, I, **f32))
        self.down_B = nn.Parameter(torch.zeros(E, H, r, **f32))
        self.scaling = lora_scaling(rank, alpha, rslora)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.reset_lora()

    def pairs(self) -> tuple:
        """(gate_up A, gate_up B, down A, down B): what the experts' computation takes as `lora_weights`."""
        return self.gate_up_A, self.gate_up_B, self.down_A, self.down_B

    def reset_lora(self):
        if self.gate_up_A.device.type == "meta":
            return
        for A in (self.gate_up_A, self.down_A):
            bound = 1.0 / math.sqrt(A.shape[-1])  # what kaiming_uniform(a=√5) gives each expert's [r, in] slice
            nn.init.uniform_(A, -bound, bound)
        nn.init.zeros_(self.gate_up_B)
        nn.init.zeros_(self.down_B)

    def delta(self, x, A, B, offs):
        """scaling · B(A x) per expert for rows x sorted by expert; A, B are this module's gate_up or down pair
        (under expert parallelism: this rank's experts)."""
        # The scaling goes into B (weight-sized), not onto the [rows, out] product: in eager code (the expert-parallel
        # exchange) that is one element-wise pass over the rows fewer each way.
        A, B = _pad_rank(local_tensor(A).to(x.dtype), (local_tensor(B) * self.scaling).to(x.dtype))
        return grouped_linear(grouped_linear(self.dropout(x), A, offs), B, offs)


def _pad_rank(A, B):
    """grouped_mm wants 16-byte-aligned strides: pad the rank with zero rows of A / columns of B (which adds
    exactly zero, and whose gradients are zero) when rank × element size is not a multiple of 16."""
    step = 16 // A.element_size()
    pad = -A.shape[1] % step
    if pad == 0:
        return A, B
    return F.pad(A, (0, 0, 0, pad)), F.pad(B, (0, pad))


def _targeted_linears(model, targets):
    """(module kind, parent module, attribute name) for every linear the targets select."""
    from moetune.model.glm4_moe import MLP, MoE

    for layer in model.model.layers:
        for name in ATTENTION + MLA_ATTENTION:
            if name in targets and isinstance(getattr(layer.self_attn, name, None), (nn.Linear, Fp8Linear)):
                yield name, layer.self_attn, name
        mlp = layer.mlp
        if isinstance(mlp, MLP) and "dense_mlp" in targets:
            for name in ("gate_proj", "up_proj", "down_proj"):
                yield "dense_mlp", mlp, name
        if isinstance(mlp, MoE) and "shared_experts" in targets:
            for name in ("gate_proj", "up_proj", "down_proj"):
                yield "shared_experts", mlp.shared_experts, name


def apply_lora(model, targets, rank: int, alpha: float, dropout: float = 0.0, rslora: bool = False) -> dict:
    """Freeze the base and add LoRA on the targeted modules. Returns {kind: number of modules adapted}.

    A target that matches nothing (e.g. `dense_mlp` on a model whose layers are all MoE) is an error.
    """
    unknown = set(targets) - set(TARGETS)
    if unknown:
        raise ValueError(f"unknown LoRA target(s) {sorted(unknown)}; choose from {list(TARGETS)}")
    for p in model.parameters():
        p.requires_grad_(False)
    adapted = {t: 0 for t in targets}
    for kind, parent, name in list(_targeted_linears(model, targets)):
        setattr(parent, name, LoRALinear(getattr(parent, name), rank, alpha, dropout, rslora))
        adapted[kind] += 1
    if "experts" in targets:
        for moe in model.moe_layers():
            ex = moe.experts
            E, twoI, H = ex.gate_up_proj.shape
            ex.lora = ExpertLoRA(E, H, twoI // 2, rank, alpha, dropout, rslora, device=ex.gate_up_proj.device)
            adapted["experts"] += 1
    empty = [t for t, n in adapted.items() if n == 0]
    if model.config.is_mla and any(adapted.get(t) for t in _QUERY_FORMS):
        # asking for the query projection in both forms (the mla_attention alias) adapts the one the model has
        empty = [t for t in empty if t not in _QUERY_FORMS]
    if empty:
        c = model.config
        kind = (f"{c.model_type}, MLA attention: q_proj or q_a_proj/q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj"
                if c.is_mla else f"{c.model_type}, attention q_proj/k_proj/v_proj/o_proj")
        raise ValueError(f"lora.targets {empty} match no module of this model ({kind}; "
                         f"{c.num_hidden_layers} layers, first_k_dense_replace={c.first_k_dense_replace})")
    return adapted


def lora_state_dict(model) -> dict:
    return {k: v for k, v in model.state_dict().items() if ".lora_" in k or ".lora." in k}


def trainable_table(model) -> list[tuple[str, int, int]]:
    """Rows (module kind, tensors, parameters) of what requires grad, grouped by kind."""
    rows: dict[str, list[int]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        kind = module_kind(name)
        r = rows.setdefault(kind, [0, 0])
        r[0] += 1
        r[1] += p.numel()
    return [(k, v[0], v[1]) for k, v in sorted(rows.items())]


def module_kind(param_name: str) -> str:
    parts = param_name.split(".")
    if "experts" in parts and "shared_experts" not in parts:
        return "experts"
    if "indexer" in parts:
        return "indexer"
    for kind in ("shared_experts",) + ATTENTION + MLA_ATTENTION + ("gate", "embed_tokens", "lm_head"):
        if kind in parts:
            return "router" if kind == "gate" else kind
    if "mlp" in parts:
        return "dense_mlp"
    return "norm"


def format_trainable_table(model) -> str:
    rows = trainable_table(model)
    total = sum(p.numel() for p in model.parameters())
    w = max([16] + [len(k) + 2 for k, _, _ in rows])  # kv_a_proj_with_mqa
    lines = [f"{'module kind':<{w}}{'tensors':>10}{'parameters':>16}"]
    lines += [f"{k:<{w}}{n:>10}{c:>16,}" for k, n, c in rows]
    trainable = sum(c for _, _, c in rows)
    lines.append(f"{'trainable':<{w}}{'':>10}{trainable:>16,}  ({100 * trainable / max(total, 1):.4f}% of {total:,})")
    return "\n".join(lines)
