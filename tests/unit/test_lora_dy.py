"""LoRA's backward products of dy from one read (model/lora_dy.py): the Triton kernel against torch's two GEMMs, alone
and inside the LoRA op's backward (on the CPU under Triton's interpreter, tests/conftest.py; on the GPU where there is
one)."""

import pytest
import torch

from moetune.model import grouped_gemm_tiles, lora, lora_dy

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def kernel_runs(monkeypatch):
    """The kernel on this device, and a list that records each call of torch's path."""
    monkeypatch.setattr(grouped_gemm_tiles, "KERNEL_ON_CPU", DEVICE == "cpu")
    monkeypatch.setattr(lora_dy, "DY_KERNEL", True)
    torch_calls = []
    real = lora_dy.dy_products_torch
    monkeypatch.setattr(lora_dy, "dy_products_torch", lambda *a: torch_calls.append(a[0].shape) or real(*a))
    return torch_calls


def _bf16(*shape, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).bfloat16().to(DEVICE)


@pytest.mark.parametrize("M, N, R", [(40, 70, 16), (16, 16, 32), (33, 130, 16), (5, 300, 64)])
@pytest.mark.parametrize("scaling", [2.0, 0.75])
@pytest.mark.parametrize("programs", [1, 264], ids=["all_columns", "columns_split"])
def test_dy_products_equal_the_two_products_in_float64(M, N, R, scaling, programs, kernel_runs, monkeypatch):
    """grad_h = s·dy·B and grad_B = s·dyᵀ·h from the kernel, for shapes that fill no tile, dy a column slice of a
    wider gradient and h a member's columns of the joined x·Aᵀ (strided rows): the float64 products of the same bf16
    inputs, within one bf16 rounding (the kernel sums in fp32 and rounds once). Each program takes every column of
    its rows (grad_h summed in its loop), or a run of them (summed across programs)."""
    monkeypatch.setattr(lora_dy, "_TARGET_PROGRAMS", programs)
    gen = torch.Generator().manual_seed(M * N + R)
    dy = _bf16(M, N + 24, gen=gen)[:, 7:7 + N]
    B = _bf16(N, R, gen=gen)
    h = _bf16(M, R + 16, gen=gen)[:, 16:]
    grad_h, grad_b = lora_dy.dy_products(dy, B, h, scaling)
    assert not kernel_runs, "the kernel ran"
    want_h = scaling * dy.double() @ B.double()
    want_b = scaling * dy.double().t() @ h.double()
    assert grad_h.dtype == grad_b.dtype == torch.bfloat16
    for got, want in ((grad_h, want_h), (grad_b, want_b)):
        torch.testing.assert_close(got.double(), want, rtol=1.6e-2, atol=1e-2 * want.abs().max().item())
    # a NaN in dy reaches its row of grad_h and its column's row of grad_B, and no other
    dy = dy.clone()
    dy[3, 5] = float("nan")
    grad_h, grad_b = lora_dy.dy_products(dy, B, h, scaling)
    assert grad_h.isnan().nonzero()[:, 0].unique().tolist() == [3]
    assert grad_b.isnan().nonzero()[:, 0].unique().tolist() == [5]


def test_torchs_products_where_the_kernel_does_not_run(kernel_runs, monkeypatch):
    """A rank that is no MMA dimension, float32 and float64 operands, and the switch off take torch's GEMMs."""
    gen = torch.Generator().manual_seed(0)
    dy, h = _bf16(8, 24, gen=gen), _bf16(8, 8, gen=gen)
    lora_dy.dy_products(dy, _bf16(24, 8, gen=gen), h, 2.0)
    for dtype in (torch.float32, torch.float64):
        lora_dy.dy_products(dy.to(dtype), _bf16(24, 16, gen=gen).to(dtype), _bf16(8, 16, gen=gen).to(dtype), 2.0)
    monkeypatch.setattr(lora_dy, "DY_KERNEL", False)
    lora_dy.dy_products(dy, _bf16(24, 16, gen=gen), _bf16(8, 16, gen=gen), 2.0)
    assert len(kernel_runs) == 4


def test_the_lora_ops_backward_with_the_kernel_gives_torchs_gradients(kernel_runs, monkeypatch):
    """q, k and v as one LoRA op in bf16 (lora.JOINT_INPUTS; ranks 16 and 32): x's, A's and B's gradients with the
    kernel equal those of torch's GEMMs within bf16's rounding, and the kernel ran for each member."""
    torch.manual_seed(0)
    n_in, rows = 32, 24
    members = [lora.LoRALinear(torch.nn.Linear(n_in, n_out, bias=bias).to(DEVICE).bfloat16(), rank=rank, alpha=2 * rank,
                               dropout=0.0, rslora=False)
               for n_out, bias, rank in ((48, True, 16), (16, False, 32), (16, True, 16))]
    for m in members:
        torch.nn.init.normal_(m.lora_B)
    x0 = torch.randn(2, rows // 2, n_in, device=DEVICE).bfloat16()
    weights = [torch.randn(m.out_features, device=DEVICE).bfloat16() for m in members]

    def grads(kernel: bool):
        monkeypatch.setattr(lora_dy, "DY_KERNEL", kernel)
        for m in members:
            m.zero_grad()
        x = x0.clone().requires_grad_()
        ys = lora.LoRALinear.of_one_input(x, members)
        sum((y.float() * w.float()).sum() for y, w in zip(ys, weights)).backward()
        return [x.grad] + [g.clone() for m in members for g in (m.lora_A.grad, m.lora_B.grad)]

    want = grads(False)
    assert len(kernel_runs) == 3
    got = grads(True)
    assert len(kernel_runs) == 3, "torch's GEMMs ran where the kernel should"
    for a, b in zip(got, want):
        assert a.abs().sum() > 0
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2 * b.abs().max().item())
