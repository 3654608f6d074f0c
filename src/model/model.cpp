#include "model/model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "core/checked.h"
#include "core/error.h"
#include "core/memory.h"
#include "core/timer.h"
#include "kernels/cpu/gemm.h"
#include "model/layers/activation.h"
#include "model/layers/attention.h"
#include "model/layers/embedding.h"
#include "model/layers/linear.h"
#include "model/layers/lm_head.h"
#include "model/layers/norm.h"

namespace origami {

Recompute parse_recompute(const std::string& s) {
  if (s == "none") return Recompute::none;
  if (s == "selective") return Recompute::selective;
  if (s == "full") return Recompute::full;
  fail("--recompute must be none, selective or full, got '", s, "'");
}

const char* recompute_name(Recompute r) {
  switch (r) {
    case Recompute::none: return "none";
    case Recompute::selective: return "selective";
    case Recompute::full: return "full";
  }
  return "?";
}

namespace {

int64_t qkv_width(const ModelConfig& c) { return (c.num_heads + 2 * c.num_kv_heads) * c.head_dim; }

// The activation sizes of one TP rank (see ActivationShape): N tokens inside TP regions, Nl outside.
// Checked (core/checked.h): every size computed from them is, and an overflow throws SizeOverflow.
struct LocalSizes {
  Size B, T, N, Nl, C, Hl, Sl, HDl, Fl;
  Size fa, fb;  // MLP buffers per token, each layer's sized for the model's widest MLP: dense layers'
                   // gpt2 pre-activation and GELU output (F, F), llama gate|up and SwiGLU output (2F, F);
                   // qwen2_moe's shared expert (2Fs, Fs); the routed experts keep their cache instead
  int64_t mlp_bytes;  // bytes of a kept fa or fb element: 2 in a bf16 run, which keeps the up projection's
                      // output rounded to bf16 (a rounding point) and the down projection's input as that
                      // GEMM reads it (no rounding added)
  int64_t ln1_bytes, ln2_bytes;  // bytes of a kept norm output element: 2 in a bf16 run where only GEMMs
                                 // read it (no rounding added): the first norm's always, the second's in a
                                 // model without MoE layers (the router reads it in fp32)
  Size sh;         // shared expert: its output [C] and gate [1] per token outside TP regions (0: none)
  MoeSizes moe;      // MoE layers: this rank's share of the tokens (N/TP), the expert FFN over ETP
  Size moe_rows;     // the dispatcher's most expert-side rows
  CpShape core;      // the attention core (context parallelism)
  LocalSizes(const ModelConfig& c, const ActivationShape& a)
      : B(a.B), T(a.T), N(Size(a.B) * a.T), Nl(a.local_tokens()), C(c.hidden), Hl(c.num_heads / a.tp),
        Sl(qkv_width(c) / a.tp), HDl(c.num_heads / a.tp * c.head_dim), Fl(c.ffn / a.tp),
        fa(std::max(c.has_dense_layers() ? (c.is_gpt2() ? 1 : 2) * c.ffn : 0, 2 * c.shared_ffn) / a.tp),
        fb(std::max(c.has_dense_layers() ? c.ffn : 0, c.shared_ffn) / a.tp),
        mlp_bytes(a.precision == Precision::bf16 ? 2 : 4), ln1_bytes(mlp_bytes),
        ln2_bytes(a.precision == Precision::bf16 && !c.is_moe() ? 2 : 4), sh(c.shared_ffn > 0 ? C + 1 : 0),
        moe{(N / a.tp).get(), C.get(), c.expert_ffn / a.etp, c.num_experts, c.top_k, a.B,
            c.routing.capacity((N / a.tp).get(), c.top_k, c.num_experts), c.routing.pad, a.precision == Precision::bf16,
            c.packed_sequences},
        moe_rows(c.is_moe() ? TokenDispatcher::max_rows(moe.N, c.top_k, c.num_experts, a.ep, a.etp, moe.cap, moe.pad) : 0),
        core{a.B, a.T, c.num_heads / a.tp, c.num_kv_heads / a.tp, c.head_dim, a.cp, a.cp_a2a} {}
  // MoE shares cut from (and gathered into) full [N, C] buffers: TP without SP.
  bool moe_shares(const ModelConfig& c, const ActivationShape& a) const { return c.is_moe() && a.tp > 1 && !a.sp; }
};

// Bytes per layer kept outside the attention core (a MoE layer's with its cache), and inside it.
Size layer_bytes(const ModelConfig& c, const LocalSizes& s, bool moe_layer) {
  const Size stats = (c.is_gpt2() ? 4 : 2) * s.Nl;  // LayerNorm mean and rstd, RMSNorm rstd, both norms
  const Size cache = moe_layer ? MoeCache<float>::bytes(s.moe, s.moe_rows.get()) : 0;
  return 4 * (s.Nl * s.C + stats + s.N * s.Sl + s.Nl * s.sh) + (s.ln1_bytes + s.ln2_bytes) * s.Nl * s.C +
         s.mlp_bytes * s.N * (s.fa + s.fb) + cache;
}
Size core_bytes(const LocalSizes& s) { return 4 * Size(s.core.core_floats()); }

// Elements of the model's work buffers (Model::Scratch) for a batch: set_batch sizes each buffer to
// exactly this, and workspace_bytes() counts it.
int64_t vocab_rows(const ModelConfig& c, const ActivationShape& a) {  // the vocabulary slice's rows, padded
  const int64_t ways = int64_t(a.tp) * a.vocab_pp;
  return (c.vocab_size + ways - 1) / ways;
}

struct ScratchSizes {
  Size loc, full, gathered;  // SP region scratch: [Nl, C], [N, C], [N, C]
  Size ln_loc;               // bf16 runs: a norm output [Nl, C] before its rounding, or widened from it
  Size targets;              // int32 [N] each: the inputs and the targets of this rank's positions
  Size lnf, statsf;          // head stage: final norm output [N, C], mean and rstd [Nl] each
  Size d_res, d_ln, d_att, d_qkv, d_mlp_a, d_mlp_b;
  Size head;   // head stage: one chunk of logits and statistics, chunk·(Vl + 4)
  Size share;  // MoE under TP without SP: a share's input, output and input gradient, [N/TP, C] each
  Size sh_d, sh_full, sh_loc, sh_dz;  // shared expert backward: ∂/∂(its output) [Nl, C], its input
                                      // gradient [N, C] (and SP shard [Nl, C]), ∂/∂(gate logit) [Nl]
  Size moe;    // MoE work buffers, bytes (MoeScratch)
  Size cp;     // context parallelism's work buffers (ContextParallel::reserve)
  ScratchSizes(const ModelConfig& c, const ActivationShape& a, bool head_stage) {
    const LocalSizes s(c, a);
    const bool sp = a.sp;
    const int64_t Vl = vocab_rows(c, a);
    loc = sp ? s.Nl * s.C : 0, full = sp ? s.N * s.C : 0, gathered = full;
    ln_loc = a.precision == Precision::bf16 ? s.Nl * s.C : 0;
    targets = s.N;
    lnf = head_stage ? s.N * s.C : 0, statsf = head_stage ? s.Nl : 0;
    d_res = s.Nl * s.C, d_ln = s.N * s.C, d_att = s.N * s.HDl, d_qkv = s.N * s.Sl;
    d_mlp_a = s.N * s.fa, d_mlp_b = s.N * s.fb;
    head = head_stage ? lm_head_chunk_rows(s.N.get(), Vl) * (Size(Vl) + 4) : 0;
    share = s.moe_shares(c, a) ? s.moe.N * s.C : 0;
    const bool shared = c.shared_ffn > 0;
    sh_d = shared ? s.Nl * s.C : 0, sh_full = shared ? s.N * s.C : 0, sh_loc = shared && sp ? s.Nl * s.C : 0;
    sh_dz = shared ? s.Nl : 0;
    moe = c.is_moe() ? MoeScratch<float>::bytes(s.moe, s.moe_rows.get(), a.etp) : 0;
    cp = s.core.workspace_floats();
    if (a.cp_levels)  // the subgroups' ContextParallel (Model::CpLevel), at the same local shape
      for (const int d : cp_degrees(a.cp)) {
        CpShape sub = s.core;
        sub.cp = d, sub.a2a = std::gcd(a.cp_a2a, d);
        if (d < a.cp) cp += sub.workspace_floats();
      }
  }
  Size bytes() const {  // every buffer but the MoE ones holds 4-byte elements (floats, int32 targets)
    return 4 * (loc + ln_loc + full + gathered + 2 * targets + cp + lnf + 2 * statsf + d_res + d_ln + d_att + d_qkv + d_mlp_a + d_mlp_b +
                head + 3 * share + sh_d + sh_full + sh_loc + sh_dz) + moe;
  }
};

}  // namespace

// bf16: the rounding scratch of the calling thread — two operand slots and a backward's rounded dy,
// and in an MoE model the experts' backward's rounded dye or dgu rows (moe.cpp), each at most the
// most rows of a GEMM (tokens, or the experts' rows) times its widest operand; the
// LM head's rounded dlogits and input chunk — gemm_bf16's portable widening scratch (16 MiB at most),
// and every thread's attention scratch for windows of T tokens (a CP block is shorter).
Size bf16_scratch_bytes(const ModelConfig& c, const LocalSizes& s, const ActivationShape& a, bool head_stage) {
  if (a.precision != Precision::bf16) return 0;
  const int64_t Vl = vocab_rows(c, a);
  const Size rows = std::max(s.N, s.moe_rows), widest = std::max({s.C, s.Sl, s.HDl, s.fa, 2 * Size(s.moe.F)});
  const Size chunk = head_stage ? lm_head_chunk_rows(s.N.get(), Vl) : 0;
  const int64_t slots = c.is_moe() ? 4 : 3;
  return 2 * (slots * rows * widest + chunk * (Size(Vl) + s.C)) + (int64_t(16) << 20) +
         Size(a.threads) * attention_scratch_bytes(a.T, c.head_dim, a.precision);
}

int64_t workspace_bytes(const ModelConfig& c, const ActivationShape& a, const ModelPart& part) {
  const LocalSizes s(c, a);
  // TensorParallel's region buffer: under SP (or gathering MoE shares) with B > 1, the gathered or reordered [N, C].
  const Size tp_region = (a.sp || s.moe_shares(c, a)) && a.B > 1 ? 4 * s.N * s.C : 0;
  const bool head = part.head || part.vocab_parallel();  // under vocabulary parallelism every stage runs the head
  return (ScratchSizes(c, a, head).bytes() + tp_region + bf16_scratch_bytes(c, s, a, head)).get();
}

std::vector<int> slot_classes(const ModelConfig& cfg, const std::vector<LayerRange>& chunks) {
  std::vector<std::vector<bool>> shapes;  // each class's layers: MoE or not
  std::vector<int> out;
  for (const LayerRange& r : chunks) {
    std::vector<bool> shape;
    for (int l = r.begin; l < r.end; ++l) shape.push_back(cfg.is_moe_layer(l));
    const auto it = std::find(shapes.begin(), shapes.end(), shape);
    out.push_back(int(it - shapes.begin()));
    if (it == shapes.end()) shapes.push_back(std::move(shape));
  }
  return out;
}

int64_t slot_bytes(const ModelConfig& c, const ActivationShape& a, LayerRange r) {
  const LocalSizes s(c, a);
  const Size layers = r.end - r.begin, moe_layers = c.num_moe_layers(r.begin, r.end);
  const Size resid = 4 * (layers + 1) * s.Nl * s.C;
  const Size kept = (layers - moe_layers) * layer_bytes(c, s, false) + moe_layers * layer_bytes(c, s, true);
  switch (a.recompute) {
    case Recompute::none: return (resid + kept + layers * core_bytes(s)).get();
    case Recompute::selective: return (resid + kept).get();
    case Recompute::full: return resid.get();
  }
  return 0;
}

int64_t recompute_bytes(const ModelConfig& c, const ActivationShape& a) {
  const LocalSizes s(c, a);
  switch (a.recompute) {
    case Recompute::none: return 0;
    case Recompute::selective: return core_bytes(s).get();
    case Recompute::full: return (layer_bytes(c, s, c.is_moe()) + core_bytes(s)).get();  // sized for any layer
  }
  return 0;
}

double train_flops_per_token(const ModelConfig& c, int64_t T) {
  const double C = double(c.hidden), F = double(c.ffn), L = double(c.num_layers);
  const double attn = C * double(qkv_width(c)) + double(c.num_heads * c.head_dim) * C;
  const double dense_mlp = c.is_gpt2() ? 2 * C * F : 3 * C * F;
  const double moe_mlp = double(c.top_k) * 3 * C * double(c.expert_ffn) + C * double(c.num_experts) +
                         (c.shared_ffn > 0 ? 3 * C * double(c.shared_ffn) + C : 0);
  const double moe_layers = double(c.num_moe_layers(0, c.num_layers));
  const double matmul_params = L * attn + (L - moe_layers) * dense_mlp + moe_layers * moe_mlp + C * double(c.vocab_size);
  return 6 * matmul_params + 6 * L * double(T) * double(c.num_heads * c.head_dim);
}

// What one (micro-batch, chunk) forward keeps for backward; also used, with one layer, for the
// buffers recomputation rebuilds. Per-layer buffers are [layers, ...] (sizes in size_slot).
struct Model::Slot {
  std::vector<float> resid;  // [(Lc+1), Nl, C]: the input of each layer, then the chunk's output
  std::vector<float> mid;    // [., Nl, C] residual stream after the attention residual add
  std::vector<float> ln1, ln2;  // [., Nl, C] norm outputs (SP: this rank's sequence shard, gathered when used)
  std::vector<bf16> ln1_low, ln2_low;  // bf16 runs: the same as the GEMMs read them (LocalSizes::ln1_bytes)
  std::vector<float> mean1, rstd1, mean2, rstd2;  // [., Nl] (means: LayerNorm only)
  std::vector<float> qkv;    // [., N, Sl] after RoPE
  std::vector<float> mlp_a, mlp_b;  // [., N, ·] gpt2: pre-GELU, GELU out; llama and the shared expert:
                                    // gate|up, SwiGLU out (fp32 runs)
  std::vector<bf16> mlp_a_low, mlp_b_low;  // [., N, ·] bf16 runs: the same, the up projection's output
                                           // rounded (what the activation reads) and the activation's
                                           // output as the down GEMM reads it
  std::vector<float> sh_out, sh_gate;  // [., Nl, C], [., Nl] the shared expert's output and sigmoid gate
  std::vector<MoeCache<float>> moe;  // [.] MoE layers' (unsized for dense layers)
  std::vector<float> att;    // [core, N, Hl·D] attention output
  std::vector<float> lse;    // [core, B, Hl, T] (CP all-to-all: [core, A, B, Hl/A, T])
  std::vector<float> qkv_h, att_h;  // CP all-to-all: head-sharded q|k|v and output [core, A, N, ·]
  int64_t layers = 0, core_layers = 0;
  int64_t bytes() const {
    int64_t b = 0;
    for (const auto* v : {&resid, &mid, &ln1, &ln2, &mean1, &rstd1, &mean2, &rstd2, &qkv, &mlp_a, &mlp_b, &sh_out,
                          &sh_gate, &att, &lse, &qkv_h, &att_h})
      b += int64_t(v->size() * sizeof(float));
    for (const MoeCache<float>& m : moe) b += m.bytes();
    return b + int64_t((ln1_low.size() + ln2_low.size() + mlp_a_low.size() + mlp_b_low.size()) * sizeof(bf16));
  }
};

// One layer's buffers, in a slot or in the recomputation buffer.
struct Model::LayerActs {
  float *mid, *ln1, *ln2, *mean1, *rstd1, *mean2, *rstd2, *qkv, *mlp_a, *mlp_b, *sh_out, *sh_gate, *att, *lse, *qkv_h,
      *att_h;
  MoeCache<float>* moe;
  bf16 *mlp_a_low, *mlp_b_low;  // bf16 runs (mlp_a and mlp_b are then null)
  bf16 *ln1_low, *ln2_low;      // bf16 runs where LocalSizes says (ln1, ln2 are then null)
};

// Work buffers (not kept across calls): region scratch under SP, the head, backward.
struct Model::Scratch {
  // Under SP: a norm's output before the gather [Nl, C]; partial sums / gathered gradients [N, C];
  // a kept norm output gathered over the sequence for the GEMM that reads it [N, C].
  std::vector<float> loc, full, gathered;
  std::vector<float> ln_loc;  // bf16 runs: a norm output [Nl, C] before it is rounded, or widened again
  std::vector<int32_t> inputs, targets;  // [N] of this rank's positions
  std::vector<float> lnf, meanf, rstdf;  // final norm: output [N, C], statistics [Nl]
  std::vector<float> head;               // LM head chunks
  std::vector<float> d_res, d_ln, d_att, d_qkv, d_mlp_a, d_mlp_b;
  std::vector<float> share_x, share_y, share_dx;  // MoE under TP without SP: this rank's share [N/TP, C]
  std::vector<float> sh_d, sh_full, sh_loc, sh_dz;  // shared expert backward (ScratchSizes)
  MoeScratch<float> moe;
};

// Incremental decoding's cache (start_decoding): per layer the keys and values of `len` positions, per
// position its document (document masking), and the last position's id and token (the next continues
// them).
struct Model::KvCache {
  int64_t cap = 0, len = 0, width = 0;  // width: KV·D, a position's keys (and its values)
  std::vector<float> k, v;              // [L][cap][width]
  std::vector<int32_t> doc;             // [cap]
  int64_t last_pos = 0;
  int32_t last_token = 0;
  std::vector<int32_t> row;             // decode's tokens and their (unread) targets
};

Model::Model(const ModelConfig& cfg, Params& params, TensorParallel tp, ModelPart part, Recompute recompute,
             ExpertShard experts, ContextParallel cp)
    : cfg_(cfg), params_(params), experts_(experts.params ? *experts.params : params),
      dispatcher_(experts.dispatcher), tp_(std::move(tp)), cp_(std::move(cp)),
      part_(part.chunks.empty() ? ModelPart::whole(cfg.num_layers) : part), recompute_(recompute),
      scratch_(std::make_unique<Scratch>()) {
  const int64_t t = tp_.size();
  ORIGAMI_ASSERT(experts_.layout().tp == dispatcher_.etp() && (!cfg.is_moe() || cfg.expert_ffn % dispatcher_.etp() == 0));
  ORIGAMI_ASSERT(params.layout().tp == t && params.layout().tp_rank == tp_.rank());
  // (the dense FFN exists in dense layers only: a model of MoE layers alone splits its experts by ETP)
  ORIGAMI_ASSERT(cfg.num_heads % t == 0 && cfg.num_kv_heads % t == 0 && (!cfg.has_dense_layers() || cfg.ffn % t == 0) &&
                 cfg.shared_ffn % t == 0);
  Hl_ = cfg.num_heads / t, KVl_ = cfg.num_kv_heads / t, Fl_ = cfg.ffn / t;
  // Rows per rank of the vocabulary padded to a multiple of t (vocabulary parallelism: of t·stages).
  const int64_t ways = t * part_.vocab_stages;
  Vl_ = (cfg.vocab_size + ways - 1) / ways;
  vocab_begin_ = (int64_t(part_.vocab_stage) * t + tp_.rank()) * Vl_;
  vocab_valid_ = std::clamp<int64_t>(cfg.vocab_size - vocab_begin_, 0, Vl_);
  auto off = [&](const std::string& name) {
    int64_t i = params_.index(name);
    return i < 0 ? int64_t(-1) : params_.offset(size_t(i));
  };
  auto need = [&](const std::string& name) {
    int64_t o = off(name);
    ORIGAMI_ASSERT(o >= 0);
    return o;
  };
  auto need_expert = [&](const std::string& name) {
    const int64_t i = experts_.index(name);
    ORIGAMI_ASSERT(i >= 0);
    return experts_.offset(size_t(i));
  };
  layers_.resize(size_t(cfg.num_layers));
  for (int64_t l = 0; l < cfg.num_layers; ++l) {
    if (!part_.holds_layer(l)) continue;
    LayerOffsets& o = layers_[size_t(l)];
    if (cfg.is_gpt2()) {
      const std::string p = "h." + std::to_string(l) + ".";
      o.ln1_w = need(p + "ln_1.weight"), o.ln1_b = need(p + "ln_1.bias");
      o.qkv_w = need(p + "attn.c_attn.weight"), o.qkv_b = need(p + "attn.c_attn.bias");
      o.o_w = need(p + "attn.c_proj.weight"), o.o_b = need(p + "attn.c_proj.bias");
      o.ln2_w = need(p + "ln_2.weight"), o.ln2_b = need(p + "ln_2.bias");
      o.fc_w = need(p + "mlp.c_fc.weight"), o.fc_b = need(p + "mlp.c_fc.bias");
      o.proj_w = need(p + "mlp.c_proj.weight"), o.proj_b = need(p + "mlp.c_proj.bias");
    } else {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      o.ln1_w = need(p + "input_layernorm.weight");
      o.qkv_w = need(p + "self_attn.q_proj.weight");  // q|k|v contiguous: one [Sl, C] matrix
      ORIGAMI_ASSERT(need(p + "self_attn.v_proj.weight") == o.qkv_w + (Hl_ + KVl_) * cfg.head_dim * cfg.hidden);
      if (cfg.qkv_bias) {  // and their biases: one [Sl] vector
        o.qkv_b = need(p + "self_attn.q_proj.bias");
        ORIGAMI_ASSERT(need(p + "self_attn.v_proj.bias") == o.qkv_b + (Hl_ + KVl_) * cfg.head_dim);
      }
      o.o_w = need(p + "self_attn.o_proj.weight");
      o.ln2_w = need(p + "post_attention_layernorm.weight");
      if (cfg.is_moe_layer(l)) {
        // Local experts are contiguous blocks [w1 | w3 | w2] of 3·(F/ETP)·C in the experts' buffer.
        const bool qwen = cfg.type == ModelType::qwen2_moe;
        const std::string m = p + (qwen ? "mlp." : "block_sparse_moe."), x = m + "experts.";
        const int64_t first = dispatcher_.first_expert(cfg.num_experts), El = dispatcher_.local_experts(cfg.num_experts);
        o.router = need(m + "gate.weight");
        o.experts = need_expert(x + std::to_string(first) + (qwen ? ".gate_proj.weight" : ".w1.weight"));
        ORIGAMI_ASSERT(need_expert(x + std::to_string(first + El - 1) + (qwen ? ".down_proj.weight" : ".w2.weight")) -
                           o.experts == (3 * El - 1) * (cfg.expert_ffn / dispatcher_.etp()) * cfg.hidden);
        if (cfg.shared_ffn > 0) {  // gate|up contiguous, as a dense MLP's
          o.fc_w = need(m + "shared_expert.gate_proj.weight");
          ORIGAMI_ASSERT(need(m + "shared_expert.up_proj.weight") == o.fc_w + cfg.shared_ffn / t * cfg.hidden);
          o.proj_w = need(m + "shared_expert.down_proj.weight");
          o.shared_gate = need(m + "shared_expert_gate.weight");
        }
      } else {
        o.fc_w = need(p + "mlp.gate_proj.weight");  // gate|up contiguous: one [2F, C] matrix
        ORIGAMI_ASSERT(need(p + "mlp.up_proj.weight") == o.fc_w + Fl_ * cfg.hidden);
        o.proj_w = need(p + "mlp.down_proj.weight");
      }
    }
  }
  const bool vocab = part_.vocab_parallel();  // every stage: its slices of the embedding and the head
  if (part_.embedding || vocab) wte_ = need(cfg.is_gpt2() ? "wte.weight" : "model.embed_tokens.weight");
  if (part_.embedding && cfg.is_gpt2()) wpe_ = need("wpe.weight");
  if (part_.head || vocab)
    head_ = cfg.is_gpt2() || cfg.tied_embeddings ? need(cfg.is_gpt2() ? "wte.weight" : "model.embed_tokens.weight")
                                                 : need("lm_head.weight");
  if (part_.head) {
    lnf_w_ = need(cfg.is_gpt2() ? "ln_f.weight" : "model.norm.weight");
    if (cfg.is_gpt2()) lnf_b_ = need("ln_f.bias");
    head_begin_ = lnf_w_;  // final norm and (untied) LM head: the end of the buffer
  }
  // Where each layer's parameters start in the buffer (for the gradient-ready hook), and each unit's
  // ranges (for ZeRO-3's gathers): tensors grouped by param_unit.
  units_.resize(size_t(cfg.num_layers));
  auto begins = [&](const Params& buf, std::vector<Range> WeightUnit::*ranges) {
    std::vector<int64_t> begin(size_t(cfg.num_layers), INT64_MAX);
    for (size_t i = 0; i < buf.table().size(); ++i) {
      const int64_t u = param_unit(buf.table()[i].name);
      const Range r{buf.offset(i), buf.offset(i) + buf.local_numel(i)};
      WeightUnit& unit = u >= 0 ? units_[size_t(u)] : u == kEmbeddingUnit ? embedding_unit_ : head_unit_;
      if (ranges) (unit.*ranges).push_back(r);
      if (u >= 0) begin[size_t(u)] = std::min(begin[size_t(u)], r.begin);
      // The LM head reads the tied embedding (on the last stage under PP: its own copy).
      if (u == kEmbeddingUnit && ranges == &WeightUnit::dense && r.begin == head_) head_unit_.dense.push_back(r);
    }
    return begin;
  };
  layer_begin_ = begins(params_, &WeightUnit::dense);
  expert_begin_ = begins(experts_, &experts_ != &params_ ? &WeightUnit::experts : nullptr);  // a dense model: one buffer
  for (int64_t l = cfg.num_layers - 1, above = experts_.size(); l >= 0; --l)  // a layer without experts: as above it
    above = expert_begin_[size_t(l)] = std::min(expert_begin_[size_t(l)], above);
  slot_class_ = slot_classes(cfg, part_.chunks);
  free_.resize(part_.chunks.size());
  reset_expert_counts();
  if (cfg.routing.bias_rate > 0)
    router_bias_.assign(size_t(cfg.num_layers), std::vector<float>(size_t(cfg.num_experts), 0.f));
}

Model::~Model() = default;

void Model::set_precision(Precision p) {
  ORIGAMI_ASSERT(live_.empty());
  precision_ = p;
  B_ = 0;  // the slots' buffers depend on it: the next set_batch sizes them anew
  if (p != Precision::bf16) return;
  params_.keep_bf16_copy();
  // (FSSDP's experts, gathered through experts_fn_, stage their own bf16 values: none reads a copy)
  if (&experts_ != &params_ && !experts_fn_) experts_.keep_bf16_copy();
}

int64_t Model::expert_rows() const {
  return std::accumulate(expert_call_rows_.begin(), expert_call_rows_.end(), int64_t(0));
}

void Model::reset_expert_counts() {
  const size_t L = cfg_.is_moe() ? size_t(cfg_.num_layers) : 0, E = size_t(cfg_.num_experts);
  expert_counts_.assign(L, std::vector<int64_t>(E, 0));
  expert_dropped_.assign(L, 0);
  expert_near_ties_.assign(L, 0);
  expert_call_rows_.clear();
  moe_layer_s_ = 0;
  dispatcher_.times() = {};
  global_counts_.assign(L, {});
  global_frac_.clear();
}

void Model::set_router_bias(std::vector<std::vector<float>> bias, const std::string& where) {
  ORIGAMI_CHECK(bias.size() == size_t(cfg_.num_layers) && !bias.empty() && bias[0].size() == size_t(cfg_.num_experts),
                where, ": router_bias is not [layers][experts] of this model");
  router_bias_ = std::move(bias);
}

void Model::update_router_bias(const std::vector<std::vector<int64_t>>& load) {
  const double rate = cfg_.routing.bias_rate;
  for (size_t l = 0; l < router_bias_.size(); ++l) {
    if (!cfg_.is_moe_layer(int64_t(l))) continue;
    const std::vector<int64_t>& n = load.at(l);
    const double mean = double(std::accumulate(n.begin(), n.end(), int64_t(0))) / double(n.size());
    for (size_t e = 0; e < n.size(); ++e) {
      const double gap = mean - double(n[e]);  // under-loaded experts gain, over-loaded ones lose
      router_bias_[l][e] += float(rate * double((gap > 0) - (gap < 0)));
    }
  }
}

Model::Dims Model::dims() const {
  const int64_t N = B_ * T_, D = cfg_.head_dim;
  return {B_, T_, N, tp_.local_tokens(N), cfg_.hidden, D, Hl_, KVl_, Fl_, (Hl_ + 2 * KVl_) * D, Hl_ * D};
}

ActivationShape Model::activation_shape() const {
  return {B_,           T_,        tp_.size(), tp_.sp(),   recompute_, dispatcher_.etp(), dispatcher_.ep(), cp_.size(),
          cp_.a2a_size(), part_.vocab_stages, precision_, num_threads(), !levels_.empty()};
}

MoeSizes Model::moe_sizes() const { return LocalSizes(cfg_, activation_shape()).moe; }

int64_t Model::moe_rows() const { return LocalSizes(cfg_, activation_shape()).moe_rows.get(); }

void Model::size_slot(Slot& s, int64_t resid_rows, int64_t first_layer, int64_t layers, int64_t core_layers,
                      int64_t bytes) const {
  const auto [B, T, N, Nl, C, D, H, KV, F, S, HD] = dims();
  const LocalSizes ls(cfg_, activation_shape());
  auto size = [](std::vector<float>& v, Size n) { v.assign(size_t(n), 0.f); };
  allocating("the activations kept for backward", bytes, [&] {
    size(s.resid, resid_rows * Nl * C);
    size(s.mid, layers * Nl * C);
    const bool low = precision_ == Precision::bf16;
    size(s.ln1, ls.ln1_bytes == 4 ? layers * Nl * C : 0);
    size(s.ln2, ls.ln2_bytes == 4 ? layers * Nl * C : 0);
    s.ln1_low.assign(ls.ln1_bytes == 2 ? size_t(layers * Nl * C) : 0, bf16{0});
    s.ln2_low.assign(ls.ln2_bytes == 2 ? size_t(layers * Nl * C) : 0, bf16{0});
    size(s.mean1, cfg_.is_gpt2() ? layers * Nl : 0);
    size(s.mean2, cfg_.is_gpt2() ? layers * Nl : 0);
    size(s.rstd1, layers * Nl);
    size(s.rstd2, layers * Nl);
    size(s.qkv, layers * N * S);
    size(s.mlp_a, low ? 0 : layers * N * ls.fa);
    size(s.mlp_b, low ? 0 : layers * N * ls.fb);
    s.mlp_a_low.assign(low ? size_t(layers * N * ls.fa) : 0, bf16{0});
    s.mlp_b_low.assign(low ? size_t(layers * N * ls.fb) : 0, bf16{0});
    size(s.sh_out, ls.sh > 0 ? layers * Nl * C : 0);
    size(s.sh_gate, ls.sh > 0 ? layers * Nl : 0);
    s.moe.assign(cfg_.is_moe() ? size_t(layers) : 0, {});
    for (int64_t i = 0; i < int64_t(s.moe.size()); ++i)  // the recomputation buffer (first_layer −1) serves any layer
      if (first_layer < 0 || cfg_.is_moe_layer(first_layer + i)) s.moe[size_t(i)].resize(ls.moe, ls.moe_rows.get());
    size(s.att, core_layers * N * HD);
    size(s.lse, core_layers * B * H * T);
    const bool heads = cp_.a2a_size() > 1;
    size(s.qkv_h, heads ? core_layers * cp_.a2a_size() * N * cp_.shape(B, T, H, KV, D).Sa() : 0);
    size(s.att_h, heads ? core_layers * N * HD : 0);
  });
  s.layers = layers, s.core_layers = core_layers;
}

void Model::set_batch(int64_t B, int64_t T) {
  if (B == B_ && T == T_ * cp_.size()) return;
  ORIGAMI_CHECK(T <= cfg_.max_positions, "sequence length ", T, " exceeds the model's maximum positions (",
                cfg_.max_positions, ")");
  const int c = cp_.size();
  ORIGAMI_ASSERT(live_.empty() && (c == 1 || T % (2 * c) == 0) && (!tp_.sp() || T / c % tp_.size() == 0));
  // RoPE's angles for the positions the rows can hold (below T): grown to the longest rows seen, not
  // made for max_position_embeddings (16 bytes a position and frequency, 17 GB at 2^24 x 128)
  if (!cfg_.is_gpt2() && rope_.max_T < T) rope_ = RopeTable(T, cfg_.head_dim, cfg_.rope_theta);
  B_ = B, T_ = T / c;
  positions_.resize(size_t(T_));
  for (int64_t t = 0; t < T_; ++t) positions_[size_t(t)] = c == 1 ? t : cp_.position(t, T_);
  for (CpLevel& l : levels_) {
    l.positions.resize(size_t(T_));
    for (int64_t t = 0; t < T_; ++t) l.positions[size_t(t)] = l.cp.position(t, T_);  // (degree 1: t)
  }
  pos_ids_.resize(size_t(B_ * T_));
  for (int64_t b = 0; b < B_; ++b) std::copy(positions_.begin(), positions_.end(), pos_ids_.begin() + b * T_);
  docs_.assign(cfg_.masks_documents() ? size_t(B_ * T) : 0, 0);
  for (auto& f : free_) f.clear();
  recomputed_ = std::make_unique<Slot>();
  const int64_t rebuilt = recompute_bytes(cfg_, activation_shape());
  if (recompute_ == Recompute::full) size_slot(*recomputed_, 0, -1, 1, 1, rebuilt);
  if (recompute_ == Recompute::selective) size_slot(*recomputed_, 0, -1, 0, 1, rebuilt);
  recompute_bytes_ = recomputed_->bytes();
  held_bytes_ = 0;
  peak_bytes_ = act_bytes();
  Scratch& s = *scratch_;
  const ScratchSizes n(cfg_, activation_shape(), part_.head || part_.vocab_parallel());
  allocating("the model's work buffers", n.bytes().get(), [&] {
    s.loc.resize(size_t(n.loc));
    s.ln_loc.resize(size_t(n.ln_loc));
    s.full.resize(size_t(n.full));
    s.gathered.resize(size_t(n.gathered));
    s.inputs.resize(size_t(n.targets));
    s.targets.resize(size_t(n.targets));
    cp_.reserve(cp_.shape(B_, T_, Hl_, KVl_, cfg_.head_dim));
    for (CpLevel& l : levels_) l.cp.reserve(l.cp.shape(B_, T_, Hl_, KVl_, cfg_.head_dim));
    s.lnf.resize(size_t(n.lnf));
    s.meanf.resize(size_t(n.statsf));
    s.rstdf.resize(size_t(n.statsf));
    s.d_res.resize(size_t(n.d_res));
    s.d_ln.resize(size_t(n.d_ln));
    s.d_att.resize(size_t(n.d_att));
    s.d_qkv.resize(size_t(n.d_qkv));
    s.d_mlp_a.resize(size_t(n.d_mlp_a));
    s.d_mlp_b.resize(size_t(n.d_mlp_b));
    s.head.resize(size_t(n.head));
    for (auto* v : {&s.share_x, &s.share_y, &s.share_dx}) v->resize(size_t(n.share));
    s.sh_d.resize(size_t(n.sh_d));
    s.sh_full.resize(size_t(n.sh_full));
    s.sh_loc.resize(size_t(n.sh_loc));
    s.sh_dz.resize(size_t(n.sh_dz));
    if (cfg_.is_moe()) s.moe.resize(moe_sizes(), moe_rows(), dispatcher_.etp());
  });
}

Model::LayerActs Model::layer_acts(Slot& s, int64_t i) {
  const auto [B, T, N, Nl, C, D, H, KV, F, S, HD] = dims();
  const LocalSizes ls(cfg_, activation_shape());
  const int64_t fa = ls.fa.get(), fb = ls.fb.get();
  Slot& m = s.layers > 0 ? s : *recomputed_;  // per-layer buffers: kept, or rebuilt by recomputation
  const int64_t j = s.layers > 0 ? i : 0;
  Slot& k = s.core_layers > 0 ? s : *recomputed_;  // attention core
  const int64_t jc = s.core_layers > 0 ? i : 0;
  auto at = [](auto& v, int64_t idx, int64_t n) { return v.empty() ? nullptr : v.data() + idx * n; };
  return {at(m.mid, j, Nl * C),   at(m.ln1, j, Nl * C), at(m.ln2, j, Nl * C), at(m.mean1, j, Nl),
          at(m.rstd1, j, Nl),       at(m.mean2, j, Nl),   at(m.rstd2, j, Nl),   at(m.qkv, j, N * S),
          at(m.mlp_a, j, N * fa),   at(m.mlp_b, j, N * fb), at(m.sh_out, j, Nl * C), at(m.sh_gate, j, Nl),
          at(k.att, jc, N * HD),
          at(k.lse, jc, B * H * T), at(k.qkv_h, jc, cp_.a2a_size() * N * cp_.shape(B, T, H, KV, D).Sa()),
          at(k.att_h, jc, N * HD), m.moe.empty() ? nullptr : &m.moe[size_t(j)], at(m.mlp_a_low, j, N * fa),
          at(m.mlp_b_low, j, N * fb), at(m.ln1_low, j, Nl * C), at(m.ln2_low, j, Nl * C)};
}

namespace {

// out[n, :] += res[n, :] (+ bias): a residual add, with the bias of the row-parallel layer that
// produced `out` (added once, after the TP reduction).
void residual_add(float* out, const float* res, const float* bias, int64_t N, int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    float* o = out + n * C;
    const float* r = res + n * C;
    if (bias) {
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) o[c] += r[c] + bias[c];
    } else {
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) o[c] += r[c];
    }
  }
}

}  // namespace

// A norm output kept for backward, [Nl, C] (SP: this rank's sequence shard): computed into its place,
// or in a bf16 run where only GEMMs read it (kept null) into Scratch::ln_loc, rounded there in place
// and kept as its bf16 copy `low` — what those GEMMs read of it anyway, so no rounding point is
// added. Returns the computed values (valid until ln_loc is next used), which forward's GEMMs read
// through norm_gather.
float* Model::norm_keep(float* kept, bf16* low, float* mean, float* rstd, const float* x, int64_t w_off,
                        int64_t b_off) {
  float* y = kept ? kept : scratch_->ln_loc.data();
  norm_forward(y, mean, rstd, x, w_off, b_off);
  if (low) round_in_place(y, low, tp_.local_tokens(B_ * T_) * cfg_.hidden);
  return y;
}

// A norm output [Nl, C] for the GEMMs that read it, all tokens [N, C]: under SP the shard gathered
// into Scratch::gathered.
float* Model::norm_gather(float* loc) {
  float* full = tp_.full(loc, scratch_->gathered.data());
  tp_.enter(full, loc, B_, T_, cfg_.hidden);
  return full;
}

// A kept norm output read again (backward), as norm_gather gives it; a bf16 one widened first into
// Scratch::ln_loc (exactly).
float* Model::norm_read(float* kept, const bf16* low) {
  if (kept) return norm_gather(kept);
  widen_to_float(scratch_->ln_loc.data(), low, tp_.local_tokens(B_ * T_) * cfg_.hidden);
  return norm_gather(scratch_->ln_loc.data());
}

// A norm output's values for all tokens (norm_gather's result) as forward's GEMM reads them: where
// a bf16 run keeps a copy and no gather was needed (no SP), with that copy (the same tokens), so
// oneDNN's GEMMs read it rather than round the values again; else the values (exact where rounded).
Operand<float> Model::norm_operand(const float* full, const bf16* low) const {
  Operand<float> o = rounded_values<float>(full, low != nullptr);
  if (!tp_.sp()) o.low = low;
  return o;
}

// A kept norm output as backward's weight-gradient GEMM reads it, all tokens: a bf16 run's copy
// itself where no gather is needed (no SP): not widened into fp32 for oneDNN's GEMM to round again;
// else norm_read's values.
Operand<float> Model::norm_kept(float* kept, const bf16* low) {
  if (low && !tp_.sp()) return Operand<float>(nullptr, low);
  return rounded_values<float>(norm_read(kept, low), low != nullptr);
}

// LayerNorm (gpt2) or RMSNorm over this rank's Nl tokens; mean is unused by RMSNorm.
void Model::norm_forward(float* y, float* mean, float* rstd, const float* x, int64_t w_off, int64_t b_off) {
  const Dims d = dims();
  if (cfg_.is_gpt2()) layernorm_forward(y, mean, rstd, x, w(w_off), w(b_off), d.Nl, d.C, cfg_.norm_eps);
  else rmsnorm_forward(y, rstd, x, w(w_off), d.Nl, d.C, cfg_.norm_eps);
}

// dx accumulates (+=) into the residual stream's gradient; the weight (and bias) gradients accumulate.
void Model::norm_backward(float* dx, const float* dy, const float* x, const float* mean, const float* rstd,
                          int64_t w_off, int64_t b_off) {
  const Dims d = dims();
  if (cfg_.is_gpt2()) layernorm_backward(dx, g(w_off), g(b_off), dy, x, w(w_off), mean, rstd, d.Nl, d.C);
  else rmsnorm_backward(dx, g(w_off), dy, x, w(w_off), rstd, d.Nl, d.C);
}

void Model::gather_tokens(int32_t* out, const int32_t* tokens, int64_t shift) const {
  const int64_t T = T_ * row_cp(), stride = cfg_.row_stride(T);
  const int64_t at = cfg_.packed_sequences ? shift * T : shift;  // targets: the row's second half, or shifted by one
  const int32_t least = cfg_.packed_sequences && shift ? kPaddingTarget : 0;  // −1: no target, −2: padding
  for (int64_t b = 0; b < B_; ++b)
    for (int64_t t = 0; t < T_; ++t) {
      const int32_t tok = tokens[b * stride + at + position(t)];
      ORIGAMI_CHECK(tok >= least && tok < cfg_.vocab_size, "token id ", tok, " is outside the model's vocabulary of ",
                    cfg_.vocab_size);
      out[b * T_ + t] = tok;
    }
}

// Where each window's documents start: after an end-of-document token, or (packed sequences) after a
// position without a target.
void Model::set_documents(const int32_t* tokens) {
  if (!cfg_.masks_documents() || kv_) return;  // (decoding: decode() continues the cache's)
  const int64_t T = T_ * row_cp(), stride = cfg_.row_stride(T);
  std::vector<int64_t> pos(static_cast<size_t>(T));  // position ids of the whole window's positions
  for (int64_t b = 0; b < B_; ++b) {
    const int32_t* row = tokens + b * stride;
    int32_t* doc = docs_.data() + b * T;
    for (int64_t t = 0, start = 0; t < T; ++t) {
      const bool ended = t > 0 && (cfg_.packed_sequences ? row[T + t - 1] < 0 : row[t - 1] == cfg_.document_eod);
      if (ended) start = t;
      doc[t] = t == 0 ? 0 : doc[t - 1] + (start == t ? 1 : 0);
      pos[size_t(t)] = t - start;
    }
    for (int64_t t = 0; t < T_; ++t) pos_ids_[size_t(b * T_ + t)] = pos[size_t(position(t))];
  }
  if (cfg_.packed_sequences && cfg_.is_moe()) set_sequences(tokens);
}

// The MoE share's tokens (TensorParallel::share: positions [r·T/t, (r+1)·T/t) of each local row) by
// sequence: the micro-batch's sequences numbered row by row over the whole rows, so every rank sharing
// the rows (TP, and the micro-batch's CP subgroup) numbers them alike; padding (target −2) −1.
void Model::set_sequences(const int32_t* tokens) {
  const int64_t T = T_ * row_cp(), stride = cfg_.row_stride(T), Ts = T_ / tp_.size(), r = tp_.rank();
  moe_seq_.resize(size_t(B_ * Ts));
  int32_t first = 0;  // the row's first sequence
  for (int64_t b = 0; b < B_; ++b) {
    const int32_t* target = tokens + b * stride + T;
    const int32_t* doc = docs_.data() + b * T;
    for (int64_t j = 0; j < Ts; ++j) {
      const int64_t t = position(r * Ts + j);
      moe_seq_[size_t(b * Ts + j)] = target[t] == kPaddingTarget ? -1 : first + doc[t];
    }
    const int64_t real = std::find(target, target + T, kPaddingTarget) - target;  // padding is the row's tail
    first += real > 0 ? doc[real - 1] + 1 : 0;
  }
  moe_docs_ = {moe_seq_.data(), first, level_ ? level_->tokens.get() : &dispatcher_.token_group(), router_tokens_};
}

void Model::select_cp(int mb) {
  const int d = size_t(mb) < degree_mbs_.size() ? degree_mbs_[size_t(mb)] : cp_.size();
  level_ = nullptr;
  for (CpLevel& l : levels_)
    if (l.degree == d) level_ = &l;
  ORIGAMI_ASSERT(level_ || d == cp_.size());
}

double Model::cp_bytes_sent() const {
  double bytes = cp_.bytes_sent();
  for (const CpLevel& l : levels_) bytes += l.cp.bytes_sent();
  return bytes;
}

CpCounters Model::cp_counters() const {
  CpCounters c = cp_.counters();
  for (const CpLevel& l : levels_) {
    const CpCounters& k = l.cp.counters();
    c.transfer_s += k.transfer_s, c.wait_s += k.wait_s, c.pairs += k.pairs, c.tiles += k.tiles;
  }
  return c;
}

double Model::level_token_bytes() const {
  double bytes = 0;
  for (const CpLevel& l : levels_) bytes += l.tokens->bytes_sent();
  return bytes;
}

void Model::reset_attention_counters() {
  cp_.reset_counters();
  for (CpLevel& l : levels_) l.cp.reset_counters(), l.tokens->reset_bytes();
}

// Vocab-parallel embedding: every rank looks up its vocabulary rows for all N tokens (positions
// added on TP rank 0 only); under vocabulary parallelism the partial embeddings [N, C] are first
// summed over the pipeline group. The region exit sums them over TP into x0 (null on a stage that
// only contributes its rows).
void Model::embed(float* x0, const int32_t* tokens) {
  const int64_t B = B_, T = T_, C = cfg_.hidden;
  gather_tokens(scratch_->inputs.data(), tokens, 0);
  float* part = x0 ? tp_.full(x0, scratch_->full.data()) : scratch_->lnf.data();
  embedding_forward(part, scratch_->inputs.data(), T, w(wte_), tp_.rank() == 0 ? w(wpe_) : nullptr, B, T, C,
                    vocab_begin_, Vl_, pos_ids_.data());
  if (vocab_) vocab_->all_reduce(part, B * T * C);
  if (x0) tp_.exit(x0, part, B, T, C);
}

// The embedding's backward from ∂/∂(its rows) d_x0 [N, C]: this rank's vocabulary rows (and positions).
void Model::embed_backward(const float* d_x0, const int32_t* tokens) {
  gather_tokens(scratch_->inputs.data(), tokens, 0);
  embedding_backward(g(wte_), g(wpe_), d_x0, scratch_->inputs.data(), T_, B_, T_, cfg_.hidden, vocab_begin_, Vl_,
                     pos_ids_.data());
}

// One decoder layer: out = mid + mlp(norm2(mid)), mid = in + attn(norm1(in)). `losses` (null when
// recomputing) receives the router losses and the expert counts.
void Model::layer_forward(int64_t l, const LayerActs& a, const float* in, float* out, Losses* losses) {
  const ModelConfig& c = cfg_;
  const LayerOffsets& o = layers_[size_t(l)];
  Scratch& s = *scratch_;
  TensorParallel& tp = tp_;
  const auto [B, T, N, Nl, C, D, H, KV, F, S, HD] = dims();
  const bool gpt2 = c.is_gpt2();
  const WeightLayout lay = gpt2 ? WeightLayout::in_out : WeightLayout::out_in;
  // Attention: column-parallel QKV (this rank's heads), row-parallel output projection. Under SP the
  // norm output is kept as this rank's sequence shard and gathered for the GEMM (backward gathers it
  // again: Megatron's sequence parallelism keeps no [N, C] activation).
  float* ln1 = norm_gather(norm_keep(a.ln1, a.ln1_low, a.mean1, a.rstd1, in, o.ln1_w, o.ln1_b));
  linear_forward(a.qkv, norm_operand(ln1, a.ln1_low), mw(o.qkv_w), w(o.qkv_b), N, C, S, lay);
  if (!gpt2) rope_forward(a.qkv, rope_, B, T, H, KV, D, pos_ids_.data());
  if (kv_) {
    cached_attention(l, a.qkv, a.att, a.lse);
  } else {
    // bf16 on fp32 tiles: the core rounds q, k and v anyway and nothing else reads them (cp_shape).
    const CpShape shape = cp_shape();
    if (shape.qkv_exact) round_in_place(a.qkv, nullptr, N * S);
    cp_now().forward(a.att, a.lse, a.qkv_h, a.att_h, a.qkv, shape, docs());
  }
  float* part = tp.full(a.mid, s.full.data());
  linear_forward(part, a.att, mw(o.o_w), static_cast<const float*>(nullptr), N, HD, C, lay);
  tp.exit(a.mid, part, B, T, C);
  residual_add(a.mid, in, w(o.o_b), Nl, C);
  float* ln2 = norm_keep(a.ln2, a.ln2_low, a.mean2, a.rstd2, a.mid, o.ln2_w, o.ln2_b);
  if (!c.is_moe_layer(l)) {
    mlp_forward(out, norm_operand(norm_gather(ln2), a.ln2_low), a, o, F);
    residual_add(out, a.mid, w(o.proj_b), Nl, C);
    return;
  }
  moe_layer_forward(l, a, out, losses);
  if (c.shared_ffn > 0) {  // out += sigmoid(ln2·w_gate)·shared(ln2), per token of this rank
    mlp_forward(a.sh_out, norm_gather(ln2), a, o, c.shared_ffn / tp.size());
    const float* wg = w(o.shared_gate);
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < Nl; ++n) {
      const float* x = a.ln2 + n * C;
      float z = 0;
      for (int64_t ch = 0; ch < C; ++ch) z += x[ch] * wg[ch];
      const float gate = a.sh_gate[n] = 1.f / (1.f + std::exp(-z));
      float* o_n = out + n * C;
      const float* y = a.sh_out + n * C;
      for (int64_t ch = 0; ch < C; ++ch) o_n[ch] += gate * y[ch];
    }
  }
  residual_add(out, a.mid, nullptr, Nl, C);
}

// y [Nl, C] ← the MLP of F features (this rank's) on ln2 = norm2(mid) of all tokens [N, C]
// (norm_gather's): column-parallel up (gate|up),
// row-parallel down; gpt2's GELU MLP or a SwiGLU one (llama, qwen2_moe's dense layers and shared expert).
void Model::mlp_forward(float* y, Operand<float> ln2, const LayerActs& a, const LayerOffsets& o, int64_t F) {
  Scratch& s = *scratch_;
  TensorParallel& tp = tp_;
  const int64_t B = B_, T = T_, N = B * T, C = cfg_.hidden;
  const WeightLayout lay = cfg_.is_gpt2() ? WeightLayout::in_out : WeightLayout::out_in;
  float* part = tp.full(y, s.full.data());
  // bf16: the up projection's output comes into backward's scratch; both are kept in bf16.
  const MlpActivations acts{a.mlp_a ? a.mlp_a : s.d_mlp_a.data(), a.mlp_b, a.mlp_a_low, a.mlp_b_low};
  const int64_t Fa = cfg_.is_gpt2() ? F : 2 * F;
  linear_forward(acts.pre, ln2, mw(o.fc_w), cfg_.is_gpt2() ? w(o.fc_b) : nullptr, N, C, Fa, lay);
  mlp_activation_forward(cfg_.is_gpt2(), acts, N, F);
  linear_forward(part, {a.mlp_b, a.mlp_b_low}, mw(o.proj_w), static_cast<const float*>(nullptr), N, F, C, lay);
  tp.exit(y, part, B, T, C);
}

// mlp_forward's backward from d_y [Nl, C]: d_local [Nl, C] ← ∂/∂norm2(mid) (overwritten), through
// d_full [N, C] (the same buffer without SP); the weights' gradients accumulate.
void Model::mlp_backward(float* d_local, float* d_full, const float* d_y, const LayerActs& a, const LayerOffsets& o,
                         int64_t F) {
  Scratch& s = *scratch_;
  TensorParallel& tp = tp_;
  const int64_t B = B_, T = T_, N = B * T, C = cfg_.hidden;
  const WeightLayout lay = cfg_.is_gpt2() ? WeightLayout::in_out : WeightLayout::out_in;
  // SP: the kept shard gathered again.
  const Operand<float> ln2 = norm_kept(a.ln2, a.ln2_low);
  const float* d_out = tp.exit_backward(s.full.data(), d_y, B, T, C);  // all tokens
  linear_backward(s.d_mlp_b.data(), g(o.proj_w), g(o.proj_b), d_out, {a.mlp_b, a.mlp_b_low}, mw(o.proj_w), N, F, C,
                  lay);
  const int64_t Fa = cfg_.is_gpt2() ? F : 2 * F;
  const Mat<float> d_pre = mlp_activation_backward(cfg_.is_gpt2(), s.d_mlp_a.data(), cfg_.is_gpt2() ? g(o.fc_b) : nullptr,
                                                   s.d_mlp_b.data(), {a.mlp_a, a.mlp_b, a.mlp_a_low, a.mlp_b_low}, N, F);
  linear_backward_gemms(d_full, g(o.fc_w), d_pre, ln2, mw(o.fc_w), N, C, Fa, lay);
  tp.enter_backward(d_local, d_full, B, T, C);
}

// d_res: ∂/∂out on entry, ∂/∂in on return (this rank's tokens).
void Model::layer_backward(int64_t l, const LayerActs& a, const float* in, float* d_res, float loss_scale) {
  const ModelConfig& c = cfg_;
  const LayerOffsets& o = layers_[size_t(l)];
  Scratch& s = *scratch_;
  TensorParallel& tp = tp_;
  const auto [B, T, N, Nl, C, D, H, KV, F, S, HD] = dims();
  const bool gpt2 = c.is_gpt2();
  const WeightLayout lay = gpt2 ? WeightLayout::in_out : WeightLayout::out_in;
  float* d_ln_loc = tp.local(s.d_ln.data(), s.loc.data());
  // MLP branch: out = mid + mlp(norm2(mid)).
  if (!c.is_moe_layer(l)) {
    mlp_backward(d_ln_loc, s.d_ln.data(), d_res, a, o, F);
  } else {
    moe_layer_backward(l, a, d_ln_loc, d_res, loss_scale);
    if (c.shared_ffn > 0) {
      // gate·shared: ∂/∂shared = gate·d_out; ∂/∂(gate logit) = (d_out·shared)·gate·(1 − gate).
      float *d_sh = s.sh_d.data(), *dz = s.sh_dz.data();
#pragma omp parallel for schedule(static)
      for (int64_t n = 0; n < Nl; ++n) {
        const float* dn = d_res + n * C;
        const float* y = a.sh_out + n * C;
        const float gate = a.sh_gate[n];
        float dot = 0;
        for (int64_t ch = 0; ch < C; ++ch) d_sh[n * C + ch] = gate * dn[ch], dot += dn[ch] * y[ch];
        dz[n] = dot * gate * (1.f - gate);
      }
      // The gate's weight (replicated; under SP a partial sum over the sequence shards) and input.
      gemm<float>(true, false, 1, C, Nl, 1.f, dz, 1, a.ln2, C, 1.f, g(o.shared_gate), C);
      gemm<float>(false, false, Nl, C, 1, 1.f, dz, 1, w(o.shared_gate), C, 1.f, d_ln_loc, C);
      float* sh_loc = tp.local(s.sh_full.data(), s.sh_loc.data());
      mlp_backward(sh_loc, s.sh_full.data(), d_sh, a, o, c.shared_ffn / tp.size());
#pragma omp parallel for simd schedule(static)
      for (int64_t i = 0; i < Nl * C; ++i) d_ln_loc[i] += sh_loc[i];
    }
  }
  norm_backward(d_res, d_ln_loc, a.mid, a.mean2, a.rstd2, o.ln2_w, o.ln2_b);
  // Attention branch: mid = in + o_proj(attn(qkv(norm1(in)))); d_res is now ∂/∂mid.
  if (recompute_ == Recompute::selective) cp_now().forward(a.att, a.lse, a.qkv_h, a.att_h, a.qkv, cp_shape(), docs());
  const float* d_out = tp.exit_backward(s.full.data(), d_res, B, T, C);
  linear_backward(s.d_att.data(), g(o.o_w), g(o.o_b), d_out, a.att, mw(o.o_w), N, HD, C, lay);
  cp_now().backward(s.d_qkv.data(), s.d_att.data(), a.qkv, a.lse, a.qkv_h, a.att, a.att_h, cp_shape(), docs());
  if (!gpt2) rope_backward(s.d_qkv.data(), rope_, B, T, H, KV, D, pos_ids_.data());
  const Operand<float> ln1 = norm_kept(a.ln1, a.ln1_low);
  linear_backward_consuming(s.d_ln.data(), g(o.qkv_w), g(o.qkv_b), s.d_qkv.data(), ln1, mw(o.qkv_w), N, C, S, lay);
  tp.enter_backward(d_ln_loc, s.d_ln.data(), B, T, C);
  norm_backward(d_res, d_ln_loc, in, a.mean1, a.rstd1, o.ln1_w, o.ln1_b);
}

// The MoE branch, out = moe(norm2(mid)) (the residual add is the caller's), on this rank's share of
// the tokens (TensorParallel::share); the outputs are gathered back to every TP rank's local buffer.
// `losses` (null when recomputing) receives the router losses of the share and the routed counts.
void Model::moe_layer_forward(int64_t l, const LayerActs& a, float* out, Losses* losses) {
  const Stopwatch watch(moe_layer_s_);
  const ModelConfig& c = cfg_;
  const LayerOffsets& o = layers_[size_t(l)];
  Scratch& s = *scratch_;
  const int64_t B = B_, T = T_, C = c.hidden;
  const float* x = tp_.share(a.ln2, s.share_x.data(), B, T, C);
  float* y = tp_.share_buffer(out, s.share_y.data());
  // The router's bias (aux-loss-free balancing) and, for the global-batch loss, the step's running
  // counts — or, recomputing, the fractions this micro-batch's first forward used.
  MoeBalance balance;
  if (!router_bias_.empty()) balance.bias = router_bias_[size_t(l)].data();
  const bool global = c.routing.aux == AuxLoss::global;
  if (global && losses) balance.global = &global_counts_[size_t(l)];
  if (global && !losses) balance.reuse = &global_frac_.at({l, mb_});
  if (c.packed_sequences) balance.docs = &moe_docs_;
  MoeInputs<float> in{x, w(o.router), expert_weights(o.experts)};
  if (experts_fn_) in.before_experts = [&](const DispatchPlan& plan) {  // FSSDP: the experts its rows reach
    std::vector<int32_t> need;
    return placed(gather_reached(l, plan, need));
  };
  origami::moe_forward(y, *a.moe, in, moe_sizes(), c.routing, balance, dispatcher_, s.moe);
  tp_.gather_shares(out, y, B, T, C);
  if (losses) {
    if (global) global_frac_[{l, mb_}] = a.moe->frac;
    losses->aux_loss += a.moe->aux;
    losses->z_loss += a.moe->z;
    for (int64_t e = 0; e < c.num_experts; ++e) expert_counts_[size_t(l)][size_t(e)] += a.moe->routed_E[size_t(e)];
    expert_dropped_[size_t(l)] += a.moe->dropped;
    expert_near_ties_[size_t(l)] += a.moe->near_ties;
    expert_call_rows_.push_back(a.moe->plan.rows);
  }
}

ExpertPlace Model::gather_reached(int64_t l, const DispatchPlan& plan, std::vector<int32_t>& need) {
  need.clear();
  for (int64_t rows : plan.expert_rows) need.push_back(rows > 0);
  return experts_fn_(ExpertUse::gather, expert_blocks(l), need);
}

ExpertBlocks Model::expert_blocks(int64_t l) const {
  const int64_t F = cfg_.expert_ffn / dispatcher_.etp();
  return {layers_[size_t(l)].experts, 3 * F * cfg_.hidden, dispatcher_.local_experts(cfg_.num_experts)};
}

// d_ln ← ∂/∂norm2(mid) [Nl, C] from d_res = ∂/∂out [Nl, C]: the share's part, gathered. The router's
// gradient is the share's part too (a token-partial tensor, reduced over TP with the gradients).
void Model::moe_layer_backward(int64_t l, const LayerActs& a, float* d_ln, const float* d_res, float loss_scale) {
  const Stopwatch watch(moe_layer_s_);
  const ModelConfig& c = cfg_;
  const LayerOffsets& o = layers_[size_t(l)];
  Scratch& s = *scratch_;
  const int64_t B = B_, T = T_, C = c.hidden;
  const MoeSizes ms = moe_sizes();
  const float* x = tp_.share(a.ln2, s.share_x.data(), B, T, C);
  const float* d_out = tp_.share(d_res, s.share_y.data(), B, T, C);
  float* dx = tp_.share_buffer(d_ln, s.share_dx.data());
  Weights<float> experts = expert_weights(o.experts);
  float* d_experts = experts_.grad() + o.experts;
  std::vector<int32_t> need;  // FSSDP: the experts forward gathered, gathered again
  if (experts_fn_) {
    const ExpertPlace at = gather_reached(l, a.moe->plan, need);
    experts = placed(at), d_experts = at.grads;
  }
  moe_backward_experts(dx, d_experts, d_out, *a.moe, s.moe, experts, ms, dispatcher_);
  if (experts_fn_) experts_fn_(ExpertUse::reduce, expert_blocks(l), need);
  moe_backward_router(dx, g(o.router), s.moe, *a.moe, x, w(o.router), ms, c.routing, loss_scale);
  tp_.gather_shares(d_ln, dx, B, T, C);
}

// Final norm, then the vocab-parallel LM head and cross-entropy with its backward fused in:
// d_ln = this rank's part of ∂(loss_scale·lm_loss)/∂lnf, then d_res = ∂/∂top.
Losses Model::head(const float* top, const int32_t* tokens, float loss_scale, bool backward, float* logits_out) {
  gather_tokens(scratch_->targets.data(), tokens, 1);
  final_norm(top);
  Losses out;
  out.lm_loss = lm_loss(loss_scale, backward, logits_out);
  if (backward) final_norm_backward(scratch_->d_res.data(), top);
  return out;
}

void Model::final_norm(const float* top) {
  Scratch& s = *scratch_;
  float* lnf_loc = tp_.local(s.lnf.data(), s.loc.data());
  norm_forward(lnf_loc, s.meanf.data(), s.rstdf.data(), top, lnf_w_, lnf_b_);
  tp_.enter(s.lnf.data(), lnf_loc, B_, T_, cfg_.hidden);
}

// The statistics of this rank's vocabulary rows combined over TP, then (vocabulary parallelism) over
// the pipeline group: each an all-gather of 3 floats per row.
double Model::lm_loss(float loss_scale, bool backward, float* logits_out) {
  Scratch& s = *scratch_;
  VocabShard<float> shard{vocab_begin_, vocab_valid_, nullptr};
  if (tp_.size() > 1 || vocab_)
    shard.combine = [this](float* stats, int64_t n) {
      if (tp_.size() > 1) combine_vocab_stats(tp_.comm(), stats, n);
      if (vocab_) combine_vocab_stats(*vocab_, stats, n);
    };
  // The sum over the micro-batch's targets over loss_tokens_, by default its B·T tokens (a mean): under
  // CP this rank's part of it (summed over CP).
  const int64_t N = B_ * T_;
  const double tokens_total = loss_tokens_ > 0 ? loss_tokens_ : double(N * row_cp());
  // Decoding reads the last position's logits alone (decode): the head skips the others' [V] rows.
  const int64_t skip = kv_ ? N - 1 : 0;
  return lm_head_loss(backward ? s.d_ln.data() : nullptr, g(head_), logits_out, s.lnf.data() + skip * cfg_.hidden,
                      mw(head_), s.targets.data() + skip, N - skip, cfg_.hidden, Vl_,
                      loss_scale / float(tokens_total), s.head, shard) /
         tokens_total;
}

void Model::final_norm_backward(float* d_top, const float* top) {
  Scratch& s = *scratch_;
  float* d_ln_loc = tp_.local(s.d_ln.data(), s.loc.data());
  tp_.enter_backward(d_ln_loc, s.d_ln.data(), B_, T_, cfg_.hidden);
  std::fill_n(d_top, tp_.local_tokens(B_ * T_) * cfg_.hidden, 0.f);
  norm_backward(d_top, d_ln_loc, top, s.meanf.data(), s.rstdf.data(), lnf_w_, lnf_b_);
}

void Model::vocab_embed(int mb, const int32_t* tokens, float* x0) {
  ORIGAMI_ASSERT(vocab_ && (x0 != nullptr) == part_.embedding);
  select_cp(mb);
  set_documents(tokens);
  embed(x0, tokens);
}

Losses Model::vocab_head(int mb, const int32_t* tokens, const float* top, float* d_top, float loss_scale,
                         bool backward) {
  ORIGAMI_ASSERT(vocab_ && (top != nullptr) == part_.head && (!backward || (d_top != nullptr) == part_.head));
  mb_ = mb;
  select_cp(mb);
  set_documents(tokens);
  const int64_t NC = B_ * T_ * cfg_.hidden;
  gather_tokens(scratch_->targets.data(), tokens, 1);
  if (top) final_norm(top);
  vocab_->broadcast(scratch_->lnf.data(), NC, DType::f32, vocab_->size() - 1);
  Losses out;
  out.lm_loss = lm_loss(loss_scale, backward, nullptr);
  if (backward) vocab_->all_reduce(scratch_->d_ln.data(), NC);
  if (backward && top) final_norm_backward(d_top, top);
  return top ? out : Losses{};
}

void Model::vocab_embed_backward(int mb, const int32_t* tokens, float* d_x0) {
  ORIGAMI_ASSERT(vocab_ && (d_x0 != nullptr) == part_.embedding);
  if (!d_x0) d_x0 = scratch_->lnf.data();  // [N, C], free between the head's uses
  select_cp(mb);
  set_documents(tokens);
  vocab_->broadcast(d_x0, B_ * T_ * cfg_.hidden, DType::f32, 0);
  embed_backward(d_x0, tokens);
}

Losses Model::forward(int mb, int chunk, const int32_t* tokens, const float* input) {
  ORIGAMI_ASSERT(B_ > 0 && chunk >= 0 && chunk < int(part_.chunks.size()) && !live_.count({mb, chunk}));
  mb_ = mb;
  select_cp(mb);
  set_documents(tokens);
  const LayerRange r = part_.chunks[size_t(chunk)];
  const int64_t Lc = r.end - r.begin, NlC = tp_.local_tokens(B_ * T_) * cfg_.hidden;
  std::unique_ptr<Slot> slot;
  std::vector<std::unique_ptr<Slot>>& pool = free_[size_t(slot_class_[size_t(chunk)])];
  if (!pool.empty()) {
    slot = std::move(pool.back());
    pool.pop_back();
  } else {
    slot = std::make_unique<Slot>();
    const int64_t kept = recompute_ == Recompute::full ? 0 : Lc;
    size_slot(*slot, Lc + 1, r.begin, kept, recompute_ == Recompute::none ? Lc : 0, slot_bytes(cfg_, activation_shape(), r));
    held_bytes_ += slot->bytes();
    peak_bytes_ = std::max(peak_bytes_, act_bytes());
  }
  float* resid = slot->resid.data();
  if (Lc > 0) use_weights(WeightUse::prefetch, units_[size_t(r.begin)]);
  if (chunk == 0 && part_.embedding && !part_.vocab_parallel()) {  // (vocabulary parallelism: vocab_embed)
    use_weights(WeightUse::need, embedding_unit_);
    embed(resid, tokens);
    use_weights(WeightUse::done, embedding_unit_);
  } else {
    std::memcpy(resid, input, size_t(NlC) * sizeof(float));
  }
  Losses out;
  for (int64_t i = 0; i < Lc; ++i) {
    const int64_t l = r.begin + i;
    if (i + 1 < Lc) use_weights(WeightUse::prefetch, units_[size_t(l + 1)]);
    use_weights(WeightUse::need, units_[size_t(l)]);
    layer_forward(l, layer_acts(*slot, i), resid + i * NlC, resid + (i + 1) * NlC, &out);
    use_weights(WeightUse::done, units_[size_t(l)]);
    if (progress_) progress_();
  }
  live_[{mb, chunk}] = std::move(slot);
  return out;
}

const float* Model::output(int mb, int chunk) const {
  const Slot& s = *live_.at({mb, chunk});
  const LayerRange r = part_.chunks[size_t(chunk)];
  return s.resid.data() + (r.end - r.begin) * tp_.local_tokens(B_ * T_) * cfg_.hidden;
}

void Model::release(int mb, int chunk) {
  auto it = live_.find({mb, chunk});
  free_[size_t(slot_class_[size_t(chunk)])].push_back(std::move(it->second));
  live_.erase(it);
}

Losses Model::backward(int mb, int chunk, const int32_t* tokens, const float* d_output, float loss_scale,
                       float* logits_BTV) {
  auto it = live_.find({mb, chunk});
  ORIGAMI_ASSERT(it != live_.end());
  mb_ = mb;
  select_cp(mb);
  set_documents(tokens);
  Slot& slot = *it->second;
  const LayerRange r = part_.chunks[size_t(chunk)];
  const int64_t Lc = r.end - r.begin, NlC = tp_.local_tokens(B_ * T_) * cfg_.hidden;
  float* resid = slot.resid.data();
  float* d_res = scratch_->d_res.data();  // ∂/∂(residual stream) at the current depth, this rank's tokens
  input_grad_ = d_res;
  Losses out;
  if (runs_head(chunk)) {
    use_weights(WeightUse::need, head_unit_);
    out = head(resid + Lc * NlC, tokens, loss_scale, true, logits_BTV);
    use_weights(WeightUse::done, head_unit_);
    grads_ready(head_begin_, experts_.size());
  } else {
    std::memcpy(d_res, d_output, size_t(NlC) * sizeof(float));
  }
  for (int64_t i = Lc - 1; i >= 0; --i) {
    const int64_t l = r.begin + i;
    const LayerActs a = layer_acts(slot, i);
    if (i > 0) use_weights(WeightUse::prefetch, units_[size_t(l - 1)]);
    use_weights(WeightUse::need, units_[size_t(l)]);
    if (recompute_ == Recompute::full)  // rebuild the layer's buffers; its output is rewritten unchanged
      layer_forward(l, a, resid + i * NlC, resid + (i + 1) * NlC, nullptr);
    layer_backward(l, a, resid + i * NlC, d_res, loss_scale);
    use_weights(WeightUse::done, units_[size_t(l)]);
    grads_ready(layer_begin_[size_t(l)], expert_begin_[size_t(l)]);
    if (progress_) progress_();
  }
  if (chunk == 0 && part_.embedding) {  // writes gradients only: no weights needed
    const float* d_x0 = tp_.exit_backward(scratch_->full.data(), d_res, B_, T_, cfg_.hidden);
    if (part_.vocab_parallel()) {  // every stage's slice, in vocab_embed_backward
      input_grad_ = d_x0;
      release(mb, chunk);
      return out;
    }
    embed_backward(d_x0, tokens);
    grads_ready(0, 0);
  }
  release(mb, chunk);
  return out;
}

Losses Model::forward_only(int mb, int chunk, const int32_t* tokens, const float* input, float* output_copy,
                           float* logits_BTV) {
  Losses out = forward(mb, chunk, tokens, input);
  if (runs_head(chunk)) {
    use_weights(WeightUse::need, head_unit_);
    out += head(output(mb, chunk), tokens, 1.f, false, logits_BTV);
    use_weights(WeightUse::done, head_unit_);
  } else
    std::memcpy(output_copy, output(mb, chunk), size_t(tp_.local_tokens(B_ * T_) * cfg_.hidden) * sizeof(float));
  release(mb, chunk);
  return out;
}

Losses Model::forward_backward(const int32_t* tokens, int64_t B, int64_t T, float loss_scale, bool backward,
                               float* logits_out) {
  ORIGAMI_ASSERT(part_.chunks.size() == 1 && part_.embedding && part_.head && !kv_);  // (decoding: decode())
  set_batch(B, T);
  Losses out = backward ? forward(0, 0, tokens, nullptr) : forward_only(0, 0, tokens, nullptr, nullptr, logits_out);
  if (backward) out += this->backward(0, 0, tokens, nullptr, loss_scale, logits_out);
  out.loss = out.lm_loss + out.aux_loss + out.z_loss;
  return out;
}

void Model::start_decoding(int64_t capacity) {
  ORIGAMI_ASSERT(part_.chunks.size() == 1 && part_.embedding && part_.head && tp_.size() == 1 && cp_.size() == 1 &&
                 levels_.empty() && !part_.vocab_parallel());
  ORIGAMI_CHECK(capacity >= 1 && capacity <= cfg_.max_positions, "a KV cache of ", capacity,
                " positions: the model has ", cfg_.max_positions);
  kv_ = std::make_unique<KvCache>();
  KvCache& c = *kv_;
  c.cap = capacity, c.width = cfg_.num_kv_heads * cfg_.head_dim;
  const int64_t floats = (Size(cfg_.num_layers) * capacity * c.width).get();  // (SizeOverflow beyond 64 bits)
  const int64_t bytes = (Size(8) * floats).get();
  const AvailableMemory avail = available_memory();  // (checked: Linux lets a huge allocation through, then kills)
  ORIGAMI_CHECK(bytes <= avail.bytes, "the KV cache of ", capacity, " positions x ", cfg_.num_layers, " layers needs ",
                format_bytes(double(bytes)), ", more than the ", format_bytes(double(avail.bytes)), " available (",
                avail.source, "): fewer --max-new-tokens, or --no-kv-cache");
  allocating("the KV cache", bytes, [&] {
    c.k.resize(size_t(floats));
    c.v.resize(size_t(floats));
  });
  c.doc.resize(size_t(capacity));
  // RoPE's angles for every position the cache holds (set_batch grows them to its rows' length only)
  if (!cfg_.is_gpt2() && rope_.max_T < capacity) rope_ = RopeTable(capacity, cfg_.head_dim, cfg_.rope_theta);
}

int64_t Model::decoded() const { return kv_ ? kv_->len : 0; }

void Model::clear_decoding() {
  if (kv_) kv_->len = 0;
}

// Layer l's attention while decoding: the new tokens' keys and values (qkv [n, S], after RoPE) join the
// cache, and their queries attend to every cached position up to their own (the block's diagonal
// at the cache's length), in their own document under document masking.
void Model::cached_attention(int64_t l, const float* qkv, float* att, float* lse) {
  KvCache& c = *kv_;
  const int64_t n = T_, H = Hl_, KV = KVl_, D = cfg_.head_dim, S = (H + 2 * KV) * D, W = c.width;
  float* k = c.k.data() + l * c.cap * W;
  float* v = c.v.data() + l * c.cap * W;
  for (int64_t t = 0; t < n; ++t) {
    std::memcpy(k + (c.len + t) * W, qkv + t * S + H * D, size_t(W) * sizeof(float));
    std::memcpy(v + (c.len + t) * W, qkv + t * S + (H + KV) * D, size_t(W) * sizeof(float));
  }
  std::fill(att, att + n * H * D, 0.f);
  std::fill(lse, lse + H * n, -std::numeric_limits<float>::infinity());
  BlockDims d{1, n, c.len + n, H, KV, D, c.len};
  if (cfg_.masks_documents()) d.qdoc = c.doc.data() + c.len, d.kdoc = c.doc.data();
  d.precision = precision_;
  attention_block_forward<float>({att, n * H * D, H * D}, {lse, H * n, n}, {qkv, n * S, S}, {k, c.cap * W, W},
                                 {v, c.cap * W, W}, d);
}

void Model::decode(const int32_t* tokens, int64_t n, float* logits) {
  ORIGAMI_ASSERT(kv_ && n >= 1);
  KvCache& c = *kv_;
  ORIGAMI_CHECK(c.len + n <= c.cap, "the KV cache holds ", c.cap, " positions: ", c.len, " and ", n, " more do not fit");
  set_batch(1, n);
  // The new positions continue the cache's: under document masking a document starts after the
  // end-of-document token, at position 0.
  for (int64_t t = 0; t < n; ++t) {
    const int64_t p = c.len + t;
    const bool starts = p > 0 && cfg_.masks_documents() && c.last_token == cfg_.document_eod;
    c.doc[size_t(p)] = p == 0 ? 0 : c.doc[size_t(p - 1)] + (starts ? 1 : 0);
    c.last_pos = p == 0 || starts ? 0 : c.last_pos + 1;
    c.last_token = tokens[t];
    pos_ids_[size_t(t)] = c.last_pos;
  }
  c.row.assign(tokens, tokens + n);
  c.row.push_back(0);  // (the targets' row: read, never predicted from)
  forward_only(0, 0, c.row.data(), nullptr, nullptr, logits);  // (the last position's logits only: lm_loss)
  c.len += n;
}

}  // namespace origami
