"""Published models, clusters and the compositions they were trained with — the planner's worked examples.

Every figure names its source.  Where a paper does not give a number the planner needs, the value
is marked ASSUMED and the reason is given.

Llama 3 (Llama Team, "The Llama 3 Herd of Models", arXiv:2407.21783)
    Table 3: 405B — 126 layers, model dimension 16,384, FFN 53,248, 128 heads, 8 key/value heads;
             70B — 80 layers, 8,192, FFN 28,672, 64 heads, 8 KV heads; vocabulary 128K tokens
             (128,256 in the released tokenizer); SwiGLU; untied embeddings.
    Table 4: 405B pre-training on H100s — 8,192 GPUs TP 8, CP 1, PP 16, DP 64; 16,384 GPUs TP 8,
             CP 1, PP 16, DP 128, sequence 8,192; long context 16,384 GPUs TP 8, CP 16, PP 16, DP 8,
             sequence 131,072; 16M tokens per batch; 38–43 % BF16 MFU.
    §3.3.1: 8 GPUs per server joined by NVLink, 400 Gbps per GPU between servers (RoCE), 80 GB HBM3.
GShard (Lepikhin et al., arXiv:2006.16668)
    MoE(2048E, 36L): 600B parameters, 36 layers with a MoE layer every other layer, 2,048 experts,
    top-2 gating, model dimension 1,024, FFN 8,192, 16 heads; trained on 2,048 TPU v3 cores (one
    expert per core, the rest of the model data-parallel), 4M tokens per batch.  The arithmetic
    below gives 618B for this configuration (18 MoE layers × 2048 × 2·1024·8192 = 618.5B in the
    experts alone), which the paper rounds to "600B".
    TPU v3 (Google Cloud documentation): 32 GiB HBM and ~123 TFLOP/s bf16 per chip of 2 cores.
"""
from __future__ import annotations

from .model import GB, Cluster, Composition, Model

__all__ = ["LLAMA3_405B", "LLAMA3_70B", "LLAMA3_405B_LONG", "GSHARD_600B", "H100_16K", "H100_8K", "TPU_V3_2048",
           "LLAMA3_405B_8K_PLAN", "LLAMA3_405B_16K_PLAN", "LLAMA3_405B_LONG_PLAN", "GSHARD_PLAN", "LLAMA3_405B_STAGES",
           "LLAMA3_MFU", "H100_16K_PRESET", "DEEPSEEK_V3", "H800_2048", "DEEPSEEK_V3_PLAN"]

_LLAMA3 = "Llama 3, arXiv:2407.21783, Tables 3 and 4"

LLAMA3_405B = Model(
    "Llama 3 405B (8K context)", layers=126, hidden=16384, heads=128, kv_heads=8, ffn=53248, vocab=128256,
    seq_len=8192, micro_batch=1, global_batch=2048,          # 16M tokens per step = 2048 × 8192
    gated_ffn=True, dropout=False, source=_LLAMA3)
LLAMA3_405B_LONG = Model(
    "Llama 3 405B (128K context)", layers=126, hidden=16384, heads=128, kv_heads=8, ffn=53248, vocab=128256,
    seq_len=131072, micro_batch=1, global_batch=128,          # 16M tokens per step = 128 × 131072
    gated_ffn=True, dropout=False, source=_LLAMA3)
LLAMA3_70B = Model(
    "Llama 3 70B", layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256, seq_len=8192,
    micro_batch=1, global_batch=2048, gated_ffn=True, dropout=False, source=_LLAMA3)

# H100 SXM: 80 GB HBM3, 989 TFLOP/s dense BF16, NVLink 4 = 900 GB/s both ways (450 GB/s one way),
# 400 Gbps = 50 GB/s per GPU between servers (Llama 3 §3.3.1).  MFU 0.4: the paper's 38–43 %.
_H100 = dict(memory=80 * GB, flops=989e12, intra_bw=450e9, inter_bw=50e9, devices_per_node=8, mfu=0.4,
             source="H100 SXM datasheet; Llama 3 §3.3.1")
H100_16K = Cluster("16,384 H100 (Llama 3 405B)", devices=16384, **_H100)
H100_8K = Cluster("8,192 H100", devices=8192, **_H100)

# The pipeline as run (§3.3.2): interleaved, with one Transformer layer taken from the first and the last stage so
# that "the first model chunk on the first stage has only the embedding, and the last model chunk on the last
# stage has only output projection and loss calculation" — 126 layers in 16 × 8 chunks of one layer, v = 8, the
# first chunk embedding-only and the last loss-only.
LLAMA3_405B_STAGES = (0,) + (1,) * 126 + (0,)
_AS_RUN = dict(virtual_stages=8, stage_layout=LLAMA3_405B_STAGES)
LLAMA3_405B_8K_PLAN = Composition(dp=64, tp=8, pp=16, cp=1, zero=2, recompute="full", flash=True, **_AS_RUN)
LLAMA3_405B_16K_PLAN = Composition(dp=128, tp=8, pp=16, cp=1, zero=2, recompute="full", flash=True, **_AS_RUN)
LLAMA3_405B_LONG_PLAN = Composition(dp=8, tp=8, pp=16, cp=16, zero=2, recompute="full", flash=True, **_AS_RUN)
# The paper says FSDP sharding optimizer states and gradients (ZeRO-2-like) and gives no recomputation
# setting: ASSUMED full recomputation (without it the first stage holds 143 chunk-forwards of activations and
# does not fit in 80 GB by this accounting).  Flash attention: the standard kernel on H100s.
LLAMA3_MFU = (0.38, 0.43)           # Table 4: BF16 MFU of the 405B runs, 38–43 %
# The same 16,384 H100s described from their datasheets (the "h100-80gb-sxm" preset: NVLink 4, 400 Gbps per GPU
# as §3.3.1 states), for the time from first principles rather than H100_16K's one assumed MFU
H100_16K_PRESET = Cluster.preset("h100-80gb-sxm", 16384)

GSHARD_600B = Model(
    "GShard MoE(2048E, 36L)", layers=36, hidden=1024, heads=16, kv_heads=16, ffn=8192,
    vocab=64000,              # ASSUMED: a 64K SentencePiece vocabulary (small either way next to the experts)
    seq_len=1024,             # ASSUMED: sentence pairs are short; 4M tokens per batch = 4096 × 1024
    micro_batch=1,            # ASSUMED: two micro-batches of one sequence per core and step
    global_batch=4096, num_experts=2048, top_k=2, moe_every=2,
    capacity_factor=1.0,      # expert capacity 2N/E for top-2 (§2.2): k·T/E
    dropout=True, param_bytes=2, grad_bytes=2, optimizer_bytes=4,    # ASSUMED: bf16 weights, Adafactor-like
    source="GShard, arXiv:2006.16668 §3 and Table 1")
# TPU v3 core: 16 GiB (half a chip's 32 GiB), ~61.5 TFLOP/s bf16.  The TPU interconnect is a 2D torus
# with no node boundary: ASSUMED 8 cores per host and the same ~70 GB/s per core inside and across hosts.
TPU_V3_2048 = Cluster("2,048 TPU v3 cores", devices=2048, memory=16 * 2 ** 30, flops=61.5e12, intra_bw=70e9,
                      inter_bw=70e9, devices_per_node=8, mfu=0.4, source="Google Cloud TPU v3; ASSUMED links")
GSHARD_PLAN = Composition(dp=2048, ep=2048, zero=0)       # one expert per core, everything else replicated

DEEPSEEK_V3 = Model(
    "DeepSeek-V3", layers=61, hidden=7168, heads=128, kv_heads=128, ffn=18432, vocab=129280,
    seq_len=4096, micro_batch=1, global_batch=15360,          # §4.2: 4K sequences; the batch ramps to 15,360
    num_experts=256, top_k=8, expert_ffn=2048, shared_experts=1, dense_layers=3, capacity_factor=None,
    router="sigmoid", max_nodes=4, head_dim=128, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
    v_head_dim=128, gated_ffn=True, dropout=False,
    source="DeepSeek-V3 Technical Report, arXiv:2412.19437, §2 and §4.2 (the MTP module left out)")
# §3.1–3.2: 2,048 H800s, 8 per node on NVLink, InfiniBand across; "16-way Pipeline Parallelism (PP), 64-way Expert
# Parallelism (EP) spanning 8 nodes, and ZeRO-1 Data Parallelism (DP)", no tensor parallelism, the dispatch and
# combine overlapped with computation (DualPipe), FP8 GEMMs (§3.3).  ASSUMED: 1F1B in place of DualPipe's
# schedule.  What the planner does not model makes it say this plan does not fit: DeepSeek recomputes the
# RMSNorms and MLA's up-projections and caches the MoE layers' activations in FP8 (§3.2.3, §3.3.3), where the
# planner keeps every activation in bf16.
H800_2048 = Cluster.preset("h800-80gb-sxm", 2048)
DEEPSEEK_V3_PLAN = Composition(dp=128, pp=16, ep=64, etp=1, zero=1, flash=True, moe_overlap=True, fp8=True,
                               grad_accumulation_fusion=True, dp_overlap=True)
