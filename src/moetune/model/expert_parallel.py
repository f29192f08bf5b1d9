"""Expert parallelism: the all-to-all dispatcher `parallel.apply_ep` injects into `Experts`.

Each rank holds experts [rank·E/ep, (rank+1)·E/ep) of every MoE layer (DTensor Shard(0) over the ep group). A token
travels once to every rank that holds at least one of its experts, with its routing (expert ids and weights), and
not once per (token, expert) pair: with GLM-4.5-Air's top-8 over 2 ranks that is 2 rows per token instead of 8, a
quarter of the bytes (over 8 ranks about 5.3 instead of 8). The receiving rank expands its rows to the (token,
expert) pairs it serves, runs the grouped GEMMs, and sums each token's weighted outputs before one row goes back;
the sending rank sums the rows that come back from each rank. Both sums are the adjoints of the expansions, so
each direction of the backward moves the same bytes as the forward.

One device→host copy per layer is left: NCCL's all-to-all takes its split sizes on the host, and exact (dropless)
routing has no static bound on them short of padding every rank's buffers to the worst case. Everything that does
not need those sizes — the send-side plan, the gather of the rows to send, their routing, the expert counts and the
shared expert — is queued before the copy, so the GPU works while the host waits, and after it the host only
launches the exchange and the expert GEMMs.

The exchange is a graph break (with train.cuda_graphs the compiled parts of the layer before and after it replay as
CUDA graphs: one EP-8 rank of Air through this dispatcher on one H100 7,983 tokens/s against 6,395, BENCHMARKS.md's
thirty-sixth session), so the work between its collectives runs eagerly: some seventy small kernels a layer
for the two plans, and on an fp8 base the activations' quantisations, each compiled on its own
(`quant.matmul.EAGER_QUANT`; op by op they had made one EP-8 rank of Air through the exchange 5,253 tokens/s against
9,836 locally, BENCHMARKS.md). Where the layers are compiled (train.compile), the rest of that work is compiled on
its own too (`AllToAllDispatcher.compiled`: the send plan with the layer's shapes, the receive plan and the local
expert computation with the received rows dynamic, the shared expert): the host launches a few generated kernels
instead of the ops one by one, which is what bounds the layer's forward between its device→host copy and the expert
GEMMs. One EP-8 rank of Air through this dispatcher with CUDA graphs, same call: 8,243 tokens/s against 7,628 on an
H200, 7,640 against 7,446 on an H100 (BENCHMARKS.md, thirty-seventh session); on an fp8 base without graphs 5–10%
ahead in three calls, on a bf16 base without them −3% to +3%.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moetune.model.kernels import compiled_for_eager
from moetune.model.experts import Bags, combine, count_values, expand, sort_by_key
from moetune.model.recompute import Rebuilt, recompute as recompute_fn
from moetune.tensors import local_tensor

# the backend the exchange's local work is compiled with where the layers are (`AllToAllDispatcher.compiled`)
BACKEND = "inductor"


def _maybe_compiled(fn, compiled: bool):
    return compiled_for_eager(fn, BACKEND) if compiled else fn


# Compiled, each is one graph for every layer's `fn` (a bound method or closure of the layer's module); two
# functions, so that the experts (rows dynamic) and the shared expert (the layer's shapes) keep their own caches.
def _local_experts(fn, rows, row_weights, order, bag, slots, offs, *weights):
    """fn's expert work on the received rows' (row, expert) pairs, each weighted by its slot's routing weight (the
    gather inside the compiled graph: one op fewer for the host to launch before the expert GEMMs)."""
    return fn(rows, bag, slots, offs, row_weights.reshape(-1)[order], *weights)


def _shared_expert(fn):
    return fn()


@dataclass
class _SendPlan:
    """Where a rank's rows go, in static shapes (no host sizes): the send buffer has ep·t rows for each chunk of t
    tokens, the rows for rank 0 first, then rank 1's, …, in token order; only the first n of them (n: the chunk's
    token→rank hits, known on the host after the counts exchange) are sent."""

    origin: Bags  # send-buffer row -> token (bag), token -> its rows, one slot per rank (slots [T, ep])
    routing: torch.Tensor  # [ep·T, 2k] fp32 per send-buffer row: its token's routing weights | expert ids local
    #                        to the destination rank (n_local: not there)
    counts: torch.Tensor  # [ep, chunks, 2] per destination rank and chunk: (rows, (token, expert) pairs)
    expert_counts: torch.Tensor  # [E] this rank's (token, expert) pairs per expert
    bounds: list[int]  # chunk c holds tokens bounds[c]:bounds[c+1] and send-buffer rows from ep·bounds[c]


def _plan_send(topk_idx: torch.Tensor, topk_weights: torch.Tensor, ep: int, n_local: int, chunks: int,
               compiled: bool = False) -> _SendPlan:
    T = topk_idx.shape[0]
    bounds = [T * c // chunks for c in range(chunks + 1)]
    plan = _maybe_compiled(_send_plan_tensors, compiled)
    bag, slots, routing, counts, expert_counts = plan(topk_idx, topk_weights.detach(), ep, n_local, bounds)
    return _SendPlan(Bags(bag, slots), routing, counts, expert_counts, bounds)


def _send_plan_tensors(topk_idx, topk_weights, ep: int, n_local: int, bounds: list[int]):
    bags, slots, routing, counts = [], [], [], []
    for a, b in zip(bounds, bounds[1:]):
        t = b - a
        dest = topk_idx[a:b] // n_local
        hits = torch.zeros(t, ep, dtype=torch.bool, device=topk_idx.device).scatter_(1, dest, True)
        flat = hits.t().reshape(-1)  # (rank, token), rank-major: the send buffer's order
        order = torch.argsort((~flat).to(torch.uint8), stable=True)  # the hits first, in that order
        token = order % max(t, 1)
        bags.append(token + a)
        position = torch.cumsum(flat, 0) - 1 + ep * a
        slots.append(torch.where(flat, position, -1).view(ep, t).t())
        local = topk_idx[a:b][token] - (order // max(t, 1) * n_local).unsqueeze(1)
        local = torch.where((local >= 0) & (local < n_local), local, n_local)
        routing.append(torch.cat([topk_weights[a:b][token].float(), local.float()], 1))
        counts.append(torch.stack([hits.sum(0), count_values(dest, ep)], -1))
    return (torch.cat(bags), torch.cat(slots), torch.cat(routing), torch.stack(counts, 1),
            count_values(topk_idx, ep * n_local))


@dataclass
class _Chunk:
    """One pipeline chunk's exchange (sizes on the host; the receiving side's plan is built once its routing has
    arrived, inside the exchange)."""

    start: int  # first row of this chunk in the send buffer
    send_splits: list[int]  # rows sent to each rank
    recv_splits: list[int]  # rows received from each rank
    recv_pairs: int  # (token, local expert) pairs those rows carry
    routing: torch.Tensor | None = None  # the received [weights | local expert ids] per row (fp32), once arrived
    routing_work: object = None
    back_work: object = None  # the results' way back

    @property
    def n_send(self) -> int:
        return sum(self.send_splits)


@dataclass
class _Received:
    """What a rank does with the rows it received: expand each to its local pairs, sorted by local expert."""

    pairs: Bags  # pair -> received row
    order: torch.Tensor  # [P] flat (row, slot) of each pair, sorted by local expert
    offs: torch.Tensor  # [E_local] int32 group ends over the pairs
    weights: torch.Tensor  # [R, k] routing weights of the received rows


def _plan_received(routing: torch.Tensor, k: int, n_local: int, n_pairs: int, weights_dtype,
                   compiled: bool = False) -> _Received:
    plan = _maybe_compiled(_receive_plan_tensors, compiled)
    order, bag, offs, slots, weights = plan(routing, k, n_local, weights_dtype)
    # the local pairs (the host knows their number from the counts exchange)
    return _Received(Bags(bag=bag[:n_pairs], slots=slots), order[:n_pairs], offs, weights)


def _receive_plan_tensors(routing: torch.Tensor, k: int, n_local: int, weights_dtype):
    """(every (row, slot) sorted by local expert, the slots of other ranks' experts last; its row; group ends; each
    row's slots' pair or −1; the rows' weights). Shapes follow the rows only, not the number of local pairs, so that
    one graph with the rows dynamic serves every layer and step."""
    weights, key = routing[:, :k].to(weights_dtype), routing[:, k:].long().flatten()  # key n_local: not here
    order = sort_by_key(key, n_local + 1)
    offs = count_values(key, n_local + 1)[:n_local].cumsum(0)
    position = torch.empty_like(order)
    position[order] = torch.arange(order.numel(), device=key.device)
    slots = torch.where(position < offs[-1], position, -1)
    return order, order // k, offs.to(torch.int32), slots.view(-1, k), weights


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


class _ExchangeAndCompute(torch.autograd.Function):
    """Dispatch → expert compute → combine, pipelined over chunks, forward and backward.

    Forward: every chunk's dispatch is issued at once; chunk c's experts run while chunk c+1's rows are still in
    flight, and chunk c's results travel back while chunk c+1 computes. Backward mirrors it. The expert computation
    of each chunk is its own small autograd graph (built in forward, differentiated in backward with autograd.grad),
    so the order of communication and compute is ours, not the autograd engine's. Activation checkpointing
    (`recompute`) recomputes only the local expert work of trainable experts from the rows the exchange delivered,
    never the exchange itself. `row_weights` are the routing weights of the sent rows: their values travel with the
    routing (`_Chunk.routing`), their gradients come back here.
    """

    @staticmethod
    def forward(ctx, group, chunks, plan, compute, recompute, grad, compiled, rows, row_weights, *weights):
        # grad: whether the caller records gradients (inside forward autograd is always off); compiled: the local
        # expert work compiled on its own (AllToAllDispatcher.compiled)
        sent = [_all_to_all(rows[ch.start:ch.start + ch.n_send], ch.recv_splits, ch.send_splits, group)
                for ch in chunks]
        result = rows.new_empty(rows.shape)  # one row back per row sent
        trainable = any(t.requires_grad for t in weights)
        # Recomputing frozen experts would keep their received rows to save outputs backward never reads.
        recompute = recompute if trainable else "none"
        graphs = []
        for ch, (r, work) in zip(chunks, sent):
            ch.routing_work.wait()
            rec = plan(ch)
            ch.routing = ch.routing_work = None  # ctx keeps the chunks (their sizes) until backward
            work.wait()
            # Without recompute, trainable experts' weight gradients read the expanded pairs (k/ep rows per received
            # row) and the SwiGLU output: saved as a gather of the received rows and a recompute from gate_up's
            # output instead (Rebuilt, experts.routed_experts), they cost the received rows only.
            rebuilt = Rebuilt() if grad and recompute == "none" and trainable else None
            with torch.enable_grad() if grad else torch.no_grad(), rebuilt or contextlib.nullcontext():
                r_in = r.detach().requires_grad_(grad and rows.requires_grad)
                w_in = rec.weights.detach().requires_grad_(grad and row_weights.requires_grad)
                local = [t.detach().requires_grad_(grad and t.requires_grad) for t in weights]

                # Compiled unless Rebuilt saves its tensors (eager autograd's hooks) or selective
                # recompute tags its ops as they dispatch (an eager dispatch mode): both must see the ops one by one.
                if rebuilt is not None or recompute == "selective":
                    local_compute = functools.partial(_local_experts, functools.partial(compute, rebuilt=rebuilt))
                else:
                    local_compute = functools.partial(_maybe_compiled(_local_experts, compiled), compute)

                def run(r_rows, w_rows, *local_weights, rec=rec, local_compute=local_compute):
                    return local_compute(r_rows, w_rows, rec.order, rec.pairs.bag, rec.pairs.slots, rec.offs,
                                         *local_weights)

                y = recompute_fn(run, recompute, r_in, w_in, *local)
            graphs.append((y, r_in, w_in, local))
            back = _all_to_all(y.detach(), ch.send_splits, ch.recv_splits, group,
                               out=result[ch.start:ch.start + ch.n_send])
            ch.back_work = back[1]
            if grad and recompute == "none" and rebuilt is None:
                # Frozen experts: backward never reads the received rows (the GEMMs keep what they need).
                _release(r_in)
        for ch, (y, *_) in zip(chunks, graphs):
            ch.back_work.wait()
            # A work object holds its output, here a view of `result`, whose grad_fn is this node: kept in ctx it
            # would close a reference cycle through C++ that Python's collector cannot see, and every step's buffers
            # would stay allocated.
            ch.back_work = None
            if grad:  # read by no derivative; freed once sent (gloo reads it from another thread until then)
                _release(y)
        ctx.group, ctx.chunks, ctx.graphs = group, chunks, graphs
        ctx.weights_need_grad = [t.requires_grad for t in weights]
        ctx.rows_shape, ctx.rows_need_grad = rows.shape, rows.requires_grad
        ctx.row_weights_shape, ctx.row_weights_dtype = row_weights.shape, row_weights.dtype
        ctx.row_weights_need_grad = row_weights.requires_grad
        return result

    @staticmethod
    def backward(ctx, grad_out):
        group, chunks = ctx.group, ctx.chunks
        incoming = [_all_to_all(grad_out[ch.start:ch.start + ch.n_send], ch.recv_splits, ch.send_splits, group)
                    for ch in chunks]
        grad_rows = grad_out.new_empty(ctx.rows_shape) if ctx.rows_need_grad else None
        # Rows of the send buffer that were not sent get no gradient: the row weights' gather adds every row's
        # gradient to its token, so theirs must be zero (the rows' own expansion reads only the rows sent).
        grad_row_weights = (grad_out.new_zeros(ctx.row_weights_shape, dtype=ctx.row_weights_dtype)
                            if ctx.row_weights_need_grad else None)
        going, weight_grads = [], None
        for ch, (g, work), (y, r_in, w_in, local) in zip(chunks, incoming, ctx.graphs):
            work.wait()
            inputs = [t for t in (r_in, w_in, *local) if t.requires_grad]
            grads = list(torch.autograd.grad(y, inputs, g, allow_unused=True)) if inputs else []
            g_rows = grads.pop(0) if r_in.requires_grad else None
            g_w = grads.pop(0) if w_in.requires_grad else None
            if r_in.requires_grad:
                g_rows = torch.zeros_like(r_in) if g_rows is None else g_rows
                going.append(_all_to_all(g_rows, ch.send_splits, ch.recv_splits, group,
                                         out=grad_rows[ch.start:ch.start + ch.n_send])[1])
            if w_in.requires_grad:
                g_w = torch.zeros_like(w_in) if g_w is None else g_w
                going.append(_all_to_all(g_w, ch.send_splits, ch.recv_splits, group,
                                         out=grad_row_weights[ch.start:ch.start + ch.n_send])[1])
            if grads:
                grads = [torch.zeros_like(t) if gr is None else gr
                         for gr, t in zip(grads, [t for t in local if t.requires_grad])]
                weight_grads = grads if weight_grads is None else [a + b for a, b in zip(weight_grads, grads)]
        ctx.graphs = None
        for work in going:
            work.wait()
        it = iter(weight_grads or [])
        grad_weights = [next(it) if need else None for need in ctx.weights_need_grad]
        return (None, None, None, None, None, None, None, grad_rows, grad_row_weights, *grad_weights)


class AllToAllDispatcher:
    """Expert parallelism for one MoE layer's `Experts` (see the module docstring).

    `chunks` > 1 splits each rank's tokens into that many pipeline chunks so that the exchange may overlap the
    expert computation (1: the plain exchange; on H200 the transfers do not run beside the grouped GEMMs,
    BENCHMARKS.md). Every rank takes part in every collective whatever its tokens route to (split sizes may be 0),
    so uneven routing cannot desynchronise them. Split sizes must be host integers: one device→host copy per layer,
    taken while the GPU gathers the rows to send and runs the shared expert (`side_work`). `compiled`: the work
    between the collectives compiled on its own (the module docstring), as `parallel.apply_ep` sets it where the
    layers are compiled.
    """

    def __init__(self, group, chunks: int = 1, compiled: bool = False):
        self.group, self.chunks, self.compiled = group, max(1, int(chunks)), compiled
        self._copy_stream = None

    @torch.compiler.disable  # collectives with data-dependent sizes: a graph break, the layer's rest stays compiled
    def __call__(self, x, topk_idx, topk_weights, weights, compute, num_experts: int, side_work=None,
                 recompute: str = "none"):
        """x [T, H] this rank's tokens, topk_idx/topk_weights [T, k]; `weights` the local expert tensors
        `compute(rows, bag, slots, offs, row_weights, *weights)` takes: the received rows, expanded to their (row,
        local expert) pairs by experts.Bags(bag, slots), through the experts and each row's pairs summed. Returns
        (sum of each token's weighted expert outputs [T, H], global rows per expert [E], side_work's result)."""
        ep = self.group.size()
        k = topk_idx.shape[1]
        weights = [local_tensor(w) for w in weights]
        n_local = num_experts // ep
        send = _plan_send(topk_idx, topk_weights, ep, n_local, self.chunks, self.compiled)
        recv_counts = torch.empty_like(send.counts)  # [source rank, chunk, (rows, pairs)]
        routed = torch.cuda.current_stream().record_event() if x.is_cuda else None
        work = dist.all_to_all_single(recv_counts, send.counts, group=self.group, async_op=True)
        # Queued on the GPU before the host waits for the split sizes: the rows and routing to send, and the
        # shared expert.
        rows = expand(x, send.origin)
        row_weights = topk_weights[send.origin.bag]
        side = _maybe_compiled(_shared_expert, self.compiled)(side_work) if side_work is not None else None
        host = self._to_host(lambda: torch.cat([send.counts[..., 0].flatten(), recv_counts.flatten()]), work, routed)
        # [rank, chunk] rows sent, then [rank, chunk, (rows, pairs)] received, read as Python ints: between the
        # device→host copy and the expert GEMMs the GPU waits for the host, which CPU tensor ops here would lengthen
        n = ep * self.chunks
        sent_rows, received = host[:n], host[n:]

        chunks = []
        for c, a in enumerate(send.bounds[:-1]):
            at = range(c, n, self.chunks)  # (rank, chunk c) for every rank
            ch = _Chunk(ep * a, [sent_rows[i] for i in at], [received[2 * i] for i in at],
                        sum(received[2 * i + 1] for i in at))
            ch.routing, ch.routing_work = _all_to_all(send.routing[ch.start:ch.start + ch.n_send], ch.recv_splits,
                                                      ch.send_splits, self.group)
            chunks.append(ch)

        def plan(ch):
            return _plan_received(ch.routing, k, n_local, ch.recv_pairs, topk_weights.dtype, self.compiled)

        y = _ExchangeAndCompute.apply(self.group, chunks, plan, compute, recompute, torch.is_grad_enabled(),
                                      self.compiled, rows, row_weights, *weights)
        return combine(y, send.origin), send.expert_counts, side

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
