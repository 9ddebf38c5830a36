"""The published runs of ../shared/reference/published_runs.md as rows for benchmarks/published.py (figures copied:
the project does not read ../shared at run or test time), each with the layout that produced it, and the rows'
own throughput metrics. Assumptions behind each choice: benchmarks/published.py's docstring."""

from __future__ import annotations

import dataclasses


_GPT = dict(vocab_size=51200, max_seq_len=2048, tie_embeddings=False, qkv_per_head=True)


@dataclasses.dataclass(frozen=True)
class Row:
    """One published measurement and the layout that produced it. layout: (pp, dp, tp, cp); metric: "megatron_tflops",
    "titan_tps" or "llama3_tflops"; unmodelled: what the run used that autopar does not price (empty: strict)."""

    name: str
    source: str
    model: str
    over: dict
    gpus: int
    layout: tuple
    batch: int  # global batch, sequences
    seq: int
    published: float
    metric: str
    cluster: str
    schedule: str = "1F1B"
    v: int = 1
    microbatches: tuple = (1,)
    layers_per_stage: tuple = ()
    recompute: object = "all"
    ac: str = "block"  # what checkpointing a block means (pipeline option ac): "op" is torchtitan's selective op SAC
    float8: bool = False
    mem_gib: float | None = None
    unmodelled: tuple = ()
    fitted: bool = False
    unfused: bool = False
    compile: bool = False  # torch.compile: priced with DeviceSpec fusion="inductor"
    async_tp: bool = False  # torch.compile's async TP: priced with DeviceSpec async_tp=True

    @property
    def strict(self) -> bool:
        return not self.unmodelled


# ---- Table A: Megatron-LM SC21 Table 1 (params B, heads, hidden, layers, t, p, GPUs, d, global batch, TFLOP/s/GPU)
MEGATRON = [
    (1.7, 24, 2304, 24, 1, 1, 32, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 32, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 32, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 32, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 32, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 32, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 24, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 15, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 9, 2520, 163),
    (1008, 160, 25600, 128, 8, 64, 3072, 6, 3072, 163),
]


def _interleave(per_rank: int) -> int:
    """Stages per rank of a Megatron interleaved row: the smallest divisor >= 2 of its blocks per rank."""
    return next((v for v in range(2, per_rank + 1) if per_rank % v == 0), 1)


def _megatron(i, r) -> Row:
    b, h, d, n, t, p, g, dp, gb, tf = r
    assert t * p * dp == g, r
    per_dp = gb // dp
    v = _interleave(n // p) if p > 1 else 1
    return Row(
        name=f"A{i + 1} gpt-{b}B t{t} p{p} d{dp}",
        source="Megatron-LM SC21 Table 1",
        model="gpt2-small",
        over=dict(_GPT, n_heads=h, dim=d, n_layers=n),
        gpus=g,
        layout=(p, dp, t, 1),
        batch=gb,
        seq=2048,
        published=tf,
        metric="megatron_tflops",
        cluster="a100",
        schedule="Interleaved1F1B" if p > 1 else "GPipe",
        v=v,
        microbatches=(per_dp,) if p > 1 else tuple(m for m in (1, 2, 4, 8, 16, 32) if per_dp % m == 0),
        layers_per_stage=tuple([n // (p * v)] * (p * v)),
        fitted=i % 2 == 0,
        unfused=True,
    )


# ---- Table B: TorchTitan (table, model, GPUs, (pp, dp, tp, cp), local batch, seq, techniques, TPS/GPU, GiB)
# Tables 5-6 (cp): the paper lists full AC and the schedule; torchtitan's docs/performance.md (January 2025, the
# same figures as its Tables 2 and 6) states how they ran: torch.compile + Float8 with full activation
# checkpointing, and the 405B rows with AsyncTP as well (DeviceSpec async_tp, autopar/cost/async_tp.py).
_CP_RUN = dict(float8=True, compile=True)
_ASYNC = dict(float8=True, compile=True, async_tp=True)
TITAN = [
    (1, "8b", 8, (1, 8, 1, 1), 2, 8192, dict(recompute="all", ac="op"), (), 6258, 81.9),
    (1, "8b", 8, (1, 8, 1, 1), 2, 8192, dict(recompute="all", ac="op", compile=True), (), 6674, 77.0),
    (1, "8b", 8, (1, 8, 1, 1), 2, 8192, dict(recompute="all", ac="op", float8=True, compile=True), (), 9409, 76.8),
    (2, "8b", 128, (1, 128, 1, 1), 2, 8192, dict(recompute="all", ac="op"), (), 5645, 67.0),
    (2, "8b", 128, (1, 128, 1, 1), 2, 8192, dict(recompute="all", ac="op", compile=True), (), 6482, 62.1),
    (2, "8b", 128, (1, 128, 1, 1), 2, 8192, dict(recompute="all", ac="op", float8=True, compile=True), (), 9319, 61.8),
    (3, "70b", 256, (1, 32, 8, 1), 16, 8192, dict(float8=True, compile=True), (), 897, 70.3),
    (3, "70b", 256, (1, 32, 8, 1), 16, 8192, _ASYNC, (), 1010, 67.7),
    (4, "405b", 512, (16, 4, 8, 1), 32, 8192, dict(float8=True, compile=True), (), 100, 78.0),
    (4, "405b", 512, (16, 4, 8, 1), 32, 8192, dict(float8=True, v=2, compile=True), (), 130, 80.3),
    (5, "8b", 8, (1, 8, 1, 1), 1, 32768, _CP_RUN, (), 3890, 83.9),
    (5, "8b", 8, (1, 4, 1, 2), 1, 65536, _CP_RUN, (), 2540, 84.2),
    (5, "8b", 8, (1, 2, 1, 4), 1, 131072, _CP_RUN, (), 1071, 84.0),
    (5, "8b", 8, (1, 1, 1, 8), 1, 262144, _CP_RUN, (), 548, 84.5),
    (6, "405b", 512, (8, 8, 8, 1), 8, 32768, _ASYNC, (), 76, 75.3),
    (6, "405b", 512, (8, 4, 8, 2), 8, 65536, _ASYNC, (), 47, 75.9),
    (6, "405b", 512, (8, 2, 8, 4), 8, 131072, _ASYNC, (), 31, 77.1),
    (6, "405b", 512, (8, 1, 8, 8), 8, 262144, _ASYNC, (), 16, 84.9),
]
_BLOCKS = {"8b": 32, "70b": 80, "405b": 126}


def _split(n_blocks: int, stages: int) -> tuple:
    """Blocks per stage, one fewer on the first and last stage where the count does not divide (Llama 3's 405B)."""
    if n_blocks % stages == 0:
        return tuple([n_blocks // stages] * stages)
    inner = -(-(n_blocks - 2 * (n_blocks // stages)) // (stages - 2))
    ends = (n_blocks - inner * (stages - 2)) // 2
    out = (ends,) + (inner,) * (stages - 2) + (n_blocks - inner * (stages - 2) - ends,)
    assert sum(out) == n_blocks, (n_blocks, stages, out)
    return out


def _titan(i, r) -> Row:
    table, size, g, layout, local, seq, opts, unmod, tps, gib = r
    pp, dp, tp, cp = layout
    opts = dict(opts)
    v = opts.pop("v", 1)
    sched = ("Interleaved1F1B" if v > 1 else "1F1B") if pp > 1 else "GPipe"
    used = [
        name for t, name in (("float8", "float8"), ("compile", "torch.compile"), ("async_tp", "async")) if opts.get(t)
    ]
    techniques = "+".join(used + [u.split()[0] for u in unmod])
    return Row(
        name=f"B{table}.{i + 1} llama3-{size} {g}xH100 pp{pp} dp{dp} tp{tp} cp{cp} seq{seq}"
        + (f" {techniques}" if techniques else "")
        + (" interleaved" if v > 1 else ""),
        source=f"TorchTitan Table {table}",
        model=f"llama3-{size}",
        over=dict(max_seq_len=seq) if seq != 8192 else {},
        gpus=g,
        layout=layout,
        batch=local * dp,
        seq=seq,
        published=tps,
        metric="titan_tps",
        cluster="h100-95g",
        schedule=sched,
        v=v,
        # pipelined: torchtitan's default micro-batch count then, one per pp rank (published.py's assumptions)
        microbatches=(pp,) if pp > 1 else tuple(m for m in (1, 2, 4, 8, 16) if local % m == 0),
        layers_per_stage=_split(_BLOCKS[size], pp * v),
        recompute=opts.get("recompute", "all"),
        ac=opts.get("ac", "block"),
        float8=opts.get("float8", False),
        compile=opts.get("compile", False),
        async_tp=opts.get("async_tp", False),
        mem_gib=gib,
        unmodelled=unmod,
        fitted=table in (1, 2) and not unmod and not opts.get("compile") and not opts.get("float8"),
    )


# ---- Table C: Llama 3 Table 4 (GPUs, TP, CP, PP, DP, seq, batch per DP, TFLOPs/GPU)
LLAMA3 = [
    (8192, 8, 1, 16, 64, 8192, 32, 430),
    (16384, 8, 1, 16, 128, 8192, 16, 400),
    (16384, 8, 16, 16, 8, 131072, 16, 380),
]


# Llama 3 ran an interleaved schedule (section 3.3.2) with one block fewer on the first and the last stage; its
# stages per rank are not published: 4 is the deepest interleaving that keeps a block in every virtual stage
# (64 virtual stages of 2 blocks, 1 on the first and the last: 126 blocks).
LLAMA3_V = 4


# Sequence-sharded attention as each source ran it (DeviceSpec.cp_attention): Llama 3 all-gathers K/V (section
# 3.3.2); TorchTitan runs torch's context_parallel ring.
CP_ATTENTION = {"Llama 3": "allgather", "TorchTitan": "ring"}


def _llama3(i, r) -> Row:
    g, tp, cp, pp, dp, seq, per_dp, tf = r
    assert tp * cp * pp * dp == g, r
    return Row(
        name=f"C{i + 1} llama3-405b {g}xH100 pp{pp} dp{dp} tp{tp} cp{cp} seq{seq}",
        source="Llama 3 Table 4",
        model="llama3-405b",
        # attention on the 8 KV heads as they are (published.py's assumptions)
        over=dict(gqa="native", **(dict(max_seq_len=seq) if seq != 8192 else {})),
        gpus=g,
        layout=(pp, dp, tp, cp),
        batch=per_dp * dp,
        seq=seq,
        published=tf,
        metric="llama3_tflops",
        cluster="h100",
        schedule="Interleaved1F1B",
        v=LLAMA3_V,
        microbatches=(per_dp,),
        layers_per_stage=_split(126, pp * LLAMA3_V),
        recompute=True,
        fitted=i == 0,
    )


ROWS = (
    [_megatron(i, r) for i, r in enumerate(MEGATRON)]
    + [_titan(i, r) for i, r in enumerate(TITAN)]
    + [_llama3(i, r) for i, r in enumerate(LLAMA3)]
)

# What the 2026-12-07 run on this branch showed beyond the ratios (hand-written: re-check after cost-model changes).
NOTES = [
    "Tensor parallelism is forced as the runs did it (published_plan.tp_force + tp_pin): column-parallel GEMM "
    "outputs feature-sharded, row-parallel ones Partial, the stream Replicate (Megatron 2021) or sequence-sharded "
    "(TorchTitan, Llama 3) on tp; Megatron rows DDP with c_attn laid out per head. Before that the planner ran the "
    "forced tp rows as FSDP over tp x dp (no activation all-reduce): A4 was 1.39x, B3.7 1.54x; now 0.91x, 0.85x.",
    "TorchTitan's H100s (500 W, torchtitan's docs/performance.md) run torch's flash SDPA as measured on H100 SXM: "
    "forward 0.33 of peak non-causal (tritonbench#97, pytorch/benchmark#2296), backward and causal kernels at "
    "FlashAttention-2's own ratios (322/370, 335/370: FlashAttention-3's figures 5-7; the ring's off-diagonal "
    "steps are non-causal kernels), and the fit scales this part's GEMM and attention figures by one compute "
    "factor (0.913): a power limit slows every tensor-core kernel. Before (FA2 at 35% both ways, a separate "
    "attention figure the 8K fitted rows left at its prior): the long-sequence rows were 1.19-1.46x (B5.11-B5.14) "
    "and 1.12-1.29x (Table 6); now 1.02 / 0.92 / 1.21 / 1.25x and 1.05 / 1.15 / 1.05 / 1.15x, the 8K rows "
    "0.86-1.14x. These figures were chosen after round two's results showed the long-sequence optimism: the "
    "held-back cp rows are not blind to the choice of the attention figures (each has a published source; none "
    "was fitted to these rows). Still not reproduced: B5.12 (64K, cp 2) ran faster per attention FLOP than B5.11 "
    "(32K) and B5.13-B5.14 slower: 0.92x next to 1.21-1.25x.",
    "AsyncTP is priced (autopar/cost/async_tp.py: a TP all_gather into a matmul's left operand and a reduce_scatter "
    "of a matmul's output, inside a node, run in chunks under the matmul, as torch's micro_pipeline_tp pass fuses "
    "them): B3.8 0.911x at the fitted figures; its modelled gain over B3.7 is 20.1% (21.39 -> 17.81 s), the "
    "published 12.6%. The solver does not see async TP (it plans as without it; the prediction prices the fused "
    "collectives).",
    "Llama 3's rows (the 700 W part, attention as this project's H200 measured causal SDPA): each rank spends its "
    "memory room per stage (passes/stage_search.py spend_room) and attention runs on GQA's 8 K/V heads as they are "
    "(gqa='native', the paper's all-gathered K/V): C1 0.946x, C2 0.848x, C3 0.781x, pessimistic; the h100 fit ends "
    "with its GEMM ceiling at its cap (0.86).",
    "Vocab-parallel cross entropy (autopar/strategies/vocab_parallel.py, 2026-12-07): the loss ops may keep the "
    "logits class-sharded (log_softmax all-reduces each row's max and sum of exp, as torch's loss_parallel, with "
    "its temporaries priced: one more fp32 logits copy at the peak each way), and the TorchTitan tp rows pin the "
    "head's logits vocab-sharded on tp as torchtitan ran them (published_plan.tp_pin). B3.7 / B3.8 went from 54 to "
    "62 GiB (70.3 / 67.7 published: within 15%); their throughput moved 0.855 / 0.911x -> 0.838 / 0.890x, and "
    "0.854 / 0.911x since 580dbb5 dropped the embedding strategies with a masked partial on two mesh dims (DTensor "
    "cannot run them; the plan without them is predicted 2% faster: the solver's objective is not the "
    "prediction). The rest of B3.7's gap (~8 GiB) is not identified.",
    "TorchTitan's pipelined runs kept every micro-batch's logits on the last stage until the next step: "
    "torch.distributed.pipelining's stage appended each output to output_chunks for step() to merge and return, "
    "with no way to opt out before return_outputs (pytorch#159251, late 2025); torchtitan's output was fp32 until "
    "e10cb9494 (2024-10-22), so Table 4 kept fp32 logits and Table 6 (the January 2025 docs' run) bf16 ones "
    "(published.py program_memory_GiB: the last rank + (m - 1) micro-batches' logits; the reported peak is the "
    "most of any rank's, as torchtitan's docs/performance.md takes it). autopar's own PipelineRunner had the same "
    "behaviour and now passes return_outputs=False. Effect: B4.9 / B4.10 40.6 / 41.1 -> 50.3 / 54.0 GiB (78 / 80.3), "
    "B6.15-B6.18 68.2 -> 68.7 GiB (75.3-84.9): B4.9, B4.10 and B6.18 stay outside 15%.",
    "Table 4's micro-batches: torchtitan's default of the time, one per pp rank (build_pipeline_schedule until "
    "torchtitan#781, 2025-01-07): 16 of 2 sequences on both rows; the interleaved row was planned with 32 of 1 "
    "before (1.075x, now 0.931x).",
    "pipeline='auto' plans all 31 rows; on Table 6 it finds layouts predicted 0.51-0.53x of the published step, on "
    "Megatron's 0.45-0.79x by dropping the full recomputation. Planning times (one row at a time, nothing else on "
    "the 2 cores): median 6.5 s, longest B6.17 26.9 s (B6.15 25.6 s, B6.16 23.6 s) on 2026-12-07's second run; "
    "the same machine gave B6.15 22.4 s in the first, and the code before that run's changes (a302feb) 28.4 s "
    "for B6.15 between them: the machine's speed moves these by ~25%. 26-32 s while the class-sharded loss "
    "ops were decisions of their own (their LP relaxations ran long in dual simplex), 19.5 s before those "
    "candidates existed: none over the issue's 30 s, the longest within 10% of it.",
    "TorchTitan's own docs/performance.md (torch 1963fc8, January 2025, the same Grand Teton H100s at 500 W) "
    "measured Tables 1-3's configurations again: 5,762 / 6,667 / 8,532 tokens/s/GPU on 8 GPUs (the paper: "
    "6,258 / 6,674 / 9,409), 5,605 / 6,514 / 8,380 on 128 (5,645 / 6,482 / 9,319), the 70B 829 / 876 (897 / "
    "1,010): one team's two measurements of a configuration differ by up to 13% (the 70B AsyncTP row). The rows "
    "here stay the paper's (../shared/reference/published_runs.md); against the later figures the fitted "
    "predictions read B1.1-B1.3 1.00 / 1.02 / 0.98x, B2.4-B2.6 1.10 / 1.13 / 1.10x, B3.7 / B3.8 0.92 / 1.05x: a "
    "10% median is about the published figures' own spread.",
    "Table 4's memory (B4.9 / B4.10 at 0.64 / 0.67x) against the same docs' 405B layout: docs/performance.md "
    "(January 2025) ran 405B on 512 H100s also as FSDP 8 x TP 8 x PP 8, 8 micro-batches of 4, full recomputation, "
    "Float8 and AsyncTP: 1F1B 100 tokens/s/GPU at 82.5 GiB, Interleaved 128 at 72.7 GiB, the paper's throughput "
    "again. Forced the same way (a hand script, not a row of this table: the fitted figures, bf16 logits kept) "
    "autopar predicts 115.9 / 151.0 (1.16 / 1.18x) at 68.7 / 75.7 GiB (0.83 / 1.04x). Table 4's pp 16 x dp 4 "
    "layout holds half the unsharded parameters and gradients per rank (19 vs 38 GB) and half the activations of "
    "pp 8 x dp 8, yet both measured 73-83 GiB: no accounting in which those terms are real fits both. Not the "
    "pipeline's receive buffers (torchtitan's stage inputs of the time are local (batch, seq / tp, dim) shards), nor "
    "reshard_after_forward (False under pp, modelled), nor fragmentation (a replay of one 1F1B stage's allocations "
    "through autopar/cost/memory.py's caching-allocator model leaves ~2.6 GiB idle). B4.9's predicted ranks "
    "(2026-12-07): a middle rank holds 11.9 GiB of sharded state, 17.8 GiB of FSDP2's gathered bf16 parameters and "
    "fp32 gradients accumulated over the micro-batches, 15 in-flight micro-batches of 0.5 GiB, 2.1 GiB of "
    "transients and 1.2 GiB idle in the allocator (40.5 GiB); the last rank 35.6 GiB plus 15 kept fp32 "
    "vocab-sharded logits of 0.98 GiB (50.3 GiB). torchtitan at 205983a09 (2024-10-10, the paper's time) gives "
    "PipelineStage local (mb, seq / tp, dim) activations and the last stage's (mb, seq, vocab) fp32 output as shape "
    "metadata only, and keeps loss_parallel on under PP: no further term.",
]


# ---- the metrics


def megatron_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """FLOPs per iteration by Megatron-LM's equation 3 (SC21), with activation recomputation."""
    return 96 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def llama3_flops_per_token(model, layers: int, dim: int, seq: int) -> float:
    """6 N + 6 l h s: N the parameters less the input embedding (a lookup, no matmul), plus causal attention."""
    n = sum(p.numel() for name, p in model.named_parameters() if "tok_embeddings" not in name)
    return 6 * n + 6 * layers * dim * seq


def metric_of(row: Row, step_s: float, model) -> float:
    """The row's own throughput metric for a step of `step_s` seconds."""
    tokens = row.batch * row.seq
    if row.metric == "titan_tps":
        return tokens / step_s / row.gpus
    if row.metric == "megatron_tflops":
        o = row.over
        f = megatron_flops(row.batch, row.seq, o["n_layers"], o["dim"], o["vocab_size"])
        return f / step_s / row.gpus / 1e12
    if row.metric == "llama3_tflops":
        layers, dim = len(model.layers), model.tok_embeddings.embedding_dim
        return tokens * llama3_flops_per_token(model, layers, dim, row.seq) / step_s / row.gpus / 1e12
    raise ValueError(f"row {row.name!r}: unknown metric {row.metric!r}")
