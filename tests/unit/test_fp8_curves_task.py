"""benchmarks/fp8_check.py's loss-curve inputs on the CPU: the Markov task's batches walk only the chain's allowed
transitions and are the same whatever is run around them, and the `fp8_dequant_bf16` base is a plain bf16 model
holding the fp8 base's weights (its own assertions run)."""

import importlib.util
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "fp8_check.py"


def _bench():
    spec = importlib.util.spec_from_file_location("fp8_check_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.CPU, mod.DEV = True, torch.device("cpu")
    return mod


def test_markov_batches_follow_the_chain():
    F = _bench()
    ids, nxt = F.markov_chain(160, 64, 4, seed=7)
    assert len(set(ids.tolist())) == 64 and all(len(set(r)) == 4 for r in nxt.tolist())
    allowed = {(int(ids[s]), int(ids[t])) for s in range(64) for t in nxt[s]}
    data = F.markov_batches(ids, nxt, steps=5, rows=4, seq=32, seed=1)
    assert data.shape == (5, 4, 32)
    pairs = set(zip(data[..., :-1].flatten().tolist(), data[..., 1:].flatten().tolist()))
    assert pairs <= allowed
    # step i's batch depends on (seed, i) alone: the same in a shorter run
    assert torch.equal(F.markov_batches(ids, nxt, steps=3, rows=4, seq=32, seed=1), data[:3])


def test_dequant_base_holds_the_fp8_weights_in_bf16():
    F = _bench()
    model, note = F._curve_model(F._cfg(8), "fp8", True)
    assert not any(p.dtype == torch.float8_e4m3fn for p in model.parameters())
    # bf16 rounding of q·scale only (2^-9 relative at most per element)
    assert 0 < note["linear_rel_bf16_rounding_of_fp8_weight"] < 4e-3
    assert 0 < note["experts_rel_bf16_rounding_of_fp8_weight"] < 4e-3
