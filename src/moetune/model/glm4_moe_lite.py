"""GLM-4.7-Flash (`glm4_moe_lite`, transformers' `Glm4MoeLiteForCausalLM`), in plain PyTorch.

    embed → N × [x + MLA(RMSNorm(x)); x + MLP-or-MoE(RMSNorm(x))] → RMSNorm → lm_head
    MLA:  q through a low-rank bottleneck (q_lora_rank; or one q_proj), K/V from a shared latent, interleaved
          RoPE on a separate 64-dim slice (mla.py)
    MoE:  GLM-4.5's (sigmoid router in fp32, top-k over the correction-biased scores, grouped-GEMM experts,
          a shared expert); layer 0 dense (mlp_layer_types)
The MTP layer (`model.layers.{num_hidden_layers}`) of the hub checkpoint is not built, as in transformers.
"""

from __future__ import annotations

from moetune.model.glm4_moe import Glm4MoeForCausalLM
from moetune.model.mla import MLAttention


class Glm4MoeLiteForCausalLM(Glm4MoeForCausalLM):
    attention_cls = MLAttention
