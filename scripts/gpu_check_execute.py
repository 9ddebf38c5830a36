"""GPU check of the SPMD executor on a 1-GPU machine: world 1, NCCL, CUDA tensors.

    python scripts/gpu_check_execute.py            # exit code 0 = every check passed; prints one line per check

What it checks (the same as the CPU tests, on CUDA):
  1. the attention mapping: the captured CPU attention op runs as an exact math formulation on CUDA (fw + bw)
     and matches F.scaled_dot_product_attention (math backend) in fp32;
  2. for llama-tiny (GQA), gpt2-tiny (tied) and moe-tiny on a 1-rank NCCL mesh, with FSDP-like and TP-like
     placements pinned: 3 SGD steps beside the single-device CUDA model (math SDPA), loss, gradients of step 1
     and parameters after 3 steps within fp32 rtol 1e-5 / atol 1e-6; collectives measured == planned (none on 1
     rank, whose sub-groups have size 1).
Runs on torch 2.11+ (uses no 2.13-only API on this path). Takes well under a minute on an H100/H200.
"""

from __future__ import annotations

import copy
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main() -> int:
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device")
        return 0
    import autopar
    from autopar.backends.spmd.local_ops import attention_bw_math, attention_fw_math
    from autopar.testing import fsdp_force, tp_force, train_and_compare
    from autopar.models import build_model, example_inputs
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, timeout=timedelta(seconds=120))
    ok = True
    t0 = time.time()
    try:
        # 1. attention mapping vs torch's math SDPA, forward and backward
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(2, 4, 7, 8, device="cuda", generator=g, requires_grad=True) for _ in range(3))
        for causal in (True, False):
            with sdpa_kernel(SDPBackend.MATH):
                ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
            go = torch.randn_like(ref)
            rq, rk, rv = torch.autograd.grad(ref, (q, k, v), go)
            with torch.no_grad():
                out, lse = attention_fw_math(q, k, v, 0.0, causal)
                dq, dk, dv = attention_bw_math(go, q, k, v, out, lse, 0.0, causal)
            errs = [(a - b).abs().max().item() for a, b in ((out, ref), (dq, rq), (dk, rk), (dv, rv))]
            good = all(
                torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in ((out, ref), (dq, rq), (dk, rk), (dv, rv))
            )
            ok &= good
            print(
                f"{'PASS' if good else 'FAIL'} attention math mapping causal={causal}: max abs err "
                f"out/dq/dk/dv {['%.1e' % e for e in errs]}"
            )

        # 2. whole training steps on a 1-rank NCCL mesh
        mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("dp",))
        cases = [
            ("llama-tiny", dict(dim=16, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_dim=24)),
            ("gpt2-tiny", dict(dim=16, n_layers=2, n_heads=2, vocab_size=64, max_seq_len=16)),
            (
                "moe-tiny",
                dict(
                    dim=16,
                    n_layers=1,
                    n_heads=2,
                    n_kv_heads=1,
                    vocab_size=64,
                    n_experts=4,
                    top_k=2,
                    moe_hidden=8,
                    dense_ffn_dim=16,
                ),
            ),
        ]
        for name, ov in cases:
            for label, forcer in (("fsdp", fsdp_force), ("tp", tp_force)):
                model = build_model(name, device="cpu", seed=1, **ov)
                x = tuple(t.cuda() for t in example_inputs(name, batch=2, seq=8, seed=2, **ov))
                pm = autopar.parallelize(model, mesh, x, force=forcer(model, (1,)))
                ref = copy.deepcopy(model).cuda()

                class MathRef(torch.nn.Module):  # the single-device model with torch's math attention
                    def __init__(self, m):
                        super().__init__()
                        self.m = m

                    def forward(self, *a):
                        with sdpa_kernel(SDPBackend.MATH):
                            return self.m(*a)

                    def named_parameters(self, *a, **k):
                        return self.m.named_parameters(*a, **k)

                    def parameters(self, *a, **k):
                        return self.m.parameters(*a, **k)

                rep = train_and_compare(pm, MathRef(ref), x, steps=3, lr=0.5)
                good = rep.ok and str(pm.parameters().__next__().device).startswith("cuda")
                ok &= good
                print(
                    f"{'PASS' if good else 'FAIL'} {name} {label}: losses {[round(a, 6) for a, _ in rep.losses]} "
                    f"max abs diff {rep.max_abs:.1e}; collectives measured {len(rep.measured)} == planned "
                    f"{len(rep.predicted)} {'' if not rep.collective_diff else rep.collective_diff} "
                    f"{rep.failures[:3]}"
                )
    except Exception as e:  # report, do not hang
        import traceback

        traceback.print_exc()
        print(f"FAIL: {type(e).__name__}: {e}")
        ok = False
    finally:
        dist.destroy_process_group()
    print(
        f"{'ALL PASS' if ok else 'SOME CHECKS FAILED'} in {time.time() - t0:.1f} s (torch {torch.__version__}, "
        f"{torch.cuda.get_device_name(0)})"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
