"""What overlapping the tensor-parallel collectives with the GEMMs costs (TransformerEngine's userbuffers, the
``tp_comm_overlap`` of Megatron-Core and NeMo) — not free: the GEMM is cut into chunks that wait for their data,
communication kernels take SMs from the GEMM, and the last chunk's communication is left exposed.

With sequence parallelism a layer's tp collectives sit beside ten GEMMs (T tokens, t tensor ranks)::

    forward    qkv_fprop   all-gather the norm's output (T/t → T rows), then [T × h]·[h × qkv/t]
               proj_fprop  [T × a·d/t]·[a·d/t × h], then reduce-scatter the output (T → T/t rows)
               fc1_fprop   all-gather, then the up projection;      fc2_fprop   down projection, then reduce-scatter
    backward   proj_dgrad, fc2_dgrad   all-gather the incoming gradient, then its dgrad GEMM
               qkv_dgrad, fc1_dgrad    all-gather the saved norm output (for wgrad) during the dgrad GEMM
               qkv_wgrad, fc1_wgrad    reduce-scatter the dgrad output during the wgrad GEMM

Each is overlapped by one of three methods (TransformerEngine, ``transformer_engine/pytorch/module/base.py``,
``initialize_ub``), with a number of SMs given to the communication kernels (``num_sm``).  The GEMM is cut into
n chunks, but TransformerEngine runs them on several compute streams (``num_max_streams``), so together they
fill the SMs as the whole GEMM would: g' is the whole GEMM's time on the SMs the communication leaves it.

    ring_exchange  n = t chunks (t/2 with ``aggregate``), one per ring step: each step's shard (copy engines,
                   1 SM) arrives while the chunks before it compute.   time = max(g', (n−1)·hop + g'/n)
    pipeline       n = ``num_splits`` chunks; each chunk's reduce-scatter runs after it, on num_sm SMs, one at a
                   time.                                               time = max(g' + rs, g'/n + n·rs)
    bulk           the whole collective beside the whole GEMM.        time = max(g', c)

Whether or not TransformerEngine reserves the SMs (``set_sm_margin``), the communication kernels occupy them
while they run, so the model gives the GEMM SMs − num_sm either way.  What the plan reports as exposed tp time is
the overlapped GEMMs' time minus the same GEMMs run alone: the SMs given away, and the communication the GEMM
does not cover (the last chunk's reduce-scatter at least).

A run's :class:`TPOverlap` comes from its own configuration — NeMo's ``ub_tp_comm_overlap_cfg`` — or, when it sets
none, from TransformerEngine's defaults (:data:`TE_DEFAULTS`, :data:`TE_DEFAULTS_1`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .collectives import collective_time
from .kernels import attention_gemms, ffn_gemms, gemm_time
from .model import Cluster, Model

__all__ = ["Overlap", "TPOverlap", "TE_DEFAULTS", "TE_DEFAULTS_1", "GEMMS", "resolve", "overlapped_time",
           "tp_overlap_cost"]

GEMMS = ("qkv_fprop", "proj_fprop", "fc1_fprop", "fc2_fprop", "proj_dgrad", "fc2_dgrad", "qkv_dgrad", "fc1_dgrad",
         "qkv_wgrad", "fc1_wgrad")
METHODS = ("ring_exchange", "pipeline", "bulk")


@dataclass(frozen=True)
class Overlap:
    """How one GEMM overlaps its collective: the method, SMs for communication, chunks."""
    method: str
    num_sm: int = 16
    num_splits: int = 4             # pipeline: GEMM chunks (ring_exchange always runs t, t/2 aggregated)
    aggregate: bool = False         # ring_exchange: two shards per GEMM chunk

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"overlap method {self.method!r}: choose one of {', '.join(METHODS)}")


@dataclass(frozen=True)
class TPOverlap:
    """A run's TP overlap configuration: one :class:`Overlap` per GEMM of :data:`GEMMS`."""
    name: str
    qkv_fprop: Overlap
    proj_fprop: Overlap
    fc1_fprop: Overlap
    fc2_fprop: Overlap
    proj_dgrad: Overlap
    fc2_dgrad: Overlap
    qkv_dgrad: Overlap
    fc1_dgrad: Overlap
    qkv_wgrad: Overlap
    fc1_wgrad: Overlap
    source: str = ""

    @classmethod
    def of(cls, name: str, cfg: dict, source: str = "") -> TPOverlap:
        """From a NeMo ``ub_tp_comm_overlap_cfg``-shaped dict {gemm: {method, num_sm, num_splits, aggregate}};
        entries it leaves out take TransformerEngine's defaults."""
        fields = {g: _te_default(g) for g in GEMMS}
        for g, c in cfg.items():
            d = fields[g]
            fields[g] = Overlap(c.get("method", d.method), c.get("num_sm", d.num_sm),
                                c.get("num_splits", d.num_splits), bool(c.get("aggregate", d.aggregate)))
        return cls(name, source=source, **fields)


def _te_default(gemm: str) -> Overlap:
    """TransformerEngine's default for one GEMM: ring_exchange for the all-gathers before qkv/fc1 (forward) and
    proj/fc2 (dgrad) with 1 SM; pipeline with 16 SMs in 4 splits for proj/fc2's reduce-scatter; bulk with 16 SMs
    for the dgrad/wgrad pairs of qkv and fc1 (``initialize_ub``'s get_default_config)."""
    if gemm in ("qkv_fprop", "fc1_fprop", "proj_dgrad", "fc2_dgrad"):
        return Overlap("ring_exchange", num_sm=1)
    if gemm in ("proj_fprop", "fc2_fprop"):
        return Overlap("pipeline", num_sm=16, num_splits=4)
    return Overlap("bulk", num_sm=16)


# TransformerEngine's defaults (2.x: pipeline and bulk reserve their 16 SMs; 1.x did not, which the model treats
# alike — the communication kernels hold the SMs while they run)
TE_DEFAULTS = TPOverlap("TransformerEngine defaults", **{g: _te_default(g) for g in GEMMS},
                        source="TransformerEngine transformer_engine/pytorch/module/base.py, initialize_ub")
TE_DEFAULTS_1 = TPOverlap("TransformerEngine 1.x defaults", **{g: _te_default(g) for g in GEMMS},
                          source="TransformerEngine 1.x initialize_ub (set_sm_margin False)")


def resolve(tp_overlap) -> TPOverlap | None:
    """The configuration a Composition's ``tp_overlap`` stands for: None (off), TE's defaults (True), or itself."""
    if tp_overlap is True:
        return TE_DEFAULTS
    if not tp_overlap:
        return None
    if not isinstance(tp_overlap, TPOverlap):
        raise ValueError(f"tp_overlap={tp_overlap!r}: give True, False or a TPOverlap")
    return tp_overlap


def overlapped_time(name: str, ov: Overlap, gemm: Callable[[float, int], float], rows: float, comm_bytes: float,
                    t: int, cluster: Cluster) -> float:
    """Seconds of GEMM ``name`` (one of :data:`GEMMS`) overlapped with its tp collective by ``ov``.

    ``gemm(rows, sms)``: the GEMM's seconds at ``rows`` rows on ``sms`` SMs; ``rows``: its rows (T);
    ``comm_bytes``: the whole gathered (or reduce-scattered) tensor; ``t``: the tensor-parallel size.
    """
    left = max(1, cluster.sms - ov.num_sm)
    g = gemm(rows, left)
    if ov.method == "ring_exchange":
        n = max(1, t // 2) if ov.aggregate else t
        hop = collective_time("p2p", comm_bytes / n, 2, cluster, "intra")
        return max(g, (n - 1) * hop + g / n)
    if ov.method == "pipeline":
        n = ov.num_splits
        rs = collective_time("reduce_scatter", comm_bytes / n, t, cluster, "intra")
        return max(g + rs, g / n + n * rs)
    kind = "reduce_scatter" if name.endswith("wgrad") else "all_gather"
    return max(g, collective_time(kind, comm_bytes, t, cluster, "intra"))


def tp_overlap_cost(model: Model, cluster: Cluster, comp, tokens: float, *, moe: bool) -> tuple[float, float]:
    """(forward, backward) seconds one layer's overlapped GEMMs take beyond the same GEMMs run alone — what
    overlapping its tp collectives costs (the module docstring).  A MoE layer overlaps its attention's only (its
    experts' collectives go through the dispatcher)."""
    cfg = resolve(comp.tp_overlap)
    t, e = comp.tp, model.act_bytes
    if cfg is None or t == 1:
        return 0.0, 0.0
    gemms = attention_gemms(model, tokens, t)
    first = next(iter(gemms))                      # qkv, or MLA's first projection: the one the gather feeds
    named = {"qkv": gemms[first], "proj": gemms["proj"]}
    if not moe:
        named.update(ffn_gemms(model, tokens, model.ffn, t))
    comm = tokens * model.hidden * e                # the gathered / reduce-scattered activation, T × h

    def fprop(m, n, k):
        return lambda rows, sms: gemm_time(rows, n, k, cluster, elem=e, sms=sms, fp8=comp.fp8)

    def dgrad(m, n, k):
        return lambda rows, sms: gemm_time(rows, k, n, cluster, elem=e, sms=sms, fp8=comp.fp8)

    def wgrad(m, n, k):
        return lambda rows, sms: gemm_time(k, n, rows, cluster, elem=e, sms=sms, fp8=comp.fp8)

    passes = {"fprop": fprop, "dgrad": dgrad, "wgrad": wgrad}
    extra = {"fprop": 0.0, "dgrad": 0.0, "wgrad": 0.0}
    for gemm_name in GEMMS:
        layer, kind = gemm_name.split("_")
        if layer not in named:
            continue
        m, n, k = named[layer]
        run = passes[kind](m, n, k)
        overlapped = overlapped_time(gemm_name, getattr(cfg, gemm_name), run, tokens, comm, t, cluster)
        extra[kind] += max(0.0, overlapped - run(tokens, cluster.sms))
    return extra["fprop"], extra["dgrad"] + extra["wgrad"]
