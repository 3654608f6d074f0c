#!/usr/bin/env python3
"""Side-by-side training benchmark: origami vs. a compact PyTorch implementation.

Identical work (same model shapes, batch, sequence length, optimizer: AdamW + global-norm clip)
on the same pinned cores with the same thread count, in fp32 and in mixed precision: origami
`--precision bf16` (bf16 GEMMs, fp32 master weights) beside PyTorch under
`torch.autocast("cpu", torch.bfloat16)` (--autocast; the PyTorch column takes the faster setting). Runs alternate (origami, PyTorch,
PyTorch with OMP_WAIT_POLICY=PASSIVE, rotated each round) for --rounds rounds; each run does
--warmup + --steps-per-round optimizer steps in a fresh process and the warm-up steps are
dropped. A run's step time is the median of its measured steps; a case's step time is the
median over rounds. Peak RSS comes from os.wait4 on each child.

FLOP convention (origami's `gflops`, src/model/model.cpp train_flops_per_token):
    FLOPs/token = 6 * (matmul parameters a token passes through, incl. the LM head and the
                       router, active experts only) + 6 * L * T * d      (causal attention)

Usage (see bench/README.md):
    /usr/bin/python3 bench/side_by_side.py [--cases a,b,c] [--rounds 3] [--steps-per-round 4]
        [--torch /usr/bin/python3[,bench/.venv/bin/python]] [--omp-wait-policy auto]

The same file is the PyTorch worker (--worker torch) and the torch.mm peak probe (--worker mm);
those modes run under the --torch interpreter.
"""
import argparse
import json
import math
import os
import statistics
import struct
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# ----------------------------------------------------------------------------------------------
# Cases
# ----------------------------------------------------------------------------------------------

CASES = {
    "a": dict(
        name="gpt2-124M B4 T64 V50257",
        B=4, T=64,
        config={"model_type": "gpt2", "vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_head": 12,
                "n_positions": 1024, "n_inner": None, "activation_function": "gelu_new",
                "layer_norm_epsilon": 1e-5, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
                "tie_word_embeddings": True},
    ),
    # (a) at T = 1024: where activations, not weights, decide the peak memory.
    "a1024": dict(
        name="gpt2-124M B4 T1024 V50257",
        B=4, T=1024,
        config=None,  # (a)'s, filled in below
    ),
    "b": dict(
        name="gpt2 L6 d384 B8 T256 V256",
        B=8, T=256,
        config={"model_type": "gpt2", "vocab_size": 256, "n_embd": 384, "n_layer": 6, "n_head": 6,
                "n_positions": 256, "n_inner": None, "activation_function": "gelu_new",
                "layer_norm_epsilon": 1e-5, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
                "tie_word_embeddings": True},
    ),
    "c": dict(
        name="mixtral L4 d256 E8k2 F512 B8 T256 V256",
        B=8, T=256,
        config={"model_type": "mixtral", "vocab_size": 256, "hidden_size": 256, "num_hidden_layers": 4,
                "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 512,
                "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 256,
                "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
                "tie_word_embeddings": False, "router_aux_loss_coef": 0.001, "sliding_window": None,
                "attention_dropout": 0.0},
    ),
}
CASES["a1024"]["config"] = CASES["a"]["config"]


def dims(cfg):
    """(V, C, L, H, KV, D, F, E, K) of an HF config, with origami's defaults."""
    if cfg["model_type"] == "gpt2":
        C = cfg["n_embd"]
        H = cfg["n_head"]
        F = cfg.get("n_inner") or 4 * C
        return cfg["vocab_size"], C, cfg["n_layer"], H, H, C // H, F, 0, 0
    C = cfg["hidden_size"]
    H = cfg["num_attention_heads"]
    KV = cfg.get("num_key_value_heads", H)
    D = cfg.get("head_dim") or C // H
    E = cfg.get("num_local_experts", 8) if cfg["model_type"] == "mixtral" else 0
    K = cfg.get("num_experts_per_tok", 2) if E else 0
    return cfg["vocab_size"], C, cfg["num_hidden_layers"], H, KV, D, cfg["intermediate_size"], E, K


def flops_per_token(cfg, T):
    """Mirror of origami's train_flops_per_token (src/model/model.cpp)."""
    V, C, L, H, KV, D, F, E, K = dims(cfg)
    attn = C * (H + 2 * KV) * D + H * D * C
    if cfg["model_type"] == "gpt2":
        mlp = 2 * C * F
    elif E:
        mlp = K * 3 * C * F + C * E
    else:
        mlp = 3 * C * F
    matmul_params = L * (attn + mlp) + C * V
    return 6.0 * matmul_params + 6.0 * L * T * H * D


# ----------------------------------------------------------------------------------------------
# Megatron indexed dataset writer (src/data/indexed_dataset.h, the "mmap" format)
# ----------------------------------------------------------------------------------------------

def write_megatron(prefix, tokens, vocab, doc_len=4096):
    """Writes PREFIX.bin/.idx: uint16 tokens when vocab <= 65535, else int32; one sequence per
    document of doc_len tokens."""
    import array
    uint16 = vocab <= 65535
    arr = array.array("H" if uint16 else "i", tokens)
    assert arr.itemsize == (2 if uint16 else 4)
    if sys.byteorder != "little":
        arr.byteswap()
    with open(prefix + ".bin", "wb") as f:
        arr.tofile(f)
    n = len(tokens)
    lengths = [min(doc_len, n - s) for s in range(0, n, doc_len)]
    S = len(lengths)
    pointers, p = [], 0
    for ln in lengths:
        pointers.append(p)
        p += ln * arr.itemsize
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", 8 if uint16 else 4))
        f.write(struct.pack("<Q", S))
        f.write(struct.pack("<Q", S + 1))
        f.write(struct.pack("<%di" % S, *lengths))
        f.write(struct.pack("<%dq" % S, *pointers))
        f.write(struct.pack("<%dq" % (S + 1), *range(S + 1)))


def read_megatron_tokens(prefix):
    """All tokens of PREFIX.bin, in order (every document back to back), as a Python array."""
    import array
    with open(prefix + ".idx", "rb") as f:
        head = f.read(34)
    assert head[:9] == b"MMIDIDX\x00\x00", prefix
    code = head[17]
    arr = array.array({8: "H", 4: "i"}[code])
    with open(prefix + ".bin", "rb") as f:
        arr.frombytes(f.read())
    if sys.byteorder != "little":
        arr.byteswap()
    return arr


# ----------------------------------------------------------------------------------------------
# PyTorch worker
# ----------------------------------------------------------------------------------------------

def torch_models():
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    has_sdpa = hasattr(F, "scaled_dot_product_attention")
    has_rms = hasattr(F, "rms_norm")

    def causal_attention(q, k, v, mask):
        # q, k, v: [B, H, T, D]
        if has_sdpa:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        T = q.shape[-2]
        att = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
        att = att.masked_fill(mask[:T, :T], float("-inf"))
        return torch.matmul(torch.softmax(att, dim=-1), v)

    class GPT2Block(nn.Module):
        def __init__(self, C, H, F_, eps):
            super().__init__()
            self.H = H
            self.ln_1 = nn.LayerNorm(C, eps=eps)
            self.c_attn = nn.Linear(C, 3 * C)
            self.c_proj = nn.Linear(C, C)
            self.ln_2 = nn.LayerNorm(C, eps=eps)
            self.c_fc = nn.Linear(C, F_)
            self.mlp_proj = nn.Linear(F_, C)

        def forward(self, x, mask):
            B, T, C = x.shape
            q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
            q, k, v = (t.view(B, T, self.H, C // self.H).transpose(1, 2) for t in (q, k, v))
            y = causal_attention(q, k, v, mask).transpose(1, 2).reshape(B, T, C)
            x = x + self.c_proj(y)
            return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    class GPT2(nn.Module):
        def __init__(self, cfg):
            super().__init__()
            V, C, L, H, _, _, F_, _, _ = dims(cfg)
            eps = cfg.get("layer_norm_epsilon", 1e-5)
            self.wte = nn.Embedding(V, C)
            self.wpe = nn.Embedding(cfg["n_positions"], C)
            self.h = nn.ModuleList([GPT2Block(C, H, F_, eps) for _ in range(L)])
            self.ln_f = nn.LayerNorm(C, eps=eps)
            self.register_buffer("mask", torch.ones(cfg["n_positions"], cfg["n_positions"], dtype=torch.bool).triu(1))
            for name, p in self.named_parameters():
                if p.dim() >= 2:
                    std = 0.02 / math.sqrt(2 * L) if name.endswith("c_proj.weight") or name.endswith("mlp_proj.weight") else 0.02
                    nn.init.normal_(p, 0.0, std)

        def forward(self, idx, targets):
            B, T = idx.shape
            x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
            for blk in self.h:
                x = blk(x, self.mask)
            logits = F.linear(self.ln_f(x), self.wte.weight)  # tied LM head
            return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))

    class RMSNorm(nn.Module):
        def __init__(self, C, eps):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(C))
            self.eps = eps

        def forward(self, x):
            if has_rms:
                return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight

    def rotate_half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    class MoE(nn.Module):
        """Mixtral sparse MLP: softmax router over E, top-K renormalised, tokens grouped by expert,
        one GEMM pair per expert (w1|w3 fused), weighted scatter-add back; Switch aux loss."""

        def __init__(self, C, F_, E, K, aux_coef):
            super().__init__()
            self.E, self.K, self.F, self.aux_coef = E, K, F_, aux_coef
            self.gate = nn.Linear(C, E, bias=False)
            self.w13 = nn.Parameter(torch.empty(E, 2 * F_, C))
            self.w2 = nn.Parameter(torch.empty(E, C, F_))

        def forward(self, x):  # x [N, C]
            N = x.shape[0]
            probs = torch.softmax(self.gate(x), dim=-1)
            w, idx = probs.topk(self.K, dim=-1)
            w = w / w.sum(dim=-1, keepdim=True)
            flat = idx.reshape(-1)
            order = flat.argsort()
            counts = torch.bincount(flat, minlength=self.E)
            tok = order // self.K
            xs = x.index_select(0, tok)
            ys, start = [], 0
            for e, cnt in enumerate(counts.tolist()):
                if cnt == 0:
                    continue
                g, u = torch.matmul(xs[start:start + cnt], self.w13[e].t()).split(self.F, dim=-1)
                ys.append(torch.matmul(F.silu(g) * u, self.w2[e].t()))
                start += cnt
            y = torch.cat(ys) * w.reshape(-1).index_select(0, order).unsqueeze(1)
            out = torch.zeros_like(x).index_add_(0, tok, y.to(x.dtype))
            f = counts.to(x.dtype) / float(N * self.K)
            aux = self.aux_coef * self.E * (f * probs.mean(0)).sum()
            return out, aux

    class MixtralLayer(nn.Module):
        def __init__(self, C, H, KV, D, F_, E, K, eps, aux_coef):
            super().__init__()
            self.H, self.KV, self.D = H, KV, D
            self.input_layernorm = RMSNorm(C, eps)
            self.qkv = nn.Linear(C, (H + 2 * KV) * D, bias=False)
            self.o_proj = nn.Linear(H * D, C, bias=False)
            self.post_attention_layernorm = RMSNorm(C, eps)
            self.moe = MoE(C, F_, E, K, aux_coef)

        def forward(self, x, cos, sin, mask):
            B, T, C = x.shape
            H, KV, D = self.H, self.KV, self.D
            q, k, v = self.qkv(self.input_layernorm(x)).split([H * D, KV * D, KV * D], dim=2)
            q = q.view(B, T, H, D).transpose(1, 2)
            k = k.view(B, T, KV, D).transpose(1, 2)
            v = v.view(B, T, KV, D).transpose(1, 2)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            if KV != H:
                k = k.repeat_interleave(H // KV, dim=1)
                v = v.repeat_interleave(H // KV, dim=1)
            y = causal_attention(q, k, v, mask).transpose(1, 2).reshape(B, T, H * D)
            x = x + self.o_proj(y)
            m, aux = self.moe(self.post_attention_layernorm(x).view(B * T, C))
            return x + m.view(B, T, C), aux

    class Mixtral(nn.Module):
        def __init__(self, cfg):
            super().__init__()
            V, C, L, H, KV, D, F_, E, K = dims(cfg)
            eps = cfg.get("rms_norm_eps", 1e-6)
            P = cfg.get("max_position_embeddings", 2048)
            self.embed = nn.Embedding(V, C)
            self.layers = nn.ModuleList([MixtralLayer(C, H, KV, D, F_, E, K, eps, cfg.get("router_aux_loss_coef", 0.001))
                                         for _ in range(L)])
            self.norm = RMSNorm(C, eps)
            self.lm_head = nn.Linear(C, V, bias=False)
            inv = 1.0 / (cfg.get("rope_theta", 10000.0) ** (torch.arange(0, D, 2).float() / D))
            freqs = torch.outer(torch.arange(P).float(), inv)
            emb = torch.cat((freqs, freqs), dim=-1)
            self.register_buffer("cos", emb.cos())
            self.register_buffer("sin", emb.sin())
            self.register_buffer("mask", torch.ones(P, P, dtype=torch.bool).triu(1))
            for p in self.parameters():
                if p.dim() >= 2:
                    nn.init.normal_(p, 0.0, 0.02)

        def forward(self, idx, targets):
            B, T = idx.shape
            x = self.embed(idx)
            cos, sin = self.cos[:T], self.sin[:T]
            aux_total = 0.0
            for layer in self.layers:
                x, aux = layer(x, cos, sin, self.mask)
                aux_total = aux_total + aux
            logits = self.lm_head(self.norm(x))
            return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1)) + aux_total

    return GPT2, Mixtral, has_sdpa, has_rms


def make_adamw(torch, model, lr, wd):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]
    kw = dict(lr=lr, betas=(0.9, 0.95), eps=1e-8)
    for mode in ("fused", "foreach"):
        try:
            opt = torch.optim.AdamW(groups, **kw, **{mode: True})
            if mode == "fused":  # some versions only refuse fused CPU at the first step
                probe = torch.nn.Parameter(torch.zeros(1))
                probe.grad = torch.zeros(1)
                torch.optim.AdamW([probe], lr=lr, fused=True).step()
            return opt, mode
        except (TypeError, RuntimeError, ValueError):
            continue
    return torch.optim.AdamW(groups, **kw), "for-loop"


def worker_torch(a):
    import torch
    torch.set_num_threads(a.threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    torch.manual_seed(1234)
    case = CASES[a.case]
    cfg, B, T = case["config"], case["B"], case["T"]
    GPT2, Mixtral, has_sdpa, has_rms = torch_models()
    import contextlib
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if a.autocast else contextlib.nullcontext
    model = (GPT2 if cfg["model_type"] == "gpt2" else Mixtral)(cfg)
    opt, opt_mode = make_adamw(torch, model, 3e-4, 0.1)
    params = [p for p in model.parameters()]
    try:
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        clip_kw = {"foreach": True}
    except TypeError:
        clip_kw = {}
    data = torch.tensor(read_megatron_tokens(a.data), dtype=torch.int64)
    nwin = (data.numel() - 1) // T
    times = []
    for step in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        rows = []
        for r in range(B):
            w = (step * B + r) % nwin  # origami's sequential WindowSampler
            rows.append(data[w * T: w * T + T + 1])
        batch = torch.stack(rows)
        opt.zero_grad(set_to_none=True)
        with autocast():
            loss = model(batch[:, :-1].contiguous(), batch[:, 1:].contiguous())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, **clip_kw)
        opt.step()
        times.append((time.perf_counter() - t0) * 1000.0)
    n_params = sum(p.numel() for p in params)
    print(json.dumps({"ms": times[a.warmup:], "warmup_ms": times[:a.warmup], "loss": float(loss),
                      "torch": torch.__version__, "threads": torch.get_num_threads(), "optimizer": opt_mode,
                      "sdpa": has_sdpa, "rms_norm": has_rms, "params": n_params,
                      "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
                      "autocast": bool(a.autocast)}))


def worker_mm(a):
    import torch
    torch.set_num_threads(a.threads)
    best = {}
    for n in (1024, 2048):
        x, y = torch.randn(n, n), torch.randn(n, n)
        torch.mm(x, y)
        t_end, rate = time.perf_counter() + 1.0, 0.0
        while time.perf_counter() < t_end:
            t0 = time.perf_counter()
            torch.mm(x, y)
            rate = max(rate, 2.0 * n ** 3 / (time.perf_counter() - t0) / 1e9)
        best[n] = round(rate, 1)
    print(json.dumps({"sizes": best, "peak_gflops": max(best.values()), "torch": torch.__version__,
                      "threads": torch.get_num_threads()}))


# ----------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------

def run_child(cmd, env, cores, timeout):
    out, err, _, wall = run_child_rss(cmd, env, cores, timeout)
    return out, err, wall


def run_child_rss(cmd, env, cores, timeout):
    """Like run_child but measures the child's peak RSS with os.wait4 (ru_maxrss, KiB on Linux).
    taskset exec()s the command, so the pid we wait for is the measured process."""
    import tempfile
    full = ["taskset", "-c", cores] + cmd
    with tempfile.TemporaryFile("w+") as fo, tempfile.TemporaryFile("w+") as fe:
        t0 = time.time()
        p = subprocess.Popen(full, env=env, stdout=fo, stderr=fe, text=True)
        deadline = t0 + timeout
        while True:
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
            if pid == p.pid:
                break
            if time.time() > deadline:
                p.kill()
                os.wait4(p.pid, 0)
                raise RuntimeError("timed out after %ds: %s" % (timeout, " ".join(full)))
            time.sleep(0.05)
        p.returncode = os.waitstatus_to_exitcode(status) if hasattr(os, "waitstatus_to_exitcode") else status >> 8
        wall = time.time() - t0
        fo.seek(0)
        fe.seek(0)
        out, err = fo.read(), fe.read()
    if p.returncode != 0:
        raise RuntimeError("exit %d: %s\n%s\n%s" % (p.returncode, " ".join(full), out[-2000:], err[-4000:]))
    return out, err, ru.ru_maxrss / 1024.0, wall


def host_isa():
    """The CPU's bf16 instruction sets, as /proc/cpuinfo names them (the table's host)."""
    try:
        flags = set(open("/proc/cpuinfo").read().split())
    except OSError:
        return "unknown CPU"
    have = [f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f in flags]
    return "CPU flags " + (", ".join(have) or "none of amx_bf16, avx512_bf16, avx512f, avx2")


def base_env(threads):
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads)
    env["OPENBLAS_NUM_THREADS"] = str(threads)
    env["MKL_NUM_THREADS"] = str(threads)
    env.pop("OMP_WAIT_POLICY", None)
    env.pop("GOMP_SPINCOUNT", None)
    return env


def last_json_line(text):
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError("no JSON in output:\n" + text[-2000:])


def build_sgemm_peak(outdir):
    exe = os.path.join(outdir, "sgemm_peak")
    src = os.path.join(HERE, "sgemm_peak.cpp")
    if not os.path.exists(exe) or os.path.getmtime(exe) < os.path.getmtime(src):
        subprocess.check_call(["g++", "-O2", "-march=native", "-std=c++17", "-pthread", src, "-ldl", "-o", exe])
    return exe


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="a,b,c", help="of a, b, c and a1024 ((a) at T = 1024)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps-per-round", type=int, default=3, help="measured steps per run")
    ap.add_argument("--warmup", type=int, default=1, help="steps dropped at the start of every run")
    ap.add_argument("--torch", default="/usr/bin/python3",
                    help="comma-separated Python interpreters with torch (each is a PyTorch column)")
    ap.add_argument("--omp-wait-policy", default="auto", choices=["auto", "default", "passive", "active"],
                    help="PyTorch's OMP_WAIT_POLICY; auto runs both default and PASSIVE each round and "
                         "uses the faster (by median) for the ratio")
    ap.add_argument("--origami-wait-policy", default="default", choices=["auto", "default", "passive", "active"],
                    help="origami's OMP_WAIT_POLICY (same meaning as --omp-wait-policy; default: unset)")
    ap.add_argument("--origami", default=os.path.join(ROOT, "build", "origami"))
    ap.add_argument("--precisions", default="fp32,bf16",
                    help="origami --precision values to run (each a column); bf16-portable is --precision bf16 with "
                         "ORIGAMI_BF16_GEMM=portable (the host's bf16 path refused), its step time over fp32's a column")
    ap.add_argument("--autocast", default="auto", choices=["auto", "on", "off"],
                    help="PyTorch under torch.autocast(cpu, bfloat16): auto runs with and without it each round")
    ap.add_argument("--cores", default="0,1")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workdir", default=os.path.join(HERE, "runs"))
    ap.add_argument("--timeout", type=int, default=600, help="seconds per child process")
    # worker modes
    ap.add_argument("--worker", choices=["torch", "mm"])
    ap.add_argument("--case")
    ap.add_argument("--data")
    ap.add_argument("--steps", type=int)
    a = ap.parse_args()
    if a.worker == "torch":
        a.autocast = a.autocast == "on"
        return worker_torch(a)
    if a.worker == "mm":
        return worker_mm(a)

    cases = [c.strip() for c in a.cases.split(",") if c.strip()]
    for c in cases:
        if c not in CASES:
            ap.error("unknown case %r (have %s)" % (c, ",".join(CASES)))
    torches = [t.strip() for t in a.torch.split(",") if t.strip()]
    policy_sets = {"auto": ["default", "PASSIVE"], "default": ["default"], "passive": ["PASSIVE"],
                   "active": ["ACTIVE"]}
    policies = policy_sets[a.omp_wait_policy]
    origami_policies = policy_sets[a.origami_wait_policy]
    if not os.path.exists(a.origami):
        sys.exit("origami binary not found at %s (cmake -S . -B build -G Ninja && ninja -C build)" % a.origami)
    os.makedirs(a.workdir, exist_ok=True)
    env0 = base_env(a.threads)
    me = os.path.abspath(__file__)
    t_start = time.time()
    load_start = os.getloadavg()
    print("side_by_side: cases %s, %d rounds x (%d warm-up + %d measured steps), cores %s, %d threads, "
          "load average %.2f %.2f %.2f" % (",".join(cases), a.rounds, a.warmup, a.steps_per_round, a.cores,
                                          a.threads, *load_start), flush=True)

    # SGEMM peak: measured before every case and at the end; the best is the peak (on a shared
    # machine a single measurement can land under someone else's build).
    sgemm_exe = build_sgemm_peak(a.workdir)
    sgemm_runs = []

    def measure_sgemm():
        out, _, _ = run_child([sgemm_exe, "--threads", str(a.threads), "--sizes", "512,768,1024,1536,2048", "--seconds", "0.5"],
                              env0, a.cores, 120)
        j = last_json_line(out)
        j["load1"] = os.getloadavg()[0]
        sgemm_runs.append(j)
        print("SGEMM (bench/sgemm_peak.cpp): %s  FMA ceiling %.1f GFLOP/s  (load %.2f)"
              % ("  ".join("%s %.1f GFLOP/s %s" % (lib, v["peak_gflops"], v["sizes"]) for lib, v in j["blas"].items()),
                 j["fma_gflops"], j["load1"]), flush=True)

    mm = {}
    for tp in torches:
        out, _, _ = run_child([tp, me, "--worker", "mm", "--threads", str(a.threads)], env0, a.cores, 120)
        mm[tp] = last_json_line(out)
        print("torch.mm peak (%s, torch %s): %.1f GFLOP/s  %s" % (tp, mm[tp]["torch"], mm[tp]["peak_gflops"],
                                                                  mm[tp]["sizes"]), flush=True)

    results = {}
    bf16_path = "bf16 GEMM path: not run"
    for c in cases:
        measure_sgemm()
        case = CASES[c]
        cfg, B, T = case["config"], case["B"], case["T"]
        V = cfg["vocab_size"]
        cdir = os.path.join(a.workdir, "case_" + c)
        os.makedirs(cdir, exist_ok=True)
        cfg_path = os.path.join(cdir, "config.json")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f, indent=1)
        prefix = os.path.join(cdir, "data")
        steps_total = a.warmup + a.steps_per_round
        n_tokens = max(1 << 16, steps_total * B * (T + 1) + 1)
        import random
        rng = random.Random(1234)
        write_megatron(prefix, [rng.randrange(V) for _ in range(n_tokens)], V)
        fpt = flops_per_token(cfg, T)
        tokens_per_step = B * T

        precisions = [x.strip() for x in a.precisions.split(",") if x.strip()]
        autocasts = {"auto": [False, True], "on": [True], "off": [False]}[a.autocast]
        runners = ([("origami", prec, pol) for prec in precisions for pol in origami_policies] +
                   [("torch", (tp, ac), pol) for tp in torches for ac in autocasts for pol in policies])
        per = {}  # label -> list of (median ms, rss MiB)
        meta = {}
        for rnd in range(a.rounds):
            order = runners[rnd % len(runners):] + runners[:rnd % len(runners)]
            for kind, what, pol in order:
                env = dict(env0)
                if pol != "default":
                    env["OMP_WAIT_POLICY"] = pol
                if kind == "origami":
                    if what == "bf16-portable":
                        env["ORIGAMI_BF16_GEMM"] = "portable"
                    label = "origami" + ("" if what == "fp32" else " " + what) + ("" if pol == "default" else " " + pol)
                    mpath = os.path.join(cdir, "metrics_r%d_%s_%s.jsonl" % (rnd, what, pol))
                    if os.path.exists(mpath):
                        os.remove(mpath)
                    cmd = [a.origami, "train", "--config", cfg_path, "--data", prefix, "--steps", str(steps_total),
                           "--micro-batch", str(B), "--global-batch", str(B), "--seq-len", str(T), "--lr", "3e-4",
                           "--weight-decay", "0.1", "--grad-clip", "1.0", "--threads", str(a.threads),
                           "--metrics", mpath, "--quiet", "--precision", what.split("-")[0]]
                    out, err, rss, wall = run_child_rss(cmd, env, a.cores, a.timeout)
                    with open(mpath) as f:
                        recs = [json.loads(l) for l in f if l.strip()]
                    ms = [r["ms"] for r in recs][a.warmup:]
                    # origami's own FLOP count must match ours.
                    g = recs[-1]
                    theirs = g["gflops"] * 1e9 * g["ms"] / 1000.0
                    ours = fpt * tokens_per_step
                    if abs(theirs - ours) > 2e-3 * ours:
                        print("  WARNING: origami counts %.4g FLOP/step, this script %.4g" % (theirs, ours))
                    meta[label] = {"loss_last": g["loss"]}
                    for l in out.splitlines():
                        if "bf16 GEMM: " in l and what == "bf16":
                            bf16_path = l[l.index("bf16 GEMM: "):]
                else:
                    tp, ac = what
                    label = "torch[%s]%s%s" % (tp, " autocast" if ac else "", "" if pol == "default" else " " + pol)
                    cmd = [tp, me, "--worker", "torch", "--case", c, "--data", prefix, "--steps",
                           str(a.steps_per_round), "--warmup", str(a.warmup), "--threads", str(a.threads),
                           "--autocast", "on" if ac else "off"]
                    out, err, rss, wall = run_child_rss(cmd, env, a.cores, a.timeout)
                    j = last_json_line(out)
                    ms = j["ms"]
                    meta[label] = {k: j[k] for k in ("torch", "optimizer", "sdpa", "rms_norm", "params", "loss", "autocast")}
                med = statistics.median(ms)
                per.setdefault(label, []).append({"ms": med, "rss_mib": rss, "wall_s": wall, "steps_ms": ms,
                                                  "load1": os.getloadavg()[0]})
                print("  case %s round %d %-40s %9.1f ms/step %9.0f tok/s  RSS %7.0f MiB  (run %.0f s, load %.2f)"
                      % (c, rnd + 1, label, med, tokens_per_step / med * 1000, rss, wall, os.getloadavg()[0]),
                      flush=True)
        summary = {}
        for label, runs in per.items():
            ms = statistics.median(r["ms"] for r in runs)
            summary[label] = {"ms": ms, "tokens_per_s": tokens_per_step / ms * 1000.0,
                              "gflops": fpt * tokens_per_step / ms / 1e6,
                              "rss_mib": max(r["rss_mib"] for r in runs), "rounds": runs, **meta.get(label, {})}
        results[c] = {"name": case["name"], "B": B, "T": T, "flops_per_token": fpt, "runs": summary}

    # Table.
    measure_sgemm()
    sgemm = max(sgemm_runs, key=lambda j: j["peak_gflops"])
    peak = sgemm["peak_gflops"]
    print()
    print("SGEMM peak on %d threads (best library and size, bench/sgemm_peak.cpp): %.1f GFLOP/s, %s (best of %d measurements: %s)"
          % (a.threads, peak, sgemm["peak_blas"], len(sgemm_runs), ", ".join("%.0f" % j["peak_gflops"] for j in sgemm_runs)))
    for lib in sgemm["blas"]:
        print("  %s: %.1f GFLOP/s (best of its measurements)" % (lib, max(j["blas"][lib]["peak_gflops"] for j in sgemm_runs)))
    print("FP32 FMA ceiling on %d threads (register-only FMA chains, bench/sgemm_peak.cpp): %.1f GFLOP/s"
          % (a.threads, max(j["fma_gflops"] for j in sgemm_runs)))
    dot = max(j.get("bf16_dot_gflops", 0) for j in sgemm_runs)
    if dot > 0:  # the most any AVX512-BF16 GEMM (no AMX) can reach here
        print("AVX512-BF16 dot-product ceiling on %d threads (register-only VDPBF16PS chains): %.1f GFLOP/s"
              % (a.threads, dot))
    for tp in torches:
        print("torch.mm peak on %d threads (%s, torch %s): %.1f GFLOP/s" % (a.threads, tp, mm[tp]["torch"],
                                                                             mm[tp]["peak_gflops"]))
    print("FLOPs/token = 6*N_matmul_active + 6*L*T*d (causal attention); medians over %d rounds of %d measured steps"
          % (a.rounds, a.steps_per_round))
    print("host: %s; %s" % (host_isa(), bf16_path))
    hdr = ("case", "origami fp32 tok/s", "fp32 GFLOP/s (% of SGEMM peak)", "origami bf16 tok/s", "bf16 / fp32",
           "fastest PyTorch tok/s",
           "bf16 / PyTorch", "bf16 GFLOP/s", "RSS fp32", "RSS bf16", "RSS PyTorch", "fastest PyTorch setting",
           "bf16-portable step time over fp32")
    pol_of = lambda lab: "PASSIVE" if lab.endswith("PASSIVE") else ("ACTIVE" if lab.endswith("ACTIVE") else "default")
    torch_name = lambda tp: os.path.basename(os.path.dirname(os.path.dirname(tp))) if ".venv" in tp else tp
    rows = []
    for c in cases:
        r = results[c]["runs"]
        best = lambda keep: min(((lab, v) for lab, v in r.items() if keep(lab)), key=lambda kv: kv[1]["ms"],
                                default=(None, None))
        _, o32 = best(lambda lab: lab.startswith("origami") and " bf16" not in lab)
        _, o16 = best(lambda lab: lab.startswith("origami bf16") and "portable" not in lab)
        _, port = best(lambda lab: lab.startswith("origami bf16-portable"))
        tlab, t = best(lambda lab: lab.startswith("torch["))
        results[c]["fastest_torch"] = tlab
        tps = lambda v: v["tokens_per_s"] if v else float("nan")
        tp = tlab[len("torch["):tlab.index("]")]
        rows.append(("(%s) %s" % (c, results[c]["name"]), "%.0f" % tps(o32),
                     "%.1f (%.0f%%)" % (o32["gflops"], 100 * o32["gflops"] / peak) if o32 else "-", "%.0f" % tps(o16),
                     "%.2fx" % (tps(o16) / tps(o32)), "%.0f" % tps(t), "%.2fx" % (tps(o16) / tps(t)),
                     "%.1f" % (o16["gflops"] if o16 else float("nan")),
                     *("%.0f MiB" % (v["rss_mib"] if v else float("nan")) for v in (o32, o16, t)),
                     "%s %s%s, wait=%s" % (t.get("torch", "?"), torch_name(tp), " autocast bf16" if t.get("autocast") else " fp32",
                                           pol_of(tlab))) +
                    (("%+.1f%%" % (100 * (port["ms"] / o32["ms"] - 1)) if port and o32 else "-",)))
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(hdr)]
    line = lambda cells: "| " + " | ".join(s.ljust(w) for s, w in zip(cells, widths)) + " |"
    print(line(hdr))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print(line(row))
    print("median ms/step of every variant: " + "; ".join(
        "(%s) %s" % (c, ", ".join("%s %.1f" % (lab, v["ms"]) for lab, v in results[c]["runs"].items()))
        for c in cases))
    load_end = os.getloadavg()
    print("load average: start %.2f %.2f %.2f, end %.2f %.2f %.2f; %d CPUs; total %.0f s"
          % (*load_start, *load_end, os.cpu_count(), time.time() - t_start))
    out = os.path.join(a.workdir, "results.json")
    with open(out, "w") as f:
        json.dump({"sgemm": sgemm, "sgemm_runs": sgemm_runs, "torch_mm": mm, "cases": results, "load_start": load_start, "load_end": load_end,
                   "args": vars(a)}, f, indent=1)
    print("raw numbers: %s" % out)


if __name__ == "__main__":
    main()
