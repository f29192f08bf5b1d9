"""One vLLM engine per process (vLLM keeps process-wide state): `python vllm_checks.py CHECK JSON_ARGS` prints one
JSON line `RESULT {...}`. The `__main__` guard is needed: vLLM may start helper processes by spawning this file.

    serve     load an HF checkpoint (the merged export), return prompt logprobs of `ids` (and with `max_tokens`, the
              greedy continuation of `ids`, eos ignored)
    lora      start from the base with LoRA enabled; add_lora each adapter dir: accepted or the error
    sync      start from the base, join moetune's weight sync through MoetuneWorkerExtension, receive one sync;
              prompt logprobs of `ids` before and after
    transfer  vLLM's own weight-transfer API with the "moetune" backend, trainer and engine in this process: the
              run's base + adapter synced (fp32, LoRA merged); then a trainer whose model differs (refused) and an
              engine that stops answering (a timeout naming it)
    transfer_fp8  the same API, the engine serving an FP8 (compressed-tensors) base: a bf16 sync (refused), then the
              trainer of `run` (that base + its adapter) synced in format fp8_rows; prompt logprobs before and after
"""

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: loads in seconds
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default takes a large part of the machine


def _llm(model, mla=False, **kw):
    from vllm import LLM

    if mla:
        # vLLM-CPU 0.32's rotary kernel (ops.rotary_embedding, GPT-J style) rotates a 3-D query [tokens, heads, 64]
        # wrongly (a flat [tokens, heads·64] one right); MLA passes q_pe 3-D. The torch path is right.
        kw["compilation_config"] = {"custom_ops": ["-rotary_embedding"]}
        # on a CPU with AMX tiles vLLM picks its AMX MLA kernels, which take DeepSeek's head sizes only (576 =
        # kv_lora_rank 512 + rope 64) and fail to load the tests' tiny MLA ("invalid weight input features"): the
        # reference CPU MLA backend, which any CPU has, serves every size
        kw["attention_config"] = {"backend": "CPU_MLA"}
    return LLM(model, dtype="float32", max_model_len=256, enforce_eager=True, seed=0, **kw)


def prompt_logprobs(llm, ids):
    """log p(ids[t] | ids[:t]) for t >= 1, as vLLM computes them."""
    from vllm import SamplingParams

    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0),
                       use_tqdm=False)
    lps = out[0].prompt_logprobs
    return [lps[t][ids[t]].logprob for t in range(1, len(ids))]


def greedy(llm, ids, max_tokens):
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def serve(a):
    llm = _llm(a["model"], a.get("mla", False))
    out = {"logprobs": prompt_logprobs(llm, a["ids"])}
    if a.get("max_tokens"):
        out["tokens"] = greedy(llm, a["ids"], a["max_tokens"])
    return out


def lora(a):
    from vllm.lora.request import LoRARequest

    llm = _llm(a["base"], a.get("mla", False), enable_lora=True, max_lora_rank=a["rank"], max_loras=1)
    results = {}
    for i, path in enumerate(a["adapters"], start=1):
        try:
            results[path] = bool(llm.llm_engine.add_lora(LoRARequest(f"adapter{i}", i, path)))
        except Exception as e:  # noqa: BLE001 - reported to the test
            results[path] = f"{type(e).__name__}: {e}"[:500]
    return results


def sync(a):
    llm = _llm(a["base"], a.get("mla", False), worker_extension_cls="moetune.sync.vllm.MoetuneWorkerExtension")
    before = prompt_logprobs(llm, a["ids"])
    llm.collective_rpc("init_weight_sync", args=(a["address"], 1, a["world_size"]))
    stats = llm.collective_rpc("receive_weights")[0]
    llm.collective_rpc("close_weight_sync")
    llm.reset_prefix_cache()  # cached keys/values of the prompt were computed with the old weights
    return {"before": before, "after": prompt_logprobs(llm, a["ids"]), "stats": stats}


def transfer(a):
    import torch

    import moetune
    from moetune.model.build import build_model
    from moetune.model.config import ModelConfig
    from moetune.sync.vllm_engine import LLMClient, MoetuneSource, MoetuneTrainerInitInfo
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    llm = _llm(a["base"], weight_transfer_config={"backend": "moetune"})
    client = LLMClient(llm)
    out = {"before": prompt_logprobs(llm, a["ids"])}

    def engine(model, client=client, **kw):
        info = MoetuneTrainerInitInfo(rank=0, master_address="127.0.0.1", master_port=0, world_size=2, **kw)
        return WeightTransferTrainerFactory.trainer_init(info, client=client, source=MoetuneSource(model, "fp32"))

    trainer = moetune.load_model(a["base"], dtype="float32", adapter=a["adapter"])
    with torch.no_grad():
        lp = torch.log_softmax(trainer(torch.tensor([a["ids"]]))[0], -1)
    out["trainer"] = [lp[t - 1, a["ids"][t]].item() for t in range(1, len(a["ids"]))]
    first = engine(trainer)
    out["stats"] = {k: v for k, v in first.send_weights().items() if isinstance(v, (int, float, str))}
    out["after"] = prompt_logprobs(llm, a["ids"])
    client.shutdown_weight_transfer_engine()

    # a trainer whose model differs: refused before any weight moves, the engine's weights untouched
    cfg = json.load(open(os.path.join(a["base"], "config.json")))
    other = build_model(ModelConfig.from_hf_dict(dict(cfg, moe_intermediate_size=2 * cfg["moe_intermediate_size"])),
                        "cpu").float()
    try:
        engine(other).send_weights()
        out["refused"] = None
    except Exception as e:  # noqa: BLE001 - reported to the test
        out["refused"] = f"{type(e).__name__}: {e}"
    out["after_refusal"] = prompt_logprobs(llm, a["ids"])
    client.shutdown_weight_transfer_engine()

    # an engine that stops answering: its update_weights never runs
    class Gone(LLMClient):
        def update_weights(self, update_info):
            pass  # the RPC never reaches the engine

    gone = engine(trainer, client=Gone(llm), deadline_s=2.0)
    try:
        gone.send_weights()
        out["timeout"] = None
    except Exception as e:  # noqa: BLE001 - reported to the test
        out["timeout"] = f"{type(e).__name__}: {e}"
    return out


def transfer_fp8(a):
    import moetune
    from moetune.sync.vllm_engine import LLMClient, MoetuneSource, MoetuneTrainerInitInfo
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    llm = _llm(a["base"], weight_transfer_config={"backend": "moetune"})
    client = LLMClient(llm)
    out = {"before": prompt_logprobs(llm, a["ids"])}
    trainer, _ = moetune.load_for_generation(a["run"], dtype="float32")

    def engine(fmt):
        info = MoetuneTrainerInitInfo(rank=0, master_address="127.0.0.1", master_port=0, world_size=2)
        return WeightTransferTrainerFactory.trainer_init(info, client=client, source=MoetuneSource(trainer, fmt))

    try:
        engine("bf16").send_weights()
        out["refused"] = None
    except Exception as e:  # noqa: BLE001 - reported to the test
        out["refused"] = f"{type(e).__name__}: {e}"
    out["after_refusal"] = prompt_logprobs(llm, a["ids"])
    client.shutdown_weight_transfer_engine()
    stats = engine("fp8_rows").send_weights()
    out["stats"] = {k: v for k, v in stats.items() if isinstance(v, (int, float, str))}
    out["after"] = prompt_logprobs(llm, a["ids"])
    client.shutdown_weight_transfer_engine()
    return out


if __name__ == "__main__":
    check, args = sys.argv[1], json.loads(sys.argv[2])
    result = {"serve": serve, "lora": lora, "sync": sync, "transfer": transfer,
              "transfer_fp8": transfer_fp8}[check](args)
    print("RESULT " + json.dumps(result), flush=True)
