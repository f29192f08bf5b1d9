"""The Triton grouped GEMM for frozen expert stacks (model/grouped_gemm.py) against its torch reference, on the CPU
under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without a GPU), with the interpreter's small
tiles: forward and input gradient, bf16 and fp8 row-wise weights, empty experts, groups that are no multiple of the
tile, no rows at all; the custom op's autograd and torch.compile."""

import pytest
import torch

from moetune.model import grouped_gemm as gg
from moetune.model import grouped_gemm_tiles as tiles
from moetune.model import grouped_gemm_tma as tma
from moetune.model import grouped_lora_kernels as lora_kernels
from moetune.model.grouped_gemm import grouped_gemm, grouped_mm_frozen, grouped_mm_reference
from moetune.model.quant.fp8 import quantize_rows

pytestmark = pytest.mark.skipif(gg.triton is None, reason="needs Triton (its interpreter on the CPU)")

E, OUT, IN = 6, 40, 24
# experts 0 and 5 empty, 3 with one row, none a multiple of the 16-row tile; 3 padding rows past the last end
COUNTS = [0, 7, 33, 1, 17, 0]
BACKEND = "aot_eager"


def _case(fp8: bool, pad: int = 3, seed: int = 0):
    torch.manual_seed(seed)
    offs = torch.tensor(COUNTS).cumsum(0).to(torch.int32)
    rows = sum(COUNTS) + pad
    w = torch.randn(E, OUT, IN) / IN ** 0.5
    if fp8:
        w8, scale = quantize_rows(w)  # scale [E, OUT, 1], as FrozenFp8 stores it
        return rows, offs, w8, scale
    return rows, offs, w.bfloat16(), None


def _close(got, want):
    # a bf16 ulp or two: Triton 3.9's interpreter rounds fp32 -> bf16 toward zero (a GPU rounds to nearest even)
    assert torch.isfinite(got).all()
    want = want.float()
    atol = 2e-2 * want.abs().max().item() if want.numel() else 0.0
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=atol)


@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("transpose", [True, False], ids=["forward", "dgrad"])
def test_kernel_matches_reference(transpose, fp8, swap):
    rows, offs, w, scale = _case(fp8)
    x = torch.randn(rows, IN if transpose else OUT).bfloat16()
    config = dict(tiles._INTERPRETER_CONFIG, SWAP=swap)
    y = grouped_gemm(x, w, offs, scale, transpose=transpose, config=config)
    want = grouped_mm_reference(x, w, offs, scale, transpose=transpose)
    assert y.shape == want.shape == (rows, OUT if transpose else IN) and y.dtype == torch.bfloat16
    _close(y, want)
    assert (y[sum(COUNTS):] == 0).all()  # padding rows: zeros


def test_kernel_reads_strided_inputs_and_scales_of_two_dims():
    """An expanded (stride-0) incoming gradient, as `y.sum()` gives, and scales [E, out] instead of [E, out, 1]."""
    rows, offs, w8, scale = _case(fp8=True, pad=0)
    g = torch.randn(1, OUT).bfloat16().expand(rows, OUT)
    y = grouped_gemm(g, w8, offs, scale.squeeze(-1), transpose=False)
    _close(y, grouped_mm_reference(g.contiguous(), w8, offs, scale, transpose=False))


@pytest.mark.parametrize("counts", [[0, 0, 0], [0, 0, 5]], ids=["no_rows", "only_last"])
def test_no_rows_and_a_single_nonempty_expert(counts):
    """On the GPU where there is one (the kernel itself), else under the interpreter."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    offs = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
    w = torch.randn(3, 20, 12, device=device).bfloat16()
    x = torch.randn(sum(counts), 12, device=device).bfloat16()
    y = grouped_gemm(x, w, offs)
    assert y.shape == (sum(counts), 20)
    _close(y, grouped_mm_reference(x, w, offs))
    dx = grouped_gemm(y, w, offs, transpose=False)
    assert dx.shape == x.shape
    _close(dx, grouped_mm_reference(y, w, offs, transpose=False))


@pytest.mark.parametrize("fp8", [False, True])
def test_autograd_gives_the_input_gradient_of_the_reference(fp8, monkeypatch):
    monkeypatch.setattr(tiles, "KERNEL_ON_CPU", True)
    rows, offs, w, scale = _case(fp8, seed=1)
    x = torch.randn(rows, IN).bfloat16().requires_grad_()
    y = grouped_mm_frozen(x, w, offs, scale)
    g = torch.randn_like(y)
    (y.float() * g.float()).sum().backward()
    x_ref = x.detach().float().requires_grad_()
    w_ref = w.float() if scale is None else w.float() * scale
    y_ref = grouped_mm_reference(x_ref, w_ref, offs)  # fp32 throughout, autograd through the reference
    (y_ref * g.float()).sum().backward()
    _close(y, y_ref)
    _close(x.grad, x_ref.grad)


def test_frozen_weight_only():
    rows, offs, w, _ = _case(False)
    with pytest.raises(AssertionError, match="frozen"):
        grouped_mm_frozen(torch.randn(rows, IN).bfloat16(), w.requires_grad_(), offs)


def test_custom_op_registration():
    """Schema, fake (meta) implementation and autograd registration as torch.library checks them (the CPU path; an
    fp32 weight with scales: opcheck's schema test does arithmetic that fp8 tensors lack on the CPU)."""
    rows, offs, w8, scale = _case(fp8=True)
    w = w8.float()
    x = torch.randn(rows, IN, requires_grad=True)
    for s in (scale, None):
        torch.library.opcheck(torch.ops.moetune.grouped_mm_frozen.default, (x, w, offs, s))
        torch.library.opcheck(torch.ops.moetune.grouped_mm_frozen_dgrad.default, (torch.randn(rows, OUT), w, offs, s))


def test_compiles_without_graph_break():
    """The custom op is opaque to Dynamo and AOT autograd: one graph (fullgraph), forward and backward match eager.
    ("aot_eager" traces forward and backward as Inductor does, without its code generation: ~13 s on the CPU.)"""
    rows, offs, w, _ = _case(False, seed=2)
    w = w.float()
    x = torch.randn(rows, IN)
    g = torch.randn(rows, OUT)

    def f(x):
        return (torch.relu(grouped_mm_frozen(x * 2.0, w, offs)) * g).sum()

    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, dynamic=False, backend=BACKEND)(x1)
    want = f(x2)
    got.backward()
    want.backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(x1.grad, x2.grad)


@pytest.mark.parametrize("pad", [0, 3])
def test_w8a8_forward_matches_the_scaled_reference(pad):
    """fp8 activations (row scales) × fp8 weights (row scales), the forward of the fp8 base's expert stacks: the
    kernel equals the reference that dequantises both operands (products of two e4m3 values are exact in fp32)."""
    rows, offs, w8, scale = _case(fp8=True, pad=pad, seed=3)
    x8, sx = quantize_rows(torch.randn(rows, IN))
    y = grouped_gemm(x8, w8, offs, scale, transpose=True, config=tiles._INTERPRETER_CONFIG, x_scale=sx)
    want = grouped_mm_reference(x8.float() * sx, w8, offs, scale)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, OUT)
    _close(y, want)
    assert (y[sum(COUNTS):] == 0).all()
    op = torch.ops.moetune.grouped_mm_fp8(x8, sx, w8, offs, scale)  # the custom op's CPU path: the reference
    _close(op, want)


@pytest.mark.parametrize("swap,prefetch", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("pad", [0, 3])
def test_w8a8_input_gradient_matches_the_scaled_reference(pad, swap, prefetch):
    """fp8 gradient rows (the weight's scales folded in, row scales) × the fp8 stack read as stored: the input
    gradient of the fp8 base's expert stacks without a transposed copy; the weight tile is the MMA's first operand
    with SWAP; PREFETCH loads the next weight tile ahead."""
    rows, offs, w8, _ = _case(fp8=True, pad=pad, seed=5)
    g8, sg = quantize_rows(torch.randn(rows, OUT))
    config = dict(tiles._INTERPRETER_CONFIG, SWAP=swap, PREFETCH=prefetch)
    dx = grouped_gemm(g8, w8, offs, None, transpose=False, config=config, x_scale=sg)
    want = grouped_mm_reference(g8.float() * sg, w8, offs, None, transpose=False)
    assert dx.dtype == torch.bfloat16 and dx.shape == (rows, IN)
    _close(dx, want)
    assert (dx[sum(COUNTS):] == 0).all()
    _close(torch.ops.moetune.grouped_mm_fp8_dgrad(g8, sg, w8, offs), want)  # the custom op's CPU path


@pytest.mark.parametrize("switch", [("GROUPED_FORWARD", "triton"), ("GROUPED_DGRAD", "w8a16"),
                                    ("GROUPED_DGRAD", "w8a8")])
def test_fp8_grouped_linear_through_the_triton_kernels(switch, monkeypatch):
    """model/quant/matmul.py's fp8 grouped path with a Triton kernel switched in (forward W8A8, or the input
    gradient W8A16 from the stack as stored): the output and the input gradient equal that path's torch references
    (forward: the quantised activation × the fp8 weight; input gradient: dy × the dequantised weight, no gradient
    quantisation with W8A16). The fp8 tensor-core test (`_fp8_kernels`) is forced on: here the kernels run under
    the interpreter."""
    from moetune.model.quant import matmul
    from moetune.model.quant.fp8 import scheme_named

    monkeypatch.setattr(tiles, "KERNEL_ON_CPU", True)
    monkeypatch.setattr(matmul, "_fp8_kernels", lambda *a: True)
    monkeypatch.setattr(matmul, switch[0], switch[1])
    calls = []
    real = gg.grouped_gemm
    monkeypatch.setattr(gg, "grouped_gemm", lambda *a, **k: calls.append(k.get("x_scale") is not None) or real(
        *a, **dict(k, config=tiles._INTERPRETER_CONFIG)))
    rows, offs, w8, scale = _case(fp8=True, pad=0, seed=4)
    x = torch.randn(rows, IN).bfloat16().requires_grad_()
    g = torch.randn(rows, OUT).bfloat16()
    scheme = scheme_named("fp8")
    if switch[0] == "GROUPED_FORWARD":
        y = matmul.fp8_grouped_linear(x, w8, scale, offs, scheme)
        _close(y, matmul.reference_fp8_grouped_linear(x.detach(), w8, scale, offs))
        assert calls == [True]  # the W8A8 kernel ran
        return
    monkeypatch.setattr(matmul, "_gmm_fwd", lambda x, w8, scale, offs: grouped_mm_reference(x, w8, offs, scale))
    y = matmul.fp8_grouped_linear(x, w8, scale, offs, scheme)
    y.backward(g)
    if switch[1] == "w8a16":
        assert calls == [False]  # the backward ran the W8A16 kernel
        _close(x.grad, grouped_mm_reference(g, w8, offs, scale, transpose=False))
    else:  # W8A8: the "fp8" path's numerics (dy with the scales folded in, quantised per row) without the copy
        assert calls == [True]
        gq, sg = quantize_rows(g.float() * scale[matmul.expert_of_rows(offs, rows)].squeeze(-1))
        _close(x.grad, grouped_mm_reference(gq.float() * sg, w8, offs, None, transpose=False))


# ------------------------------------------------------------------------------------------------ the TMA kernel
TMA_OUT, TMA_IN = 48, 32  # TMA wants 16-byte rows: fp8 rows are IN bytes, a K-major copy's OUT bytes


def _tma_case(fp8: bool, pad: int, seed: int):
    torch.manual_seed(seed)
    offs = torch.tensor(COUNTS).cumsum(0).to(torch.int32)
    w = torch.randn(E, TMA_OUT, TMA_IN) / TMA_IN ** 0.5
    return sum(COUNTS) + pad, offs, w


# a GPU's tiles: 128 or 256 rows (TMA_CONFIG*), K tiles of 64 and 128; `out` 256 a whole number of the stored fp8
# stack's K tiles. Groups ending past a whole tile by 44 rows (300), by 1 (129), within one tile (64, 7) and empty
GPU_COUNTS, GPU_OUT, GPU_IN = [0, 300, 7, 129, 0, 64], 256, 128


def _tma_gpu_case(pad: int):
    torch.manual_seed(11)
    offs = torch.tensor(GPU_COUNTS).cumsum(0).to(torch.int32).cuda()
    w = (torch.randn(len(GPU_COUNTS), GPU_OUT, GPU_IN) / GPU_IN ** 0.5).cuda()
    return sum(GPU_COUNTS) + pad, offs, w


@pytest.fixture
def tma_on_cpu(monkeypatch):
    if torch.cuda.is_available():  # the tests' GPU twins: the module's own configs
        return
    monkeypatch.setattr(tiles, "KERNEL_ON_CPU", True)
    monkeypatch.setattr(tma, "TMA_CONFIG", dict(tma.TMA_CONFIG, BK=tiles._INTERPRETER_CONFIG["BK"]))
    for name in ("TMA_CONFIG_FP8", "TMA_CONFIG_FP8_SWAP"):
        monkeypatch.setattr(tma, name, dict(getattr(tma, name), BK=tiles._INTERPRETER_CONFIG["BK"]))


@pytest.mark.parametrize("persistent", [False, True], ids=["tile_a_program", "persistent"])
@pytest.mark.parametrize("pad", [0, 3])
@pytest.mark.parametrize("case", ["bf16_forward", "bf16_dgrad", "bf16_forward_rows", "bf16_dgrad_rows", "fp8_forward",
                                  "fp8_dgrad_on_k_major_copy", "fp8_dgrad_as_stored"])
def test_tma_kernel_matches_reference(case, pad, persistent, tma_on_cpu, monkeypatch):
    """The TMA kernel on every operand form it takes: a bf16 stack forward (K-major) and input gradient (read as
    stored, N-major), an fp8 stack's forward (row scales of both operands) and its input gradient (the weight's
    scales folded into the fp8 gradient rows) on a K-major copy and on the stack as stored (the transposed product,
    SWAP). `_rows`: A's rows gathered from another matrix in the kernel's loads (`a_rows`: rows of it repeated and
    out of order, as a permutation by expert reads its tokens). Groups end mid-tile and are empty; padding rows get
    zeros; the rows a tile reads past its group are not stored. Both launches: a program a tile, and the persistent
    kernel (3 programs striding over the tiles, empty ones among them). On a GPU (its twin) with the GPU's launch
    configs and groups sized for its tiles, else under the interpreter."""
    monkeypatch.setattr(tma, "TMA_PERSISTENT", persistent)
    if torch.cuda.is_available():
        rows, offs, w = _tma_gpu_case(pad)
    else:
        rows, offs, w = _tma_case(fp8="fp8" in case, pad=pad, seed=11)
    n_out, n_in = w.shape[1:]
    if case.startswith("bf16"):
        transpose = "forward" in case
        wb = w.bfloat16()
        tokens = rows // 3 + 2 if case.endswith("_rows") else rows
        x = torch.randn(tokens, n_in if transpose else n_out, device=w.device).bfloat16()
        assert tma.tma_supported(x, wb, transpose)
        if case.endswith("_rows"):
            a_rows = torch.randint(0, tokens, (rows,), device=w.device)
            assert a_rows.unique().numel() < rows  # rows repeated
            y = tma.grouped_gemm_tma(x, wb, offs, None, transpose, a_rows=a_rows)
            x = x[a_rows]
        else:
            y = tma.grouped_gemm_tma(x, wb, offs, None, transpose)
        want = grouped_mm_reference(x, wb, offs, None, transpose)
    elif case == "fp8_forward":
        w8, scale = quantize_rows(w)
        x8, sx = quantize_rows(torch.randn(rows, n_in, device=w.device))
        assert tma.tma_supported(x8, w8, True)
        y = tma.grouped_gemm_tma(x8, w8, offs, scale, True, x_scale=sx)
        want = grouped_mm_reference(x8.float() * sx, w8, offs, scale)
    else:
        w8, _ = quantize_rows(w)
        g8, sg = quantize_rows(torch.randn(rows, n_out, device=w.device))
        as_stored = case.endswith("as_stored")
        operand = w8 if as_stored else w8.transpose(-2, -1).contiguous()
        assert tma.tma_supported(g8, operand, not as_stored)
        y = tma.grouped_gemm_tma(g8, operand, offs, None, not as_stored, x_scale=sg)
        want = grouped_mm_reference(g8.float() * sg, w8, offs, None, transpose=False)
    assert y.shape == want.shape and y.dtype == torch.bfloat16
    _close(y, want)
    assert (y[int(offs[-1]):] == 0).all()


def test_gathered_rows_past_the_last_k_tile_load_as_zeros(tma_on_cpu):
    """A forward whose K (40) is no multiple of the K tile (16 under the interpreter, 64 on a GPU): the gathered rows'
    last tile is partial, its columns past K load as zeros (as TMA's would), and the product is the reference's."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(12)
    offs = torch.tensor(COUNTS).cumsum(0).to(torch.int32).to(dev)
    w = (torch.randn(E, TMA_OUT, 40) / 40 ** 0.5).bfloat16().to(dev)
    x = torch.randn(9, 40).bfloat16().to(dev)
    rows = torch.randint(0, 9, (sum(COUNTS),)).to(dev)
    assert tma.tma_supported(x, w, True)
    _close(tma.grouped_gemm_tma(x, w, offs, None, True, a_rows=rows), grouped_mm_reference(x[rows], w, offs, None))


def test_tma_refuses_what_it_cannot_load(tma_on_cpu, monkeypatch):
    """Rows that are not 16-byte aligned, a stride-0 gradient, and an N-major K that a K tile would cross."""
    _, offs, w = _tma_case(fp8=False, pad=0, seed=1)
    wb = w.bfloat16()
    assert tma.tma_supported(torch.randn(4, TMA_IN).bfloat16(), wb, True)
    assert not tma.tma_supported(torch.randn(4, TMA_IN + 4).bfloat16()[:, :TMA_IN], wb, True)  # 72-byte row stride
    assert not tma.tma_supported(torch.randn(1, TMA_OUT).bfloat16().expand(4, TMA_OUT), wb, False)
    w40 = torch.randn(E, 40, TMA_IN).bfloat16()
    assert tma.tma_supported(torch.randn(4, TMA_IN).bfloat16(), w40, True)
    assert not tma.tma_supported(torch.randn(4, 40).bfloat16(), w40, False)  # 40 % BK != 0
    # fp8 rows: 16-byte aligned at 48
    monkeypatch.setattr(tma, "TMA_CONFIG_FP8_SWAP", dict(tma.TMA_CONFIG_FP8_SWAP, BK=32))
    for out, takes in [(48, False), (64, True)]:  # an fp8 stack as stored: `out` a multiple of its launch's BK
        g8 = torch.randn(4, out).to(torch.float8_e4m3fn)
        assert tma.tma_supported(g8, torch.randn(E, out, TMA_IN).to(torch.float8_e4m3fn), False) == takes


@pytest.mark.parametrize("dgrad,max_rows,stored", [("tma", 0, False), ("tma", 9, False), ("tma", 10, True),
                                                   ("w8a8", 0, True)])
def test_fp8_grouped_input_gradient_through_the_tma_kernel(dgrad, max_rows, stored, monkeypatch, tma_on_cpu):
    """The fp8 path's input gradient (dy with the scales folded in, quantised per row) through the TMA kernel: on
    the stack as stored (the transposed product, SWAP) with no copy made under GROUPED_DGRAD "w8a8", and under "tma"
    where the groups average at most STORED_DGRAD_MAX_ROWS rows (here 60 rows, the padding's 2 included, for 6
    experts), else on the K-major copy the copy kernel makes. Each equal to that path's reference."""
    from moetune.model.quant import matmul
    from moetune.model.quant.fp8 import scheme_named

    monkeypatch.setattr(matmul, "_fp8_kernels", lambda *a: True)
    monkeypatch.setattr(matmul, "GROUPED_DGRAD", dgrad)
    monkeypatch.setattr(matmul, "STORED_DGRAD_MAX_ROWS", max_rows)
    monkeypatch.setattr(matmul, "_gmm_fwd", lambda x, w8, scale, offs: grouped_mm_reference(x, w8, offs, scale))
    calls = []
    real = tma.grouped_gemm_tma
    monkeypatch.setattr(tma, "grouped_gemm_tma", lambda *a, **k: calls.append((a[1].shape, a[4])) or real(*a, **k))
    copies = _LaunchSpy(tma._k_major_copy_kernel)
    monkeypatch.setattr(tma, "_k_major_copy_kernel", copies)
    rows, offs, w = _tma_case(fp8=True, pad=2, seed=4)
    w8, scale = quantize_rows(w)
    x = torch.randn(rows, TMA_IN).bfloat16().requires_grad_()
    g = torch.randn(rows, TMA_OUT).bfloat16()
    matmul.fp8_grouped_linear(x, w8, scale, offs, scheme_named("fp8")).backward(g)
    assert rows == 10 * E  # the threshold's premise
    if not stored:  # the TMA kernel ran on the copy the copy kernel made
        assert calls == [((E, TMA_IN, TMA_OUT), True)] and len(copies.grids) == 1
    else:  # on the stack itself
        assert calls == [((E, TMA_OUT, TMA_IN), False)] and not copies.grids
    gq, sg = quantize_rows(g.float() * scale[matmul.expert_of_rows(offs, rows)].squeeze(-1))
    _close(x.grad, grouped_mm_reference(gq.float() * sg, w8, offs, None, transpose=False))


@pytest.mark.parametrize("stack", ["frozen_base", "trainable_base", "lora"])
def test_bf16_expert_stacks_through_the_tma_kernel_equal_torchs(stack, tma_on_cpu, monkeypatch):
    """experts.GROUPED_GEMM "triton": a frozen bf16 base stack's forward and input gradient through the TMA kernel
    (the stack K-major for the forward, read as stored for the gradient), equal to torch._grouped_mm's; a trainable
    stack, and LoRA's A/B (not a base stack), stay on torch's, the weight's gradient with them."""
    from moetune.model import experts

    calls = []
    real = tma.grouped_gemm_tma
    monkeypatch.setattr(tma, "grouped_gemm_tma", lambda *a, **k: calls.append(a[4]) or real(*a, **k))
    rows, offs, w = _tma_case(fp8=False, pad=0, seed=5)
    w = w.bfloat16().requires_grad_(stack == "trainable_base")
    x = torch.randn(rows, TMA_IN).bfloat16()
    g = torch.randn(rows, TMA_OUT).bfloat16()

    def run(mode):
        monkeypatch.setattr(experts, "GROUPED_GEMM", mode)
        xx = x.clone().requires_grad_()
        w.grad = None
        y = experts.grouped_linear(xx, w, offs, base=stack != "lora")
        y.backward(g)
        return y, xx.grad, w.grad

    want = run("torch")
    assert not calls
    got = run("triton")
    assert calls == ([True, False] if stack == "frozen_base" else [])
    _close(got[0], want[0])
    _close(got[1], want[1])
    if stack == "trainable_base":
        assert torch.equal(got[2], want[2])


@pytest.mark.parametrize("lora", [False, True], ids=["frozen", "expert_lora"])
@pytest.mark.parametrize("rows", ["tokens", "received"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_permutation_gathers_inside_the_gemms_change_nothing(compiled, rows, lora, tma_on_cpu, monkeypatch):
    """experts.GATHER_IN_GEMM: frozen bf16 stacks read the permuted rows from the tokens (gate_up's forward) and from
    the tokens' gradient (down's input gradient) in the TMA kernel's loads; with expert LoRA (in the kernel's epilogue)
    its thin products and A's gradient read them there too. The layer's output and the gradients of the rows, of the
    routing weights and of LoRA's A and B are those of the gathers written out, bit for bit; the two products run
    with `a_rows`; stacks it does not take (LoRA with dropout, a trainable stack) keep the gathers. The rows: tokens
    sorted by expert (the local path), and the rows an expert-parallel rank received, some of whose slots are other
    ranks' experts (empty slots in the map). On a GPU (its twin) with the GPU's launch configs and widths a multiple
    of their K tiles, else under the interpreter."""
    from moetune.model import expert_parallel, experts
    from moetune.model.lora import ExpertLoRA

    launches = []
    real = tma.grouped_gemm_tma
    monkeypatch.setattr(tma, "grouped_gemm_tma",
                        lambda *a, **k: launches.append((a[4], k.get("a_rows") is not None)) or real(*a, **k))
    torch.manual_seed(3)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    T, k, H, I, n_exp = (300, 3, 128, 64, 4) if dev == "cuda" else (13, 3, 32, 16, 4)
    gate_up = (torch.randn(n_exp, 2 * I, H) / H ** 0.5).bfloat16().to(dev)
    down = (torch.randn(n_exp, H, I) / I ** 0.5).bfloat16().to(dev)
    x = torch.randn(T, H).bfloat16().to(dev)
    if rows == "tokens":
        topk = torch.stack([torch.randperm(n_exp)[:k] for _ in range(T)]).to(dev)
        perm = experts.permute(topk, n_exp)
        bags, offs, w = perm.bags, perm.offs, torch.rand(T * k, device=dev)[perm.order]
    else:  # this rank holds experts 0..n_exp-1 of 2·n_exp; n_exp: another rank's
        topk = torch.stack([torch.randperm(2 * n_exp)[:k] for _ in range(T)]).to(dev)
        routing = torch.cat([torch.rand(T, k, device=dev), torch.where(topk < n_exp, topk, n_exp).float()], 1)
        order, bag, offs, slots, weights = expert_parallel._receive_plan_tensors(routing, k, n_exp, torch.float32)
        order, bag = order[:int(offs[-1])], bag[:int(offs[-1])]
        bags, w = experts.Bags(bag, slots), weights.reshape(-1)[order]
        assert (slots < 0).any() and not bags.full
    g = torch.randn(T, H).bfloat16().to(dev)
    expert_lora = None
    if lora:
        expert_lora = ExpertLoRA(n_exp, H, I, 16, 32, 0.0, False).to(dev)
        with torch.no_grad():  # B != 0: LoRA changes the output, and A gets gradients
            for B in (expert_lora.gate_up_B, expert_lora.down_B):
                B.normal_(0, 0.1)

    def run(gathers_in_gemm):
        monkeypatch.setattr(experts, "GATHER_IN_GEMM", gathers_in_gemm)
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        if lora:
            expert_lora.zero_grad(set_to_none=True)
        fn = experts.routed_experts
        if compiled:
            fn = torch.compile(fn, fullgraph=True, dynamic=False, backend=BACKEND)
        y = fn(xx, bags, offs, ww, gate_up, down, expert_lora)
        y.backward(g)
        return (y, xx.grad, ww.grad, *(p.grad for p in (expert_lora.parameters() if lora else ())))

    want = run(False)
    assert launches == [(True, False), (True, False), (False, False), (False, False)]
    launches.clear()
    got = run(True)
    # gate_up forward (gathered), down forward; down's input gradient (gathered), gate_up's
    assert launches == [(True, True), (True, False), (False, True), (False, False)]
    assert len(got) == (7 if lora else 3)
    for a, b in zip(got, want):
        assert torch.isfinite(a).all() and torch.equal(a, b)
    if lora:
        assert all(p.grad.abs().sum() > 0 for p in expert_lora.parameters())
        assert not experts.gathers_in_gemm(x, gate_up, down, ExpertLoRA(n_exp, H, I, 16, 32, 0.1, False).to(dev))
    assert experts.gathers_in_gemm(x, gate_up, down, expert_lora)
    assert not experts.gathers_in_gemm(x, gate_up.clone().requires_grad_(), down, None)


def test_tma_triton_op_equals_the_direct_launch(tma_on_cpu):
    """The TMA kernel as a triton_op (torch.compile traces into it and launches the kernel from its own code; on the
    CPU the interpreter cannot be traced, so the op runs eagerly here): the direct launch's values, for the fp8
    forward and the input gradient on a K-major copy."""
    rows, offs, w = _tma_case(fp8=True, pad=3, seed=7)
    w8, scale = quantize_rows(w)
    x8, sx = quantize_rows(torch.randn(rows, TMA_IN))
    g8, sg = quantize_rows(torch.randn(rows, TMA_OUT))
    copy = w8.transpose(-2, -1).contiguous()
    assert torch.equal(torch.ops.moetune.grouped_mm_tma(x8, w8, offs, scale, sx, True),
                       tma.grouped_gemm_tma(x8, w8, offs, scale, True, x_scale=sx))
    assert torch.equal(torch.ops.moetune.grouped_mm_tma(g8, copy, offs, None, sg, True),
                       tma.grouped_gemm_tma(g8, copy, offs, None, True, x_scale=sg))


class _LaunchSpy:
    """Stands in for a Triton kernel object: records each launch's grid, then launches the kernel."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


@pytest.mark.parametrize("shape,dtype", [((3, 40, 24), torch.float8_e4m3fn), ((37, 19), torch.bfloat16),
                                         ((2, 16, 48), torch.float8_e4m3fn)], ids=["fp8_ragged", "bf16_2d", "fp8"])
def test_k_major_copy_kernel_equals_torchs_transpose(shape, dtype, monkeypatch):
    """The input gradient's K-major copy of an fp8 stack by the copy kernel: byte for byte torch's transpose, for
    tiles that run past both edges, one matrix, and 2-byte elements."""
    monkeypatch.setattr(tiles, "KERNEL_ON_CPU", True)
    spy = _LaunchSpy(tma._k_major_copy_kernel)
    monkeypatch.setattr(tma, "_k_major_copy_kernel", spy)
    w = (torch.randn(shape) * 3).to(dtype)
    got = tma.k_major_copy(w)
    want = w.transpose(-2, -1).contiguous()
    assert len(spy.grids) == 1 and got.shape == want.shape and got.is_contiguous()
    bits = torch.uint8 if dtype.itemsize == 1 else torch.int16
    assert torch.equal(got.view(bits), want.view(bits))
    assert tma.k_major_copy(w[..., :0]).shape == (*shape[:-2], 0, shape[-2])  # nothing to copy: no launch
    assert len(spy.grids) == 1


@pytest.mark.parametrize("persistent", [False, True], ids=["tile_a_program", "persistent"])
@pytest.mark.parametrize("rank", [16, 32])
def test_lora_in_the_tma_epilogue_gives_the_lora_branch_and_its_gradients(rank, persistent, monkeypatch):
    """A frozen bf16 stack with LoRA on it as one op (grouped_mm_frozen_lora: the branch's s·(x·Aᵀ)·Bᵀ added in the
    TMA kernel's epilogue, and (dy·s·B)·A in the input gradient's) against the fp32 sum of the base product and the
    branch: the output and x's, A's and B's gradients, groups empty and ending mid-tile, padding rows zero. The op's
    two directions run the kernel with the epilogue (an epilogue that drops the branch, or adds it to the wrong
    expert, fails the comparison). On a GPU with its launch config (its twin), else under the interpreter."""
    cuda = torch.cuda.is_available()
    if not cuda:
        monkeypatch.setattr(tiles, "KERNEL_ON_CPU", True)
        monkeypatch.setattr(tma, "TMA_CONFIG", dict(tma.TMA_CONFIG, BK=tiles._INTERPRETER_CONFIG["BK"]))
    n_out, n_in = (192, 128) if cuda else (TMA_OUT, TMA_IN)  # the GPU's K tiles are 64 deep
    counts = [0, 300, 7, 129, 0, 64] if cuda else COUNTS
    device = "cuda" if cuda else "cpu"
    monkeypatch.setattr(tma, "TMA_PERSISTENT", persistent)
    torch.manual_seed(5)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32).to(device)
    rows = sum(counts) + 3
    wb = (torch.randn(E, n_out, n_in) / n_in ** 0.5).bfloat16().to(device)
    x = torch.randn(rows, n_in).bfloat16().to(device)
    A = (torch.randn(E, rank, n_in) / n_in ** 0.5).bfloat16().to(device)
    B = (torch.randn(E, n_out, rank) / rank ** 0.5).bfloat16().to(device)
    weights = torch.randn(rows, n_out, device=device)
    assert gg.lora_epilogue_fits(x, wb, rank)
    launches = []
    real = tma.grouped_gemm_tma
    monkeypatch.setattr(tma, "grouped_gemm_tma", lambda *a, **kw: launches.append(kw.get("lora") is not None)
                        or real(*a, **kw))
    xi, Ai, Bi = (t.clone().requires_grad_() for t in (x, A, B))
    y = gg.grouped_mm_frozen_lora(xi, wb, offs, Ai, Bi, 2.0)
    (y.float() * weights).sum().backward()
    assert launches == [True, True]  # forward, input gradient

    xf, Af, Bf = (t.float().requires_grad_() for t in (x, A, B))
    start, want = 0, torch.zeros(rows, n_out, device=device)
    for e, end in enumerate(offs.tolist()):
        want[start:end] = xf[start:end] @ wb[e].float().t() + 2.0 * (xf[start:end] @ Af[e].t()) @ Bf[e].t()
        start = max(start, end)
    (want * weights).sum().backward()
    _close(y, want.detach())
    assert (y[sum(counts):] == 0).all()
    for got, ref in ((xi.grad, xf.grad), (Ai.grad, Af.grad), (Bi.grad, Bf.grad)):
        _close(got, ref)


@pytest.mark.parametrize("rank", [16, 32])
def test_fp8_linear_with_lora_in_the_tma_epilogue(rank, tma_on_cpu, monkeypatch):
    """A LoRA linear's forward on a frozen fp8 weight by the TMA kernel as one group (quant.matmul.fp8_mm_lora): the
    activation rows quantised, the fp8 product with both operands' scales, and L·P added after the scales, against
    the fp32 reference of each (reference_fp8_linear + L·P); rows ending mid-tile. An epilogue that adds the branch
    before the scales, or drops it, fails. On a GPU with its launch config (its twin), else under the interpreter."""
    from moetune.model.quant import matmul

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    n_out, n_in, rows = (GPU_OUT, GPU_IN, 300) if cuda else (TMA_OUT, TMA_IN, 37)
    torch.manual_seed(13)
    w8, scale = quantize_rows((torch.randn(n_out, n_in) / n_in ** 0.5).to(device))
    x = torch.randn(rows, n_in, device=device).bfloat16()
    L = torch.randn(rows, rank, device=device).bfloat16()
    P = (torch.randn(rank, n_out, device=device) / rank).bfloat16()
    monkeypatch.setattr(matmul, "FP8_LORA_EPILOGUE", True)
    assert matmul.fp8_mm_lora_fits(x, w8, rank, None)
    assert not matmul.fp8_mm_lora_fits(x, w8, 8, None) and not matmul.fp8_mm_lora_fits(x, w8, rank, x[0])
    y = matmul.fp8_mm_lora(x, w8, scale, L, P)
    want = matmul.reference_fp8_linear(x.float(), w8, scale) + L.float() @ P.float()
    assert y.dtype == x.dtype and y.shape == (rows, n_out)
    _close(y, want)
    assert (want - matmul.reference_fp8_linear(x.float(), w8, scale)).abs().max() > 0.1 * want.abs().max()
    monkeypatch.setattr(matmul, "FP8_LORA_EPILOGUE", False)
    assert not matmul.fp8_mm_lora_fits(x, w8, rank, None)


def test_grouped_lora_ops_pass_opcheck():
    """The frozen stack's LoRA op and its input-gradient op as torch.library.opcheck sees them (schema, autograd
    registration, fake kernels, AOTAutograd with dynamic shapes), an empty group among them."""
    g = torch.Generator().manual_seed(0)
    offs = torch.tensor([4, 4, 10], dtype=torch.int32)
    x = torch.randn(10, 32, generator=g).bfloat16().requires_grad_()
    w = torch.randn(3, 48, 32, generator=g).bfloat16()
    A = torch.randn(3, 16, 32, generator=g).bfloat16().requires_grad_()
    B = torch.randn(3, 48, 16, generator=g).bfloat16().requires_grad_()
    torch.library.opcheck(torch.ops.moetune.grouped_mm_frozen_lora.default, (x, w, offs, A, B, 2.0))
    grad, grad_xa = torch.randn(10, 48, generator=g).bfloat16(), torch.randn(10, 16, generator=g).bfloat16()
    torch.library.opcheck(torch.ops.moetune.grouped_mm_frozen_lora_dgrad.default, (grad, w, offs, grad_xa, A.detach()))


@pytest.mark.parametrize("rank", [16, 32])
@pytest.mark.parametrize("operand", ["A_transposed", "B_as_stored"])
def test_lora_thin_kernels_equal_torchs_grouped_products(rank, operand, monkeypatch):
    """Expert LoRA's thin products by their kernels (lora_rows: rows · W[e] down to the rank; ragged_outer: Σ over a
    group's rows of pᵀ·q, the weight gradients) against the fp32 products per group: groups empty and ending
    mid-tile, padding rows zero, W as LoRA's Aᵀ (a transposed view) or B as stored, a scale applied; the kernels run
    (on a GPU its twin, else under the interpreter)."""
    cuda = torch.cuda.is_available()
    monkeypatch.setattr(tiles, "KERNEL_ON_CPU", not cuda)
    device = "cuda" if cuda else "cpu"
    counts = [0, 300, 7, 129, 0, 64] if cuda else COUNTS
    offs = torch.tensor(counts).cumsum(0).to(torch.int32).to(device)
    rows, K = sum(counts) + 3, (192 if cuda else 40)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(rows, K, generator=g).bfloat16().to(device)
    if operand == "A_transposed":
        w = torch.randn(E, rank, K, generator=g).bfloat16().to(device).transpose(-2, -1)
    else:
        w = torch.randn(E, K, rank, generator=g).bfloat16().to(device)
    q = torch.randn(rows, rank, generator=g).bfloat16().to(device)
    launches = []
    for name in ("_lora_rows_kernel", "_ragged_outer_kernel"):
        real = getattr(lora_kernels, name)
        monkeypatch.setattr(lora_kernels, name, type("K", (), {"__getitem__": lambda self, grid, real=real, name=name:
                                                                launches.append(name) or real[grid]})())
    y = lora_kernels.lora_rows(x, w, offs, 0.5)
    outer_wide = lora_kernels.ragged_outer(x, q, offs, 2.0)  # [E, K, r]: B's gradient's shape
    outer_rank = lora_kernels.ragged_outer(q, x, offs)  # [E, r, K]: A's
    assert launches == ["_lora_rows_kernel", "_ragged_outer_kernel", "_ragged_outer_kernel"]
    want_y = torch.zeros(rows, rank, device=device)
    want_outer = torch.zeros(E, K, rank, device=device)
    start = 0
    for e, end in enumerate(offs.tolist()):
        want_y[start:end] = 0.5 * x[start:end].float() @ w[e].float()
        want_outer[e] = x[start:end].float().t() @ q[start:end].float()
        start = max(start, end)
    _close(y, want_y)
    assert (y[sum(counts):] == 0).all()
    _close(outer_wide, 2.0 * want_outer)
    _close(outer_rank, want_outer.transpose(-2, -1))
    assert all((outer_rank[e] == 0).all() for e, n in enumerate(counts) if n == 0)  # the empty groups


def test_lora_thin_ops_pass_opcheck():
    """lora_rows and ragged_outer as the opaque ops the LoRA op's traced backward calls (torch.library.opcheck)."""
    g = torch.Generator().manual_seed(0)
    offs = torch.tensor([4, 4, 10], dtype=torch.int32)
    x = torch.randn(10, 32, generator=g).bfloat16()
    w = torch.randn(3, 32, 16, generator=g).bfloat16()
    q = torch.randn(10, 16, generator=g).bfloat16()
    torch.library.opcheck(torch.ops.moetune.lora_rows.default, (x, w, offs, 0.5))
    torch.library.opcheck(torch.ops.moetune.ragged_outer.default, (x, q, offs, 2.0))


def test_comm_overlap_benchmark_rehearses_on_the_cpu(tmp_path):
    """benchmarks/comm_overlap.py's CPU rehearsal (Triton's interpreter) runs against today's TMA kernel: the GEMM
    with SMs left free (tma.RESERVED_SMS) is checked equal to the GEMM without, and every case reports finite
    positive times."""
    import json
    import math
    import os
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[2] / "benchmarks" / "comm_overlap.py"
    env = dict(os.environ, BENCH_CPU="1", OUT=str(tmp_path), OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, str(bench)], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    cases = json.loads((tmp_path / "comm_overlap.json").read_text())["cases"]
    assert [c["reserved_sms"] for c in cases] == [0, 1]
    for c in cases:
        times = [c[k] for k in ("gemm_ms", "copy_ms", "copy_first_ms", "gemm_first_ms")]
        assert all(math.isfinite(t) and t > 0 for t in times), c
