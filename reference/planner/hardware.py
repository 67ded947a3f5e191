"""Hardware presets: the figures of a GPU and its links, each next to where it was published.

``Cluster.preset(name, devices, **overrides)`` (also ``reference.planner.preset``) builds a
:class:`~.model.Cluster` of ``devices`` GPUs from one of the :data:`PRESETS` (:func:`preset_fields`).
Datasheet figures give the roofline (peak FLOP/s, memory bandwidth) and the
links; two benchmark figures say how close to the datasheet real kernels get:

    gemm_ceiling      the Maximum Achievable Matmul FLOPS (MAMF) of a brute-force shape search, over the
                      datasheet peak: what the best-shaped large GEMM reaches on that device — for the Hopper
                      presets held at the sustained, power-saturated clock a training run keeps ([MSMF]);
                      ``fp8_gemm_ceiling`` the same for FP8 GEMMs against ``fp8_flops``
    intra/inter_efficiency   a large all-reduce's bus bandwidth over the link's one-way bandwidth
    memory_efficiency a streaming kernel's bandwidth over the datasheet's
    alpha             one message step's latency: the time of a tiny all-reduce / its 2(n−1) ring steps

These are properties of the device and its network, measured by GEMM and NCCL benchmarks — never
fitted to the training runs the planner is checked against (:mod:`.runs`).

The GEMM ceiling is also a property of the software: cuBLAS gets faster on the same chip.  The presets carry
today's (MAMF, a 2024–25 stack); a run made on an older stack is timed with a benchmark of its era, passed as
an override — :data:`A100_GEMM_2022` for runs on CUDA 11 (Megatron-LM 2021: PyTorch 1.8, CUDA 11.1).

Sources (cited per figure below):
    [A100]   NVIDIA A100 Tensor Core GPU datasheet (80 GB SXM column): 312 TFLOP/s dense BF16/FP16,
             2,039 GB/s HBM2e, 80 GB, NVLink 600 GB/s (both directions together).
    [A100-WP] NVIDIA A100 Tensor Core GPU Architecture whitepaper: 108 SMs.
    [H100]   NVIDIA H100 Tensor Core GPU datasheet (SXM column): 989 TFLOP/s dense BF16 (1,979 with
             sparsity), 3.35 TB/s HBM3, 80 GB, NVLink 900 GB/s; H100 SXM5 has 132 SMs (NVIDIA Hopper
             architecture whitepaper).
    [SELENE] Narayanan et al. 2021, arXiv:2104.04473, §5: "Each cluster node has 8 NVIDIA 80-GB A100
             GPUs ... eight NVIDIA Mellanox 200Gbps HDR Infiniband HCAs for application communication".
    [DGXH100] NVIDIA DGX H100 datasheet: 8 GPUs, 8 × 400 Gb/s ConnectX-7 (400 Gb/s per GPU); Llama 3,
             arXiv:2407.21783, §3.3.1 states the same 400 Gbps per GPU.
    [MAMF]   S. Bekman, Machine Learning Engineering Open Book, compute/accelerator/README.md, "Maximum
             Achievable Matmul FLOPS comparison table", BF16 rows: A100 SXM 271.2 of 312 TFLOP/s (86.9 %),
             H100 SXM 794.5 of 989 (80.3 %).
    [MSMF]   the same book, compute/accelerator/benchmarks/ README.md, "What was measured: alone vs all-8 concurrent":
             the Maximum *Sustainable* Matmul FLOPS (the power-saturated rate a GPU holds once hot, "the rate that
             matches real training throughput") against the boost-burst MAMF on the same GPUs and stack — H200 bf16
             (the H100 SXM's compute die and 700 W limit; torch 2.14, CUDA 13), all 8 GPUs of a node × 5 rounds:
             MSMF 755.5, MAMF 852.1 TFLOP/s (88.7 %).  Its FP8 table: H100 SXM MAMF 1,402.6 of 1,979 (70.9 %).
    [MLI]    Mu Li, transformers-benchmarks (github.com/mli/transformers-benchmarks, 2022), README "Micro-Benchmarking
             Summary": A100 80 GB, matrix multiplication FP16 230 TFLOP/s (73.7 % of 312): a plain ``a @ b`` of
             two 8192 × 8192 fp16 matrices timed with torch.utils.benchmark, in the NGC PyTorch 22.07 container
             the README runs (PyTorch 1.13, CUDA 11.7).
    [NCCL]   the same book, network/README.md: nccl-tests all_reduce_perf on one A100 node — 32 KiB in
             43.83 µs, 16 GiB at 234.89 GB/s bus bandwidth (78 % of NVLink 3's 300 GB/s one way); an
             H200 node (NVLink 4, as H100) rings at 367.61 GB/s (82 % of 450); a 4-node H200 all-reduce
             moves ~37 of 50 GB/s per NIC (74 %); 32 KiB takes 40 µs (1.44 GB/s bus bandwidth).
    [HBM]    NVIDIA Developer Forums, "Trouble to Reach Peak Bandwidth of A100" (A100 80GB SXM): a read
             kernel reaches 1.80 TB/s of the datasheet's 2.04, 88 % by Nsight Compute; the thread quotes a
             GTC talk in which no kernel exceeded ~90 %.
    [FA2]    Dao, FlashAttention-2, arXiv:2307.08691, abstract: "reaching 50-73% of the theoretical
             maximum FLOPs/s on A100".  [FA3] Shah et al., FlashAttention-3, arXiv:2407.08608, abstract:
             "up to 740 TFLOPs/s (75% utilization)" in FP16 on H100, and "FlashAttention-2 achieving only
             35% utilization on the H100 GPU".
    [H100-FP8] the same H100 datasheet: FP8 Tensor Core 3,958 TFLOP/s with sparsity, 1,979 dense.
    [H800]   NVIDIA H800 Tensor Core GPU datasheet (SXM): the H100 SXM's tensor cores (FP8 3,958 and BF16
             1,979 TFLOP/s with sparsity: 1,979 and 989 dense), 80 GB HBM3 at 3.35 TB/s, NVLink 400 GB/s
             (both ways: 200 GB/s one way).
    [DSV3]   DeepSeek-AI, DeepSeek-V3 Technical Report, arXiv:2412.19437: §3.1 "2048 NVIDIA H800 GPUs. Each node
             ... contains 8 GPUs connected by NVLink and NVSwitch ... Across different nodes, InfiniBand (IB)";
             §3.2.2 "NVLink offers a bandwidth of 160 GB/s, roughly 3.2 times that of IB (50 GB/s)".
"""
from __future__ import annotations

__all__ = ["PRESETS", "preset_fields", "A100_GEMM_2022", "FA2_ON_H100", "SUSTAINED_OF_BURST"]

GB = 1e9

# [MLI] an A100's fp16 GEMM on a CUDA 11 stack (PyTorch 1.13, CUDA 11.7, 2022): 230 of 312 TFLOP/s, no shape search
A100_GEMM_2022 = 230 / 312
# [MSMF] a training run holds its GEMMs at the power-saturated clock, not the boost burst MAMF measures: the
# sustained fraction of the burst ceiling, measured on a node of H200s (the H100 SXM's die and power limit)
SUSTAINED_OF_BURST = 755.5 / 852.1

# [FA3] FlashAttention-2's kernels on an H100: 35 % of peak — the attention ceiling of a run that uses them
# (TransformerEngine with NVTE_FUSED_ATTN=0 picks the flash-attn package over cuDNN's fused attention)
FA2_ON_H100 = 0.35

_RING_STEPS_8 = 2 * (8 - 1)          # a ring all-reduce over one node's 8 GPUs takes 2(n−1) = 14 steps

# [NCCL] nccl-tests all_reduce_perf on one 8 × A100 node (-b 32k -e 16G -f 2): (bytes, bus bandwidth B/s)
_A100_NODE_SWEEP = tuple((2 ** (15 + i), gb * 1e9) for i, gb in enumerate((
    1.31, 2.45, 4.43, 7.47, 11.41, 18.00, 36.18, 72.33, 109.93, 106.16, 138.49, 171.54, 176.92, 194.07, 222.72,
    229.04, 231.41, 233.88, 234.61, 234.89)))

PRESETS: dict[str, dict] = {
    "a100-80gb-sxm": dict(
        memory=80 * GB,                       # [A100] 80 GB HBM2e
        flops=312e12,                         # [A100] dense BF16/FP16 tensor core
        hbm_bw=2039e9,                        # [A100] 2,039 GB/s
        sms=108,                              # [A100-WP]
        memory_efficiency=1.80 / 2.04,        # [HBM] a streaming kernel reaches 1.80 of 2.04 TB/s (88 %)
        intra_bw=300e9,                       # [A100] NVLink 600 GB/s both ways = 300 GB/s one way
        inter_bw=25e9,                        # [SELENE] one 200 Gb/s HDR HCA per GPU = 25 GB/s
        devices_per_node=8,                   # [SELENE]
        gemm_ceiling=271.2 / 312,             # [MAMF] A100 SXM BF16
        attention_ceiling=0.6,                # ASSUMED: inside [FA2]'s 50–73 % (forward near the top,
        #                                       backward near the bottom), as one number for both passes
        intra_efficiency=234.89 / 300,        # [NCCL] A100 node, 16 GiB all-reduce
        intra_busbw=_A100_NODE_SWEEP,         # [NCCL] the whole sweep, 32 KiB … 16 GiB
        inter_efficiency=0.74,                # [NCCL] 4-node all-reduce per NIC (measured on H200/EFA;
        #                                       ASSUMED to carry over to HDR InfiniBand)
        alpha_intra=43.83e-6 / _RING_STEPS_8,  # [NCCL] 32 KiB all-reduce on 8 A100s / 14 ring steps
        alpha_inter=43.83e-6 / _RING_STEPS_8 + 0.6e-6,   # + HDR switch latency 0.6 µs (InfiniBand Trade
        #                                       Association figure quoted in [NCCL]'s network chapter)
        memory_margin=0.1 * 80 * GB,          # ASSUMED: 10 % of HBM for the CUDA context, NCCL buffers and
        #                                       allocator fragmentation (no paper states it)
        fp8_flops=0.0,                        # [A100] no FP8 tensor cores (Ampere)
        source="A100 80GB SXM datasheet; A100 whitepaper; Narayanan et al. 2021 §5; Bekman MAMF and "
               "nccl-tests tables"),
    "h100-80gb-sxm": dict(
        memory=80 * GB,                       # [H100] 80 GB HBM3
        flops=989e12,                         # [H100] dense BF16 (1,979 is with sparsity)
        hbm_bw=3.35e12,                       # [H100] 3.35 TB/s
        sms=132,                              # [H100] SXM5
        memory_efficiency=1.80 / 2.04,        # ASSUMED: A100's measured fraction [HBM] (HBM3 on H100)
        intra_bw=450e9,                       # [H100] NVLink 900 GB/s both ways = 450 GB/s one way
        inter_bw=50e9,                        # [DGXH100] 400 Gb/s per GPU
        devices_per_node=8,                   # [DGXH100]
        gemm_ceiling=794.5 / 989 * SUSTAINED_OF_BURST,   # [MAMF] H100 SXM BF16, held at the sustained clock [MSMF]
        fp8_gemm_ceiling=1402.6 / 1979 * SUSTAINED_OF_BURST,   # [MSMF] H100 SXM FP8 MAMF, sustained (ASSUMED:
        #                                       the BF16 burst-to-sustained fraction)
        attention_ceiling=0.6,                # ASSUMED: below [FA3]'s 75 % forward peak (the backward is slower)
        intra_efficiency=367.61 / 450,        # [NCCL] NVLink 4 ring (H200 node, same NVLink as H100)
        inter_efficiency=0.74,                # [NCCL] 4-node H200 all-reduce per NIC
        alpha_intra=40e-6 / _RING_STEPS_8,    # [NCCL] 32 KiB all-reduce on 8 H200s: 32 KiB / 0.82 GB/s algbw
        alpha_inter=40e-6 / _RING_STEPS_8 + 0.6e-6,      # ASSUMED: as A100's inter-node step
        memory_margin=0.1 * 80 * GB,          # ASSUMED, as for the A100
        fp8_flops=1979e12,                    # [H100-FP8] dense FP8
        source="H100 SXM datasheet; DGX H100 datasheet; Bekman MAMF and nccl-tests tables"),
    "h800-80gb-sxm": dict(
        memory=80 * GB,                       # [H800] 80 GB HBM3
        flops=989e12,                         # [H800] dense BF16 (1,979 with sparsity)
        fp8_flops=1979e12,                    # [H800] dense FP8 (3,958 with sparsity)
        hbm_bw=3.35e12,                       # [H800] 3.35 TB/s
        sms=132,                              # ASSUMED: the H100 SXM5's 132 SMs (the H800 datasheet gives none)
        memory_efficiency=1.80 / 2.04,        # ASSUMED: A100's measured fraction [HBM], as for the H100
        intra_bw=200e9,                       # [H800] NVLink 400 GB/s both ways = 200 GB/s one way
        intra_efficiency=160 / 200,           # [DSV3] §3.2.2: NVLink "offers a bandwidth of 160 GB/s" in practice
        inter_bw=50e9,                        # [DSV3] §3.2.2: "IB (50 GB/s)" per GPU
        inter_efficiency=0.74,                # ASSUMED: [NCCL]'s multi-node fraction, as for the H100
        devices_per_node=8,                   # [DSV3] §3.1
        gemm_ceiling=794.5 / 989 * SUSTAINED_OF_BURST,   # ASSUMED: the H100 SXM's (the same tensor cores)
        fp8_gemm_ceiling=1402.6 / 1979 * SUSTAINED_OF_BURST,   # ASSUMED: the H100 SXM's
        attention_ceiling=0.6,                # ASSUMED, as for the H100
        alpha_intra=40e-6 / _RING_STEPS_8,    # ASSUMED: [NCCL]'s NVLink 4 figure, as for the H100
        alpha_inter=40e-6 / _RING_STEPS_8 + 0.6e-6,      # ASSUMED, as for the H100
        memory_margin=0.1 * 80 * GB,          # ASSUMED, as for the A100
        source="H800 SXM datasheet; DeepSeek-V3 Technical Report §3.1–3.2"),
}


def preset_fields(name: str, devices: int, **overrides) -> dict:
    """The Cluster fields of ``devices`` GPUs of kind ``name`` (a key of :data:`PRESETS`), ``overrides``
    replacing any of them, e.g. ``inter_bw=25e9`` for a slower network."""
    if name not in PRESETS:
        raise ValueError(f"unknown hardware preset {name!r}; choose one of {', '.join(PRESETS)}")
    if not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices must be a positive integer, got {devices!r}")
    return {"name": f"{devices} × {name}", "devices": devices, **PRESETS[name], **overrides}
