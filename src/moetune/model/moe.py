"""Token permutation and grouped GEMM for stacked experts.

Tokens are sorted by expert once per MoE layer; every expert's rows are then contiguous and one grouped GEMM
(`torch._grouped_mm`, offsets from the cumulative token count) runs all experts at once — no Python loop over
experts, no host synchronisation. Expert LoRA runs on the same permuted tokens (x·Aᵀ then ·Bᵀ, each a grouped
GEMM), so W + BA is never built.

Expert parallelism (`AllToAllDispatcher`, injected into `Experts` by `parallel.apply_ep`): each rank holds E/ep
experts (DTensor Shard(0) over the ep group). Rows sorted by global expert are already grouped by destination
rank, so one all-to-all sends every row to the rank holding its expert and a second one brings the results back;
the exchange is pipelined in chunks so that communication runs under expert computation, forward and backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moetune.model.recompute import recompute as recompute_fn
from moetune.tensors import local_tensor

_grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous.

    grouped_mm's backward rejects expanded (stride-0) gradients, e.g. those of `y.sum()`; this guard costs
    nothing when the gradient is already contiguous.
    """

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """y[rows of expert e] = x[rows of expert e] @ weight[e].T, for weight [E, out, in] and int32 offsets [E]
    (under expert parallelism: this rank's experts, `offs` counting only the rows it received)."""
    weight = local_tensor(weight)
    if weight.dtype != x.dtype:
        weight = weight.to(x.dtype)
    return _ContiguousGrad.apply(_grouped_mm(x, weight.transpose(-2, -1), offs=offs))


@dataclass
class Permutation:
    """Where each (token, slot) pair went when tokens were sorted by expert."""

    token_idx: torch.Tensor  # [T*k] source token of each permuted row
    order: torch.Tensor  # [T*k] flat (token, slot) index of each permuted row
    inverse: torch.Tensor  # [T*k] permuted row of each flat (token, slot) index
    counts: torch.Tensor  # [E] rows per expert
    offs: torch.Tensor  # [E] int32 cumulative counts: the grouped GEMM's group ends


def permute(topk_idx: torch.Tensor, num_experts: int) -> Permutation:
    k = topk_idx.shape[-1]
    flat = topk_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    offs = counts.cumsum(0).to(torch.int32)
    return Permutation(order // k, order, inverse, counts, offs)


def unpermute(y_perm: torch.Tensor, perm: Permutation, num_tokens: int) -> torch.Tensor:
    """Sum of each token's k (already weighted) expert outputs, as a gather (deterministic, no atomics)."""
    y = y_perm[perm.inverse]
    return y.view(num_tokens, -1, y.shape[-1]).sum(dim=1)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def weighted_swiglu(h: torch.Tensor, row_weights: torch.Tensor) -> torch.Tensor:
    """swiglu(h) scaled by each row's routing weight in fp32, back in h's dtype. Compiled, Inductor fuses it and
    keeps only h; in eager mode (the expert-parallel exchange is a graph break) `_WeightedSwiGLU` does the same by
    hand instead of autograd keeping silu(gate), the product and its fp32 copy (2.5× the memory of h)."""
    if torch.compiler.is_compiling():
        return (swiglu(h).float() * row_weights.unsqueeze(-1)).to(h.dtype)
    return _WeightedSwiGLU.apply(h, row_weights)


class _WeightedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, row_weights):
        ctx.save_for_backward(h, row_weights)
        return (swiglu(h).float() * row_weights.unsqueeze(-1)).to(h.dtype)

    @staticmethod
    def backward(ctx, grad):
        # the same operations autograd would run on the recomputed silu(gate) and product
        h, row_weights = ctx.saved_tensors
        gate, up = h.chunk(2, dim=-1)
        silu = F.silu(gate)
        grad = grad.float()
        grad_weights = (silu * up).float().mul(grad).sum(-1) if ctx.needs_input_grad[1] else None
        grad_product = (grad * row_weights.unsqueeze(-1)).to(h.dtype)
        grad_gate = torch.ops.aten.silu_backward(grad_product * up, gate)
        return torch.cat([grad_gate, grad_product * silu], dim=-1), grad_weights


def experts_forward(x, offs, row_weights, gate_up_proj, down_proj, lora=None, lora_weights=None) -> torch.Tensor:
    """Run rows x [N, H] sorted by expert (group ends `offs`) through stacked experts (gate_up [E, 2I, H],
    down [E, H, I]); `lora` (an ExpertLoRA) adds its deltas, with `lora_weights` (gate_up A, B, down A, B) in
    place of its own parameters when given (the expert-parallel path passes this rank's local tensors).

    The routing weight of each row scales the SwiGLU output, before down_proj: the same product (down_proj
    is linear) on I = 1408 columns instead of H = 4096, and the combine that follows is a plain sum."""
    if lora is not None and lora_weights is None:
        lora_weights = (lora.gate_up_A, lora.gate_up_B, lora.down_A, lora.down_B)
    h = grouped_linear(x, gate_up_proj, offs)
    if lora is not None:
        h = h + lora.delta(x, lora_weights[0], lora_weights[1], offs)
    a = weighted_swiglu(h, row_weights)
    y = grouped_linear(a, down_proj, offs)
    if lora is not None:
        y = y + lora.delta(a, lora_weights[2], lora_weights[3], offs)
    return y


# ------------------------------------------------------------------------------------- expert parallelism
@dataclass
class _Chunk:
    """One pipeline chunk's exchange: which of this rank's rows go where, and what it receives."""

    perm: Permutation  # this chunk's tokens sorted by global expert (= grouped by destination rank)
    send_splits: list[int]  # rows sent to each rank
    recv_splits: list[int]  # rows received from each rank
    order: torch.Tensor  # received rows (source-major) -> expert-major, for the grouped GEMM
    unsort: torch.Tensor  # the inverse of `order`
    offs: torch.Tensor  # int32 group ends of this rank's experts over the received rows

    @property
    def n_send(self) -> int:
        return sum(self.send_splits)

    @property
    def n_recv(self) -> int:
        return sum(self.recv_splits)


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group, out=None):
    """Asynchronous all-to-all of rows (dim 0) into `out` (new if None); returns (output, work). With NCCL,
    `work.wait()` only orders the current stream after the transfer, so compute queued before it runs under it."""
    if out is None:
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    work = dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group, async_op=True)
    return out, work


def _release(t: torch.Tensor) -> None:
    """Free a tensor's memory while autograd keeps the tensor object (as a graph output or input) for its
    shape. On a GPU the caching allocator reuses the block only after the work queued on this stream, which
    includes every kernel reading it."""
    t.untyped_storage().resize_(0)


def _slices(total: torch.Tensor, starts: list[int]) -> list[torch.Tensor]:
    return [total[a:b] for a, b in zip(starts, starts[1:])]


class _ExchangeAndCompute(torch.autograd.Function):
    """Dispatch → expert compute → combine, pipelined over chunks, forward and backward.

    Forward: every chunk's dispatch is issued at once; chunk c's experts run while chunk c+1's rows are still in
    flight, and chunk c's results travel back while chunk c+1 computes. Backward mirrors it: the output
    gradients of every chunk are sent at once, chunk c's expert backward runs under chunk c+1's transfer, and
    the row gradients of chunk c travel back under chunk c+1's expert backward. The expert computation of each
    chunk is its own small autograd graph (built in forward, differentiated in backward with autograd.grad), so
    the order of communication and compute is ours, not the autograd engine's. Activation checkpointing
    (`recompute`) recomputes only the local expert work of trainable experts from the rows the exchange
    delivered, never the exchange itself. On H200 the transfers do not run beside the grouped GEMMs
    (BENCHMARKS.md), so the default is one chunk.
    """

    @staticmethod
    def forward(ctx, group, chunks, compute, recompute, grad, rows, row_weights, *weights):
        # grad: whether the caller records gradients (inside forward autograd is always off)
        starts = [0]
        for ch in chunks:
            starts.append(starts[-1] + ch.n_send)
        sent = [(_all_to_all(rows[a:b], ch.recv_splits, ch.send_splits, group),
                 _all_to_all(row_weights[a:b], ch.recv_splits, ch.send_splits, group))
                for ch, a, b in zip(chunks, starts, starts[1:])]
        back, graphs = [], []
        result = rows.new_empty((starts[-1], rows.shape[1]))  # expert outputs have the hidden width too
        trainable = any(t.requires_grad for t in weights)
        # Recomputing frozen experts would keep their input rows (64 KB per token and layer for Air) to save
        # their GEMM output (45 KB): worse than keeping the output. Only trainable experts, whose backward needs
        # the rows anyway, recompute.
        recompute = recompute if trainable else "none"
        for ch, ((r, w_r), (w, w_w)), part in zip(chunks, sent, _slices(result, starts)):
            w_r.wait()
            w_w.wait()
            with torch.enable_grad() if grad else torch.no_grad():
                r_in = r[ch.order].detach().requires_grad_(grad and rows.requires_grad)
                w_in = w[ch.order].detach().requires_grad_(grad and row_weights.requires_grad)
                local = [t.detach().requires_grad_(grad and t.requires_grad) for t in weights]
                y = recompute_fn(compute, recompute, r_in, ch.offs, w_in, *local)
            graphs.append((y, r_in, w_in, local))
            back.append(_all_to_all(y.detach()[ch.unsort], ch.send_splits, ch.recv_splits, group, out=part))
            if grad and recompute != "selective":  # selective recompute may keep a GEMM output y is a view of
                # Backward needs the graph, not these values: y is read by no derivative, and the received rows
                # only by the weight gradients of trainable experts. Freeing them keeps expert parallelism's
                # activation memory that of the single-GPU model (64 KB per token and layer each for Air).
                _release(y)
                if not trainable:
                    _release(r_in)
        for _, work in back:
            work.wait()
        ctx.group, ctx.chunks, ctx.starts, ctx.graphs = group, chunks, starts, graphs
        ctx.weights_need_grad = [t.requires_grad for t in weights]
        ctx.rows_shape, ctx.rows_need_grad = rows.shape, rows.requires_grad
        ctx.weights_dtype, ctx.row_weights_need_grad = row_weights.dtype, row_weights.requires_grad
        return result

    @staticmethod
    def backward(ctx, grad_out):
        group, chunks, starts = ctx.group, ctx.chunks, ctx.starts
        incoming = [_all_to_all(grad_out[a:b], ch.recv_splits, ch.send_splits, group)
                    for ch, a, b in zip(chunks, starts, starts[1:])]
        going, weight_grads = [], None
        grad_rows = grad_out.new_empty((starts[-1],) + ctx.rows_shape[1:]) if ctx.rows_need_grad else None
        grad_row_weights = grad_out.new_empty(starts[-1], dtype=ctx.weights_dtype) if ctx.row_weights_need_grad else None
        parts = zip(_slices(grad_rows, starts) if grad_rows is not None else [None] * len(chunks),
                    _slices(grad_row_weights, starts) if grad_row_weights is not None else [None] * len(chunks))
        for ch, (g, work), (y, r_in, w_in, local), (out_r, out_w) in zip(chunks, incoming, ctx.graphs, parts):
            work.wait()
            inputs = [t for t in (r_in, w_in, *local) if t.requires_grad]
            grads = list(torch.autograd.grad(y, inputs, g[ch.order], allow_unused=True)) if inputs else []
            g_rows = grads.pop(0) if r_in.requires_grad else None
            g_w = grads.pop(0) if w_in.requires_grad else None
            g_rows = torch.zeros_like(r_in) if g_rows is None and r_in.requires_grad else g_rows
            g_w = torch.zeros_like(w_in) if g_w is None and w_in.requires_grad else g_w
            if g_rows is not None:
                going.append(_all_to_all(g_rows[ch.unsort], ch.send_splits, ch.recv_splits, group, out=out_r)[1])
            if g_w is not None:
                going.append(_all_to_all(g_w[ch.unsort], ch.send_splits, ch.recv_splits, group, out=out_w)[1])
            if grads:
                grads = [torch.zeros_like(t) if gr is None else gr for gr, t in zip(grads, [t for t in local if t.requires_grad])]
                weight_grads = grads if weight_grads is None else [a + b for a, b in zip(weight_grads, grads)]
        ctx.graphs = None
        for work in going:
            work.wait()
        it = iter(weight_grads or [])
        grad_weights = [next(it) if need else None for need in ctx.weights_need_grad]
        return (None, None, None, None, None, grad_rows, grad_row_weights, *grad_weights)


class AllToAllDispatcher:
    """Expert parallelism, injected into `Experts` by `parallel.apply_ep`: this rank holds experts
    [rank·E/ep, (rank+1)·E/ep) of every MoE layer, and every (token, slot) row travels to the rank holding its
    expert and back (all-to-all over `group`).

    `chunks` > 1 splits each rank's tokens into that many pipeline chunks so that the exchange overlaps the
    expert computation (1: no overlap, the plain exchange). Every rank takes part in every collective whatever
    its tokens route to (split sizes may be 0), so uneven routing cannot desynchronise them. Split sizes must be
    host integers: one device→host copy per layer, taken while the GPU runs the shared expert (`side_work`).
    """

    def __init__(self, group, chunks: int = 1):
        self.group, self.chunks = group, max(1, int(chunks))
        self._copy_stream = None

    @torch.compiler.disable  # collectives with data-dependent sizes: a graph break, the layer's rest stays compiled
    def __call__(self, x, topk_idx, topk_weights, weights, compute, num_experts: int, side_work=None,
                 recompute: str = "none"):
        """x [T, H] this rank's tokens, topk_idx/topk_weights [T, k]; `weights` the local expert tensors
        `compute(rows, offs, row_weights, *weights)` takes. Returns (sum of each token's weighted expert
        outputs [T, H], global rows per expert [E], side_work's result)."""
        ep = self.group.size()
        T = topk_idx.shape[0]
        weights = [local_tensor(w) for w in weights]
        n_local = num_experts // ep
        bounds = [T * c // self.chunks for c in range(self.chunks + 1)]
        perms = [permute(topk_idx[a:b], num_experts) for a, b in zip(bounds, bounds[1:])]
        send_counts = torch.stack([p.counts for p in perms])  # [chunks, E]
        # what each rank receives: [source rank, chunk, local expert]
        recv_counts = torch.empty(ep, self.chunks, n_local, dtype=send_counts.dtype, device=send_counts.device)
        routed = torch.cuda.current_stream().record_event() if x.is_cuda else None
        work = dist.all_to_all_single(recv_counts, send_counts.view(self.chunks, ep, n_local).transpose(0, 1).contiguous(),
                                      group=self.group, async_op=True)
        side = side_work() if side_work is not None else None  # queued on the GPU while we wait for the counts
        k = topk_idx.shape[1]
        rows = x[torch.cat([p.token_idx + a for a, p in zip(bounds, perms)])]
        row_weights = topk_weights.reshape(-1)[torch.cat([p.order + a * k for a, p in zip(bounds, perms)])]
        host = self._to_host(lambda: torch.cat([send_counts.view(self.chunks, ep, n_local).sum(-1).flatten(),
                                                recv_counts.sum(-1).flatten()]), work, routed)
        work.wait()  # on a GPU: the compute stream reads recv_counts below (long since arrived)
        send_splits = torch.tensor(host[: self.chunks * ep]).view(self.chunks, ep).tolist()
        recv_splits = torch.tensor(host[self.chunks * ep:]).view(ep, self.chunks).t().tolist()
        chunks = []
        local_expert = torch.arange(n_local, device=x.device).repeat(ep)
        for c, p in enumerate(perms):
            per_source = recv_counts[:, c, :]  # [source, local expert]
            expert_of_row = local_expert.repeat_interleave(per_source.reshape(-1), output_size=sum(recv_splits[c]))
            order = torch.argsort(expert_of_row, stable=True)
            unsort = torch.empty_like(order)
            unsort[order] = torch.arange(order.numel(), device=order.device)
            offs = per_source.sum(0).cumsum(0).to(torch.int32)
            chunks.append(_Chunk(p, send_splits[c], recv_splits[c], order, unsort, offs))
        y = _ExchangeAndCompute.apply(self.group, chunks, compute, recompute, torch.is_grad_enabled(), rows, row_weights,
                                      *weights)
        # each chunk's rows sit after the previous chunks' in y: one gather brings every (token, slot) back
        starts = [0]
        for ch in chunks:
            starts.append(starts[-1] + ch.n_send)
        inverse = torch.cat([ch.perm.inverse + s for ch, s in zip(chunks, starts)])
        return y[inverse].view(T, k, y.shape[-1]).sum(dim=1), send_counts.sum(0), side

    def _to_host(self, make, work, routed) -> list[int]:
        """`make()` (the split sizes, computed once the counts exchange `work` is done) on the host. On a GPU this
        runs on a side stream that waits for the routing and the exchange only, so the compute stream keeps
        running what was queued after them (the shared expert) while the host waits."""
        if routed is None:
            work.wait()
            return make().tolist()
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream()
        with torch.cuda.stream(self._copy_stream):
            self._copy_stream.wait_event(routed)
            work.wait()
            return make().to("cpu").tolist()
