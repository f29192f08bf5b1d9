"""The one-pass row-wise fp8 quantisation (model/quant/row_quant.py) against its torch reference, bit for bit, on
the CPU under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without a GPU): a column scale per
group of rows folded in (empty groups, padding rows past the last end), one column scale for all rows, none; widths
that are no power of two; bf16 and fp32 rows; no rows; the custom op under torch.compile."""

import pytest
import torch

from moetune.model.quant import row_quant as rq

pytestmark = pytest.mark.skipif(rq.triton is None, reason="needs Triton (its interpreter on the CPU)")
COUNTS = [0, 7, 13, 1, 9, 0]  # groups 0 and 5 empty; 3 padding rows follow the last end
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the kernel itself on a GPU, its interpreter without


def _case(K, dtype, groups: bool, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = sum(COUNTS) + 3
    x = (torch.randn(rows, K, generator=g) * torch.logspace(-3, 2, rows)[:, None]).to(dtype)
    x[2] = 0  # an all-zero row: the smallest scale, zeros out
    col = torch.rand(len(COUNTS) if groups else 1, K, generator=g) * 1e-2 + 1e-4
    offs = torch.tensor(COUNTS).cumsum(0).to(torch.int32).to(DEVICE) if groups else None
    return x.to(DEVICE), col.to(DEVICE), offs


def _same(got, want):
    (q, s), (q_ref, s_ref) = got, want
    assert q.dtype == q_ref.dtype and q.shape == q_ref.shape and s.shape == s_ref.shape
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(s, s_ref)


@pytest.mark.parametrize("K", [88, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fold", ["groups", "one", "none"])
def test_the_kernel_equals_its_reference_bit_for_bit(K, dtype, fold):
    x, col, offs = _case(K, dtype, fold == "groups")
    if fold == "none":
        col = None
    _same(rq.kernel(x, col, offs), rq.reference(x, col, offs))


def test_the_op_runs_the_kernel_compiled_and_takes_no_rows(monkeypatch):
    monkeypatch.setattr(rq, "KERNEL_ON_CPU", True)
    calls = []
    real = rq.kernel
    monkeypatch.setattr(rq, "kernel", lambda *a: calls.append(1) or real(*a))
    x, col, offs = _case(88, torch.bfloat16, True)
    f = torch.compile(lambda x, c, o: torch.ops.moetune.row_quant(x * 2, c, o), backend="aot_eager", fullgraph=True)
    _same(f(x, col, offs), rq.reference(x * 2, col, offs))
    assert calls
    q, s = rq.kernel(x[:0], col, offs)
    assert q.shape == (0, 88) and s.shape == (0, 1)
