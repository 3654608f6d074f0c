#!/usr/bin/env python3
"""PyTorch on the work bench/cuda_kernels_bench.cpp times, for its table: the same shapes (GPT-2 124M,
8 rows of 1024 tokens), median of 10 timed calls after 3 warm-ups, each timed to the device's end.
fp32 GEMMs without TF32 (as origami's fp32 path); attention through scaled_dot_product_attention
(fp32: its fp32 kernels; bf16: FlashAttention); cross-entropy on logits from one GEMM (PyTorch keeps
all [N, V] logits; origami chunks them)."""
import statistics
import time

import torch
import torch.nn.functional as F


def median_ms(f):
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    ms = []
    for _ in range(10):
        t0 = time.perf_counter()
        f()
        torch.cuda.synchronize()
        ms.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ms)


def report(what, ms, flops):
    print(f"{what:<40} {ms:9.3f} ms  {flops / ms * 1e-9:8.1f} TFLOP/s")


def main():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda")
    print("device:", torch.cuda.get_device_name(), "torch", torch.__version__)
    B, T, C, H, D, V = 8, 1024, 768, 12, 64, 50257
    N = B * T
    for dt, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        x = torch.randn(N, C, device=dev, dtype=dt, requires_grad=True)
        w = (torch.randn(4 * C, C, device=dev) * 0.02).to(dt).requires_grad_()
        y = F.linear(x, w)
        dy = torch.randn_like(y)
        flops = 2.0 * N * C * 4 * C
        report(f"MLP up GEMM 8192x3072x768 {name}", median_ms(lambda: F.linear(x, w)), flops)
        report(f"MLP up backward (dx, dW) {name}",
               median_ms(lambda: torch.autograd.grad(y, (x, w), dy, retain_graph=True)), 2 * flops)
    fwd = 4.0 * B * H * T * T * D / 2
    for dt, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        q, k, v = (torch.randn(B, H, T, D, device=dev, dtype=dt, requires_grad=True) for _ in range(3))
        report(f"attention forward {name} (causal)",
               median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)), fwd)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        do = torch.randn_like(o)
        report(f"attention backward {name} (causal)",
               median_ms(lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True)), 2.5 * fwd)
    targets = torch.randint(0, V, (N,), device=dev)
    for dt, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        x = torch.randn(N, C, device=dev, dtype=dt, requires_grad=True)
        w = (torch.randn(V, C, device=dev) * 0.02).to(dt).requires_grad_()

        def step():
            loss = F.cross_entropy(F.linear(x, w).float(), targets)
            torch.autograd.grad(loss, (x, w))
        report(f"LM head + CE fwd+bwd {name}", median_ms(step), 3 * 2.0 * N * C * V)
    E, K, F_ = 8, 2, 1536
    for dt, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        x = torch.randn(N, C, device=dev, dtype=dt, requires_grad=True)
        gate = (torch.randn(E, C, device=dev) * 0.02).requires_grad_()
        w13 = (torch.randn(E, 2 * F_, C, device=dev) * 0.02).to(dt).requires_grad_()
        w2 = (torch.randn(E, C, F_, device=dev) * 0.02).to(dt).requires_grad_()

        def moe():  # Hugging Face Mixtral's eager loop over experts
            p = F.softmax(F.linear(x.float(), gate), dim=-1)
            wk, ek = torch.topk(p, K, dim=-1)
            wk = (wk / wk.sum(-1, keepdim=True)).to(dt)
            out = torch.zeros_like(x)
            for e in range(E):
                tok, slot = torch.where(ek == e)
                g, u = F.linear(x[tok], w13[e]).chunk(2, dim=-1)
                out = out.index_add(0, tok, F.linear(F.silu(g) * u, w2[e]) * wk[tok, slot, None])
            torch.autograd.grad(out, (x, gate, w13, w2), out.detach())
        report(f"MoE 8x top-2 F=1536 fwd+bwd {name}", median_ms(moe), 3 * 2.0 * N * K * 3 * F_ * C)
    x = torch.randn(N, C, device=dev, requires_grad=True)
    ln = torch.nn.LayerNorm(C).to(dev)

    def layernorm():
        y = ln(x)
        torch.autograd.grad(y, (x, ln.weight, ln.bias), torch.ones_like(y))
    ms = median_ms(layernorm)
    print(f"{'LayerNorm fwd+bwd 8192x768':<40} {ms:9.3f} ms  {7.0 * N * C * 4 / ms * 1e-6:8.1f} GB/s")


if __name__ == "__main__":
    main()
