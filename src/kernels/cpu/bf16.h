// bf16 (bfloat16): the top 16 bits of an fp32 — sign, the same 8 exponent bits, 7 stored mantissa
// bits. fp32's range with 8 significant bits: unit roundoff u_bf16 = 2^-8. Mixed precision (issue 28)
// keeps GEMM inputs in bf16 and computes in fp32.
//
// fp32 -> bf16 rounds to nearest, ties to even. NaN stays NaN: made quiet, its sign and top 7
// payload bits kept, so a NaN whose payload lies only in the dropped bits does not become inf.
// ±inf stay ±inf; a value at or beyond the midpoint above the largest finite bf16 (0x7f7f,
// 3.3895e38) becomes ±inf. fp32 subnormals round like every other value, to bf16 subnormals or ±0.
// This is PyTorch's conversion and the safetensors writer's (ckpt/safetensors.h).
// bf16 -> fp32 is exact: the 16 bits are the fp32's top half.
//
// The array conversions run the widest path the CPU has, chosen once at run time (the build's
// -march flag does not decide it): AVX512-BF16 (vcvtne2ps2bf16), AVX-512F or AVX2 bit arithmetic,
// or scalar code. Every path gives the same bits. vcvtne2ps2bf16 itself flushes subnormal inputs to
// ±0 (oneDNN's conversion does the same); its path redoes a block holding one with the scalar code.
// to_bf16 and to_float on arrays are single-threaded; round_to_bf16 and widen_to_float split over the threads.
#pragma once
#include <cstdint>
#include <cstring>

namespace origami {

struct bf16 {
  uint16_t bits;
};

inline bf16 to_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {uint16_t((u >> 16) | 0x40)};  // NaN: set the quiet bit
  // Adding 0x7fff plus the lowest kept bit carries into the kept half exactly when the dropped half
  // is above one half, or equal with the kept half odd; a carry out of the largest finite value
  // lands on inf's bits.
  u += 0x7fffu + ((u >> 16) & 1u);
  return {uint16_t(u >> 16)};
}

inline float to_float(bf16 x) {
  const uint32_t u = uint32_t(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// out[i] = to_bf16(in[i]) / to_float(in[i]) for i < n, on the widest path this CPU has.
void to_bf16(bf16* out, const float* in, int64_t n);
void to_float(float* out, const bf16* in, int64_t n);
// out[i] = to_float(to_bf16(in[i])) in one pass: fp32 values rounded to bf16's precision (the portable
// GEMM's operands, which need the bf16 values but in fp32). out may be in.
void to_bf16_precision(float* out, const float* in, int64_t n);

// The same over the threads (outside a parallel region; inside one, on the calling thread).
void round_to_bf16(bf16* dst, const float* src, int64_t n);
void widen_to_float(float* dst, const bf16* src, int64_t n);
// v[i] = to_float(to_bf16(v[i])) in place and, where low is not null, low[i] = to_bf16(v[i]): a GEMM
// operand that only GEMMs read from here on, at bf16 precision in fp32 (which the portable GEMM reads
// where it is) and as its bf16 copy (which oneDNN's reads). Over the threads, like the two above.
void round_in_place(float* v, bf16* low, int64_t n);

// The conversion paths, for tests and benchmarks: each exists where the CPU has its instructions.
// Widening has no AVX512-BF16 instruction; that path widens with AVX-512F (and rounds in fp32 with it).
enum class Bf16Isa { scalar, avx2, avx512f, avx512bf16 };
bool cpu_has(Bf16Isa isa);
const char* name(Bf16Isa isa);
Bf16Isa best_bf16_isa();  // the path to_bf16 / to_float above use
void to_bf16(Bf16Isa isa, bf16* out, const float* in, int64_t n);
void to_float(Bf16Isa isa, float* out, const bf16* in, int64_t n);
void to_bf16_precision(Bf16Isa isa, float* out, const float* in, int64_t n);

}  // namespace origami
