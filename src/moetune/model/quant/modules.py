"""A frozen base in FP8: which modules hold fp8 weights, and turning a (meta) model's frozen linears and expert stacks
into fp8 ones.

Names follow the checkpoints: a quantised linear keeps `weight` (fp8) and adds `weight_scale` (row-wise) or
`weight_scale_inv` (block); a quantised expert stack keeps `gate_up_proj` / `down_proj` (fp8) and adds
`gate_up_proj_scale[_inv]` / `down_proj_scale[_inv]`, the hub's per-expert scales stacked as the weights are (gate_up's
block scales keep gate's and up's grids apart: fp8.py, `stacked_parts`). The
fp8 tensors are parameters that never train (requires_grad False), so expert parallelism shards them with their
scales. The router, norms, embeddings, lm_head and DSA's indexer stay in the compute dtype, as the FP8 releases keep
them.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from moetune.model.grouped_gemm_tma import k_major_copy
from moetune.model.quant.fp8 import FP8, Fp8Scheme
from moetune.model.quant.matmul import fp8_linear
from moetune.names import ATTENTION_TARGETS, MLA_ATTENTION_TARGETS
from moetune.tensors import local_tensor


class FrozenFp8(NamedTuple):
    """An fp8 weight with its scales, as the grouped GEMM takes it (tensors may be this rank's local shards), and its
    transposed copy when the run keeps one (`keep_transposed_copies`)."""

    q: torch.Tensor
    scale: torch.Tensor
    scheme: Fp8Scheme
    transposed: torch.Tensor | None = None


def _frozen(t: torch.Tensor, scale: bool = False) -> nn.Parameter:
    p = nn.Parameter(t, requires_grad=False)
    if scale:
        p.fp8_scale = True  # its bytes are its own whatever the compute dtype (the memory estimate counts them so)
    return p


class Fp8Linear(nn.Module):
    """A frozen linear layer stored in fp8 (no gradient for its weight; its input gets one)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, scheme: Fp8Scheme, device=None,
                 bias_dtype=None):
        super().__init__()
        self.in_features, self.out_features, self.quant = in_features, out_features, scheme
        self.weight = _frozen(torch.empty(out_features, in_features, dtype=FP8, device=device))
        setattr(self, scheme.scale_suffix, _frozen(torch.empty(scheme.scale_shape((out_features, in_features)),
                                                               dtype=torch.float32, device=device), scale=True))
        self.bias = _frozen(torch.empty(out_features, device=device, dtype=bias_dtype)) if bias else None

    @property
    def scale(self) -> torch.Tensor:
        return weight_scale(self)

    def forward(self, x):
        return frozen_linear(self, x)

    def extra_repr(self):
        return f"in={self.in_features}, out={self.out_features}, {self.quant.name}"


def weight_scale(module: nn.Module) -> torch.Tensor:
    """The scales of a (possibly LoRA-wrapped) linear's fp8 weight, under the checkpoint's name."""
    return getattr(module, module.quant.scale_suffix)


def frozen_linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The base product of a (possibly LoRA-wrapped) linear: fp8 when the module holds an fp8 weight."""
    quant = getattr(module, "quant", None)
    if quant is None:
        return F.linear(x, module.weight, module.bias)
    return fp8_linear(x, module.weight, weight_scale(module), quant, module.bias,
                      transposed_copy(module, "weight"))


def expert_weight(experts: nn.Module, name: str):
    """`gate_up_proj` or `down_proj` of an Experts module as the grouped GEMM takes it."""
    w = getattr(experts, name)
    quant = getattr(experts, "quant", None)
    if quant is None:
        return w
    return FrozenFp8(w, getattr(experts, scale_name(name, quant)), quant, transposed_copy(experts, name))


# --------------------------------------------------------------------------------------------- transposed copies
# Hopper's fp8 GEMMs take both operands K-major, so the input gradient through a frozen fp8 weight [.., out, in] reads
# it as [.., in, out]: a transposed copy, made in every backward (model/quant/matmul.py), or kept for the run when the
# layout has memory for it (Layout.fp8_copies: the fp8 weights' bytes a second time). Kept copies are plain
# attributes, not parameters or buffers: nothing that saves, exports or streams the model sees them, and they never
# go stale because the weights they copy never train.
TRANSPOSED = "_transposed"


def transposed_copy(module: nn.Module, weight_name: str) -> torch.Tensor | None:
    """The kept transposed copy of `module.<weight_name>` (None: the input gradient makes its own)."""
    return module.__dict__.get(weight_name + TRANSPOSED)


@torch.no_grad()
def keep_transposed_copies(model) -> int:
    """Give every row-scaled fp8 weight of `model` (as this rank computes with it: an expert-parallel rank's own
    experts) a kept transposed copy for its input gradient; returns the bytes they take. Not for weights FSDP
    shards (a rank would copy its shard, not the weight it computes with): Layout.fp8_copies is never set there."""
    total = 0
    for qname, scheme in fp8_weights(model):
        if scheme.block is not None:  # block-scaled weights are dequantised just in time
            continue
        owner, _, name = qname.rpartition(".")
        mod = model.get_submodule(owner)
        copy = k_major_copy(local_tensor(getattr(mod, name)).contiguous())
        mod.__dict__[name + TRANSPOSED] = copy
        total += copy.numel() * copy.element_size()
    return total


def drop_transposed_copies(model) -> None:
    for mod in model.modules():
        for key in [k for k in mod.__dict__ if k.endswith(TRANSPOSED)]:
            del mod.__dict__[key]


def stacked_parts(weight_name: str) -> int:
    """How many weights the rows of `weight_name` fuse, each quantised on its own grid: an expert stack's gate_up_proj
    holds the hub's gate and up (2), anything else itself (1)."""
    return 2 if weight_name.endswith("gate_up_proj") else 1


def scale_name(weight_name: str, scheme: Fp8Scheme) -> str:
    """The scale of `weight_name`: `X.weight` -> `X.weight_scale[_inv]`, a stack `gate_up_proj` -> `gate_up_proj_scale[_inv]`."""
    suffix = scheme.scale_suffix
    if weight_name == "weight" or weight_name.endswith(".weight"):
        return weight_name[: -len("weight")] + suffix
    return weight_name + suffix[len("weight"):]


def quantizable_linears(model) -> list[tuple[nn.Module, str, str]]:
    """(parent, attribute, qualified name) of every frozen linear an FP8 base stores in fp8: attention projections,
    the dense MLPs and the shared experts."""
    out = []
    for i, layer in enumerate(model.model.layers):
        for name in ATTENTION_TARGETS + MLA_ATTENTION_TARGETS:
            mod = getattr(layer.self_attn, name, None)
            if isinstance(mod, nn.Linear):
                out.append((layer.self_attn, name, f"model.layers.{i}.self_attn.{name}"))
        # a MoE layer's dense part is its shared expert; a dense layer's MLP is the layer's own (the model file is
        # not imported here: it imports this module)
        mlp = layer.mlp
        moe = hasattr(mlp, "shared_experts")
        dense = mlp.shared_experts if moe else mlp
        prefix = f"model.layers.{i}.mlp" + (".shared_experts" if moe else "")
        for name in ("gate_proj", "up_proj", "down_proj"):
            if isinstance(getattr(dense, name, None), nn.Linear):
                out.append((dense, name, f"{prefix}.{name}"))
    return out


def quantize_model(model, scheme: Fp8Scheme, keep: Callable[[str], bool] = lambda name: True) -> int:
    """Replace the frozen linears and expert stacks of a model (on meta, before LoRA) by fp8 ones with empty
    storage; `keep(qualified module name)` False leaves a module in the compute dtype (a checkpoint's ignore list).
    Returns the number of modules converted."""
    n = 0
    for parent, attr, qname in quantizable_linears(model):
        lin = getattr(parent, attr)
        if not keep(qname):
            continue
        setattr(parent, attr, Fp8Linear(lin.in_features, lin.out_features, lin.bias is not None, scheme,
                                        device=lin.weight.device, bias_dtype=lin.weight.dtype))
        n += 1
    for i, layer in enumerate(model.model.layers):
        experts = getattr(layer.mlp, "experts", None)
        if experts is None or not keep(f"model.layers.{i}.mlp.experts"):
            continue
        for name in ("gate_up_proj", "down_proj"):
            w = getattr(experts, name)
            setattr(experts, name, _frozen(torch.empty(w.shape, dtype=FP8, device=w.device)))
            setattr(experts, scale_name(name, scheme),
                    _frozen(torch.empty(scheme.scale_shape(w.shape, stacked_parts(name)), dtype=torch.float32,
                                        device=w.device), scale=True))
        experts.quant = scheme
        n += 1
    return n


def _quantized_names(mod: nn.Module) -> tuple[str, ...]:
    """The fp8 weights' attribute names of a quantised module: a linear's weight, or an expert layer's two stacks."""
    return ("weight",) if hasattr(mod, "in_features") else ("gate_up_proj", "down_proj")


def fp8_weights(model) -> list[tuple[str, Fp8Scheme]]:
    """(qualified name of the fp8 weight, its scheme) for every fp8 tensor of a model."""
    out = []
    for mname, mod in model.named_modules():
        quant = getattr(mod, "quant", None)
        if quant is not None:
            out += [(f"{mname}.{n}", quant) for n in _quantized_names(mod)]
    return out


def fp8_parameters(model) -> dict[str, tuple[nn.Parameter, Fp8Scheme]]:
    """{qualified name of each fp8 weight: (its scale parameter, its scheme)}: what casting, initialising and loading
    treat together (a scale is always made or read with its weight)."""
    params = dict(model.named_parameters())
    return {name: (params[scale_name(name, q)], q) for name, q in fp8_weights(model)}


@torch.no_grad()
def dequantize_model(model, dtype=torch.float32):
    """Turn every fp8 weight back into a plain `dtype` one (q · scale), in place: a model whose weights can be
    merged into, compared or sent like an unquantised one."""
    drop_transposed_copies(model)
    for mname, mod in list(model.named_modules()):
        quant = getattr(mod, "quant", None)
        if quant is None:
            continue
        for n in _quantized_names(mod):
            scale = scale_name(n, quant)
            w = quant.dequantize(getattr(mod, n), getattr(mod, scale), dtype)
            delattr(mod, scale)
            setattr(mod, n, _frozen(w))
        mod.quant = None
        if isinstance(mod, Fp8Linear):
            parent, _, attr = mname.rpartition(".")
            lin = nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None, device="meta")
            lin.weight, lin.bias = mod.weight, mod.bias
            setattr(model.get_submodule(parent), attr, lin)
    return model
