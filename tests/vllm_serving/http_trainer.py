"""The trainer's side of the `vllm serve` test: `python http_trainer.py URL BASE ADAPTER IDS_JSON` waits for the
server, syncs the base + adapter (fp32, LoRA merged) through vLLM's HTTP weight-transfer routes with moetune's backend,
and prints `RESULT {"before", "after", "trainer"}`: the server's prompt logprobs of IDS before and after the sync, and
the trainer's own."""

import json
import sys
import time

import requests
import torch
from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, WeightTransferTrainerFactory

import moetune
from moetune.sync.vllm_engine import MoetuneSource, MoetuneTrainerInitInfo


def served_logprobs(url, model, ids):
    r = requests.post(f"{url}/v1/completions", json={"model": model, "prompt": ids, "max_tokens": 1,
                                                     "prompt_logprobs": 0, "temperature": 0}, timeout=60)
    r.raise_for_status()
    lps = r.json()["choices"][0]["prompt_logprobs"]
    return [lps[t][str(ids[t])]["logprob"] for t in range(1, len(ids))]


def main():
    url, base, adapter, ids = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    end = time.monotonic() + 240
    while True:  # the server loads its model
        try:
            if requests.get(f"{url}/health", timeout=2).ok:
                break
        except requests.ConnectionError:
            pass
        if time.monotonic() > end:
            raise TimeoutError(f"{url} did not come up")
        time.sleep(1)
    trainer = moetune.load_model(base, dtype="float32", adapter=adapter)
    with torch.no_grad():
        lp = torch.log_softmax(trainer(torch.tensor([ids]))[0], -1)
    out = {"trainer": [lp[t - 1, ids[t]].item() for t in range(1, len(ids))], "before": served_logprobs(url, base, ids)}
    info = MoetuneTrainerInitInfo(rank=0, master_address="127.0.0.1", master_port=0, world_size=2)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=HTTPVLLMWeightSyncClient(url),
                                                       source=MoetuneSource(trainer, "fp32"))
    engine.send_weights()
    # the HTTP routes leave the prefix cache as it was: its keys/values were computed with the old weights
    requests.post(f"{url}/reset_prefix_cache", timeout=60).raise_for_status()
    out["after"] = served_logprobs(url, base, ids)
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
