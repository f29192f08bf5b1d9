"""The trainer's side of the vLLM weight-sync test: a moetune model (the run's base + adapter, LoRA live) sends one
bf16 sync with LoRA merged (rank 0 of the sync group) to vLLM (rank 1) and to a moetune twin that starts from the
base (rank 2, a thread here). Prints `RESULT {"logprobs": ...}`: the twin's prompt logprobs of `ids` after the sync,
i.e. the trainer's merged model as it went over the wire."""

import json
import sys
import threading

import torch

import moetune
from moetune.sync import WeightSender, connect, receive_into


def main():
    a = json.loads(sys.argv[1])
    trainer = moetune.load_model(a["base"], dtype="float32", adapter=a["adapter"])
    twin = moetune.load_model(a["base"], dtype="float32")
    errors = []

    def twin_receives():
        try:
            receive_into(connect(a["address"], 2, 3, "cpu", timeout_s=600), twin)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    t = threading.Thread(target=twin_receives, daemon=True)
    t.start()
    WeightSender(trainer, connect(a["address"], 0, 3, "cpu", timeout_s=600), format="bf16", lora="merge").sync()
    t.join(600)
    if errors:
        raise errors[0]
    ids = torch.tensor([a["ids"]])
    with torch.no_grad():
        lp = torch.log_softmax(twin(ids)[0].float(), -1)
    print("RESULT " + json.dumps({"logprobs": [lp[t - 1, a["ids"][t]].item() for t in range(1, len(a["ids"]))]}),
          flush=True)


if __name__ == "__main__":
    main()
