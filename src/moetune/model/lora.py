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
#   kernel, quant.matmul.fp8_mm_in_one_op). Its forward's GEMM and LoRA's B product write y together, one adding onto
#   the other's output in place (cuBLAS's beta = 1: LORA_FIRST says which comes first), its backward's input gradient
#   the same with A; the graph around it sees one node (one for the linears that read one input: JOINT_INPUTS).
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
# One H200, forward + backward of one op at 4,096 rows, rank 16: Air's q 1.228 -> 1.179 ms, o 1.222 -> 1.177, k/v and
# GLM-4.7-Flash's q_a, kv_a within 2% either way; on the GPU the output is bit for bit the in-place form's (cuBLAS's
# epilogue rounds the product before it adds C, so both orders add the same two bf16 numbers). With JOINT_INPUTS
# through the step (BENCHMARKS.md, thirty-fifth session): an EP-8 rank of Air +1.2% and +0.7% in two calls, AIR-8
# +1.3%, Flash -0.1%; alone +-0.2%.
LORA_FIRST = True


def _branch_then_base(x2, h, weight, bias, lora_B, scaling):
    """y = s·h·Bᵀ + b, then y += x·Wᵀ in place (bf16-like W)."""
    hs = h * scaling
    y = torch.mm(hs, lora_B.t()) if bias is None else torch.addmm(bias, hs, lora_B.t())
    return y.addmm_(x2, weight.t())


def _wide_output(rows: int, weight: torch.Tensor, rank: int) -> bool:
    """Whether the branch goes inside the base GEMM: the in-place add moves 2·rows·out values, the concatenations
    2·(rows + out)·(in + r)."""
    out, n_in = weight.shape
    return rows * out > (rows + out) * (n_in + rank)


def _product_along_k(x2, h, weight, bias, lora_B, scaling):
    """y = [x | s·h]·[W | B]ᵀ + b, h = x·Aᵀ."""
    xc, wc = torch.cat([x2, h * scaling], 1), torch.cat([weight, lora_B], 1)
    return torch.mm(xc, wc.t()) if bias is None else torch.addmm(bias, xc, wc.t())


def _grads_along_k(g, weight, lora_B, scaling):
    """dy·W (x's gradient but for the branch) and dy·s·B from [dy·W | dy·s·B] = dy·[W | s·B]: one GEMM reading dy."""
    gc = torch.mm(g, torch.cat([weight, lora_B * scaling], 1))
    return gc[:, :weight.shape[1]], gc[:, weight.shape[1]:]


# One op each way for LoRA linears on frozen weights that read the same input (one, or GQA's q, k and v, MLA's q_a and
# kv_a, an MLP's gate and up: JOINT_INPUTS), each bf16-like (`scale` None) or fp8 with row scales (`scale` its [out, 1]
# scales, `transposed` its kept [in, out] copy or None): each base GEMM writes its y and LoRA's branch is added in
# place, or made inside that GEMM where the output is wide (above). The members' x·Aᵀ are one GEMM reading x once,
# [x·A₁ᵀ | x·A₂ᵀ | ...], which the op returns besides the ys, to save for the backward; there A's gradients are one GEMM
# reading x once, and x's gradient is one sum, each member's product added onto it in place (beta = 1) and the
# branches' dy·s·B·A as one product over the members' ranks.
@torch.library.custom_op("moetune::lora_linear", mutates_args=())
def _lora_linear_op(x: torch.Tensor, weights: list[torch.Tensor], scales: list[torch.Tensor | None],
                    biases: list[torch.Tensor | None], transposed: list[torch.Tensor | None],
                    lora_A: list[torch.Tensor], lora_B: list[torch.Tensor],
                    scalings: list[float]) -> list[torch.Tensor]:
    x2 = x.reshape(-1, x.shape[-1])
    h = torch.mm(x2, _joined(lora_A).t())  # what B's gradient needs
    ys = []
    for weight, scale, bias, B, scaling, hi in zip(weights, scales, biases, lora_B, scalings, _split(h, lora_A)):
        wide = _wide_output(x2.shape[0], weight, hi.shape[1])
        if scale is None and wide and LORA_ALONG_K:
            y = _product_along_k(x2, hi, weight, bias, B, scaling)
        elif scale is not None and wide and fp8_mm_lora_fits(x2, weight, hi.shape[1], bias):
            y = fp8_mm_lora(x2, weight, scale, hi * scaling, B.t())
        elif scale is None and LORA_FIRST:
            y = _branch_then_base(x2, hi, weight, bias, B, scaling)
        else:
            y = _base_product(x2, weight, scale, bias)
            y.addmm_(hi, B.t(), alpha=scaling)  # in place: cuBLAS's beta = 1
        ys.append(y.view(*x.shape[:-1], weight.shape[0]))
    return ys + [h]


def _joined(lora_A):
    return lora_A[0] if len(lora_A) == 1 else torch.cat(lora_A)


def _split(t, lora_A):
    """Each member's columns of [rows, Σ r] (views)."""
    return t.split([A.shape[0] for A in lora_A], dim=1)


@_lora_linear_op.register_fake
def _(x, weights, scales, biases, transposed, lora_A, lora_B, scalings):
    return ([x.new_empty(*x.shape[:-1], w.shape[0]) for w in weights]
            + [x.new_empty(math.prod(x.shape[:-1]), sum(A.shape[0] for A in lora_A))])


@torch.library.custom_op("moetune::lora_linear_bwd", mutates_args=())
def _lora_linear_bwd_op(grads: list[torch.Tensor], x: torch.Tensor, h: torch.Tensor, weights: list[torch.Tensor],
                        scales: list[torch.Tensor | None], transposed: list[torch.Tensor | None],
                        lora_A: list[torch.Tensor], lora_B: list[torch.Tensor], scalings: list[float],
                        input_grad: bool) -> list[torch.Tensor]:
    """[x's gradient (empty without input_grad), A's gradients..., B's gradients...]."""
    x2 = x.reshape(-1, x.shape[-1])
    # an fp8 GEMM's operand is quantised row by row
    gs = [gr.reshape(-1, gr.shape[-1]) if s is None else gr.reshape(-1, gr.shape[-1]).contiguous()
          for gr, s in zip(grads, scales)]
    grad_hs, parts = [], []  # parts: each member's base input gradient, or None where it comes later
    for g, weight, scale, A, B, scaling in zip(gs, weights, scales, lora_A, lora_B, scalings):
        if input_grad and scale is None and LORA_ALONG_K and _wide_output(g.shape[0], weight, A.shape[0]):
            part, grad_h = _grads_along_k(g, weight, B, scaling)
            grad_hs.append(grad_h)
            parts.append(part)
        else:
            grad_hs.append(torch.mm(g, B * scaling))  # the gradient reaching x·Aᵀ
            parts.append(None)
    grad_h, A = grad_hs[0] if len(grad_hs) == 1 else torch.cat(grad_hs, 1), _joined(lora_A)
    dx = x.new_empty(0)
    if input_grad:
        first = LORA_FIRST and all(s is None and p is None for s, p in zip(scales, parts))
        dx = torch.mm(grad_h, A) if first else None  # the branches first, each base GEMM adding onto them
        for g, weight, scale, tr, part in zip(gs, weights, scales, transposed, parts):
            if part is not None:
                dx = _plus(dx, part)
            elif scale is None:
                dx = torch.mm(g, weight) if dx is None else dx.addmm_(g, weight)
            else:
                dx = _plus(dx, fp8_mm_dgrad(g, weight, scale, transposed=tr))
        if not first:
            dx.addmm_(grad_h, A)
        dx = dx.view(x.shape)
    grad_A = torch.mm(grad_h.t(), x2)
    # an op's outputs may not alias each other: the members' rows of one product are copied apart (r × in each)
    grad_As = [grad_A] if len(lora_A) == 1 else [t.clone() for t in grad_A.split([a.shape[0] for a in lora_A])]
    grad_B = [torch.mm(g.t(), hi * scaling) for g, hi, scaling in zip(gs, _split(h, lora_A), scalings)]
    return [dx, *grad_As, *grad_B]


def _plus(dx, t):
    return t.contiguous() if dx is None else dx.add_(t)


@_lora_linear_bwd_op.register_fake
def _(grads, x, h, weights, scales, transposed, lora_A, lora_B, scalings, input_grad):
    return [x.new_empty(x.shape if input_grad else (0,)), *(A.new_empty(A.shape) for A in lora_A),
            *(B.new_empty(B.shape) for B in lora_B)]


def _lora_linear_setup(ctx, inputs, output):
    x, weights, scales, biases, transposed, lora_A, lora_B, scalings = inputs
    ctx.save_for_backward(x, output[-1], *weights, *scales, *transposed, *lora_A, *lora_B)
    ctx.n, ctx.scalings = len(weights), scalings
    ctx.no_grads = [_no_grads(t) for t in (scales, biases, transposed)]


def _lora_linear_backward(ctx, grads):
    # h (the last output) is an output only to be saved: nothing outside reads it, so its gradient is zero
    x, h, *rest = ctx.saved_tensors
    n = ctx.n
    weights, scales, transposed, lora_A, lora_B = (list(rest[i * n:(i + 1) * n]) for i in range(5))
    out = torch.ops.moetune.lora_linear_bwd(grads[:n], x, h, weights, scales, transposed, lora_A, lora_B,
                                            ctx.scalings, ctx.needs_input_grad[0])
    dx = out[0] if ctx.needs_input_grad[0] else None
    no_scale, no_bias, no_transposed = ctx.no_grads
    return dx, [None] * n, no_scale, no_bias, no_transposed, out[1:n + 1], out[n + 1:], None


def _no_grads(optional_tensors: list):
    """No gradients for a list argument, in the structure torch.library wants back: a list of Nones for a list of
    tensors, one None for a list holding a None."""
    return [None] * len(optional_tensors) if all(isinstance(t, torch.Tensor) for t in optional_tensors) else None


_lora_linear_op.register_autograd(_lora_linear_backward, setup_context=_lora_linear_setup)
register_product(torch.ops.moetune.lora_linear.default)


def lora_linear(x, weight, bias, lora_A, lora_B, scaling: float, scale=None, transposed=None) -> torch.Tensor:
    """x·Wᵀ + b + scaling·(x·Aᵀ)·Bᵀ for a frozen W and b (no gradient) as one op each way, in x's dtype. An fp8 W
    gives its row `scale` (and its kept transposed copy, or None): the base product and input gradient then run on
    fp8 tensor cores (quant.matmul.fp8_mm_in_one_op says where)."""
    return torch.ops.moetune.lora_linear(x, [weight], [scale], [bias], [transposed], [lora_A], [lora_B], [scaling])[0]


# LoRA linears that read one input (GQA's q, k and v; MLA's q_a and kv_a; an MLP's gate and up) as one op each way
# where each would run as one alone (LoRALinear.of_one_input, the model's glm4_moe.linears_of_one_input hook): x read
# once for the members' A products and once for their gradients, x's gradient summed inside the backward (for q, k, v:
# 4 of their 12 thin GEMMs, 2 of their 3 in-place adds onto x's gradient and autograd's sum of the three gradients
# gone). One H200, same calls (BENCHMARKS.md, thirty-fifth session), against each its own op: an EP-8 rank of Air
# 9,208 -> 9,269 tokens/s alone, 9,322 and 9,259 (against 9,192) with LORA_FIRST; AIR-8 40,901 -> 41,449 with it;
# GLM-4.7-Flash 17,401 / 17,381.
JOINT_INPUTS = True


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
        if self.in_one_op(x):
            return lora_linear(x, *self._op_operands(x))
        A, B = self.lora_A.to(x.dtype), self.lora_B.to(x.dtype)
        y = frozen_linear(self, x)
        h = F.linear(self.dropout(x), A)
        if LORA_LINEAR == "sum":
            return y + F.linear(h, B) * self.scaling
        y2 = torch.addmm(y.reshape(-1, y.shape[-1]), h.reshape(-1, h.shape[-1]), B.t(), alpha=self.scaling)
        return y2.view(y.shape)

    def in_one_op(self, x) -> bool:
        """Whether this layer runs as one op each way on x (LORA_LINEAR "op" where it applies)."""
        if LORA_LINEAR != "op" or not isinstance(self.dropout, nn.Identity) or self.weight.requires_grad or any(
                map(is_dtensor, (self.weight, self.lora_A, self.lora_B))):
            return False
        if self.quant is not None:
            return fp8_mm_in_one_op(x, self.weight, self.quant)
        return x.dtype == self.weight.dtype

    @staticmethod
    def of_one_input(x, modules) -> list | None:
        """The modules applied to x as one op each way (glm4_moe.linears_of_one_input's hook), where JOINT_INPUTS says
        and each would run as one op alone; None elsewhere."""
        if not (JOINT_INPUTS and len(modules) > 1 and all(isinstance(m, LoRALinear) and m.in_one_op(x)
                                                           for m in modules)):
            return None
        weight, bias, A, B, scaling, scale, transposed = (list(column) for column in zip(*(m._op_operands(x)
                                                                                          for m in modules)))
        return torch.ops.moetune.lora_linear(x, weight, scale, bias, transposed, A, B, scaling)[:-1]

    def _op_operands(self, x) -> tuple:
        """lora_linear's arguments after x: (weight, bias, A, B, scaling, scale, transposed), A and B in x's dtype."""
        scale = None if self.quant is None else weight_scale(self)
        return (self.weight, self.bias, self.lora_A.to(x.dtype), self.lora_B.to(x.dtype), self.scaling, scale,
                transposed_copy(self, "weight"))

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
