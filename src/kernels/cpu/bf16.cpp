// The bf16 conversion paths (bf16.h). Each vector path compiles for its own instruction set through
// a target attribute and runs only after the CPU reported it (__builtin_cpu_supports, which also
// checks that the OS saves the vector registers); tails shorter than a vector use the scalar code.
#include "kernels/cpu/bf16.h"
#include "kernels/cpu/parallel.h"

// GCC 12 warns that the intrinsics' _mm512_undefined_* placeholders (self-initialised, `__Y = __Y`)
// "may be used uninitialized" once inlined into a target-attribute function: a false positive.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <algorithm>
#include <initializer_list>

namespace origami {

namespace {

void narrow_scalar(bf16* out, const float* in, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = to_bf16(in[i]);
}

void widen_scalar(float* out, const bf16* in, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = to_float(in[i]);
}

void precision_scalar(float* out, const float* in, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = to_float(to_bf16(in[i]));
}

// The scalar to_bf16's arithmetic on 8 lanes; the results (< 2^16) are packed two vectors at a time.
__attribute__((target("avx2"))) __m256i round_avx2(__m256i u) {
  const __m256i abs = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
  const __m256i nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7f800000));  // both non-negative
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  const __m256i quiet = _mm256_or_si256(u, _mm256_set1_epi32(0x00400000));
  return _mm256_srli_epi32(_mm256_blendv_epi8(rounded, quiet, nan), 16);
}

__attribute__((target("avx2"))) void narrow_avx2(bf16* out, const float* in, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i lo = round_avx2(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i)));
    const __m256i hi = round_avx2(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i + 8)));
    // packus interleaves 128-bit halves (lo0 hi0 lo1 hi1); the permute puts them back in order.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xd8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), packed);
  }
  narrow_scalar(out + i, in + i, n - i);
}

__attribute__((target("avx2"))) void precision_avx2(float* out, const float* in, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i r = round_avx2(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm256_slli_epi32(r, 16));
  }
  precision_scalar(out + i, in + i, n - i);
}

__attribute__((target("avx2"))) void widen_avx2(float* out, const bf16* in, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm256_slli_epi32(h, 16));
  }
  widen_scalar(out + i, in + i, n - i);
}

// The scalar to_bf16's arithmetic on 16 lanes: the bf16 bits in each lane's low half.
__attribute__((target("avx512f"))) __m512i round_avx512f(__m512i u) {
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x00400000));  // NaN: the quiet bit
  return _mm512_srli_epi32(r, 16);
}

__attribute__((target("avx512f"))) void narrow_avx512f(bf16* out, const float* in, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i r = round_avx512f(_mm512_loadu_si512(in + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtepi32_epi16(r));
  }
  narrow_scalar(out + i, in + i, n - i);
}

__attribute__((target("avx512f"))) void precision_avx512f(float* out, const float* in, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_si512(out + i, _mm512_slli_epi32(round_avx512f(_mm512_loadu_si512(in + i)), 16));
  precision_scalar(out + i, in + i, n - i);
}

__attribute__((target("avx512f"))) void widen_avx512f(float* out, const bf16* in, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i)));
    _mm512_storeu_si512(out + i, _mm512_slli_epi32(h, 16));
  }
  widen_scalar(out + i, in + i, n - i);
}

// Lanes holding an fp32 subnormal (0 < |x| < 2^-126): the ones vcvtne2ps2bf16 flushes to ±0.
__attribute__((target("avx512f"))) __mmask16 subnormal_lanes(__m512i u) {
  const __m512i abs = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
  return _mm512_cmplt_epu32_mask(_mm512_sub_epi32(abs, _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7fffff));
}

__attribute__((target("avx512f,avx512bf16"))) void narrow_avx512bf16(bf16* out, const float* in, int64_t n) {
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512i lo = _mm512_loadu_si512(in + i), hi = _mm512_loadu_si512(in + i + 16);
    if (subnormal_lanes(lo) | subnormal_lanes(hi)) {  // rare: values below 1.2e-38
      narrow_scalar(out + i, in + i, 32);
      continue;
    }
    const __m512bh r = _mm512_cvtne2ps_pbh(_mm512_castsi512_ps(hi), _mm512_castsi512_ps(lo));
    _mm512_storeu_si512(out + i, (__m512i)r);  // the 32 bf16 as integer lanes
  }
  narrow_scalar(out + i, in + i, n - i);
}

}  // namespace

bool cpu_has(Bf16Isa isa) {
  switch (isa) {
    case Bf16Isa::scalar: return true;
    case Bf16Isa::avx2: return __builtin_cpu_supports("avx2") != 0;
    case Bf16Isa::avx512f: return __builtin_cpu_supports("avx512f") != 0;
    // (GCC's avx512bf16 target implies AVX512BW and VL, whose instructions its code uses: every such CPU
    // has them, but a virtual CPU model may list AVX512-BF16 without them)
    case Bf16Isa::avx512bf16:
      return __builtin_cpu_supports("avx512f") != 0 && __builtin_cpu_supports("avx512bw") != 0 &&
             __builtin_cpu_supports("avx512vl") != 0 && __builtin_cpu_supports("avx512bf16") != 0;
  }
  return false;
}

const char* name(Bf16Isa isa) {
  switch (isa) {
    case Bf16Isa::scalar: return "scalar";
    case Bf16Isa::avx2: return "AVX2";
    case Bf16Isa::avx512f: return "AVX-512F";
    case Bf16Isa::avx512bf16: return "AVX512-BF16";
  }
  return "?";
}

Bf16Isa best_bf16_isa() {
  static const Bf16Isa best = [] {
    for (Bf16Isa isa : {Bf16Isa::avx512bf16, Bf16Isa::avx512f, Bf16Isa::avx2})
      if (cpu_has(isa)) return isa;
    return Bf16Isa::scalar;
  }();
  return best;
}

void to_bf16(Bf16Isa isa, bf16* out, const float* in, int64_t n) {
  switch (isa) {
    case Bf16Isa::scalar: return narrow_scalar(out, in, n);
    case Bf16Isa::avx2: return narrow_avx2(out, in, n);
    case Bf16Isa::avx512f: return narrow_avx512f(out, in, n);
    case Bf16Isa::avx512bf16: return narrow_avx512bf16(out, in, n);
  }
}

void to_float(Bf16Isa isa, float* out, const bf16* in, int64_t n) {
  switch (isa) {
    case Bf16Isa::scalar: return widen_scalar(out, in, n);
    case Bf16Isa::avx2: return widen_avx2(out, in, n);
    case Bf16Isa::avx512f:
    case Bf16Isa::avx512bf16: return widen_avx512f(out, in, n);
  }
}

void to_bf16_precision(Bf16Isa isa, float* out, const float* in, int64_t n) {
  switch (isa) {
    case Bf16Isa::scalar: return precision_scalar(out, in, n);
    case Bf16Isa::avx2: return precision_avx2(out, in, n);
    case Bf16Isa::avx512f:
    case Bf16Isa::avx512bf16: return precision_avx512f(out, in, n);
  }
}

void to_bf16(bf16* out, const float* in, int64_t n) { to_bf16(best_bf16_isa(), out, in, n); }
void to_bf16_precision(float* out, const float* in, int64_t n) { to_bf16_precision(best_bf16_isa(), out, in, n); }
void to_float(float* out, const bf16* in, int64_t n) { to_float(best_bf16_isa(), out, in, n); }

namespace {
// fn(begin, count) over blocks of n elements, spread over the threads when there is more than one
// block and the caller is not inside a parallel region (over_rows).
template <typename Fn>
void over_blocks(int64_t n, Fn&& fn) {
  constexpr int64_t kBlock = int64_t(1) << 14;
  over_rows((n + kBlock - 1) / kBlock, true, [&](int64_t b) { fn(b * kBlock, std::min(kBlock, n - b * kBlock)); });
}
}  // namespace

void round_to_bf16(bf16* dst, const float* src, int64_t n) {
  over_blocks(n, [&](int64_t at, int64_t k) { to_bf16(dst + at, src + at, k); });
}

void widen_to_float(float* dst, const bf16* src, int64_t n) {
  over_blocks(n, [&](int64_t at, int64_t k) { to_float(dst + at, src + at, k); });
}

void round_in_place(float* v, bf16* low, int64_t n) {
  over_blocks(n, [&](int64_t at, int64_t k) {
    to_bf16_precision(v + at, v + at, k);
    if (low) to_bf16(low + at, v + at, k);  // exact: the block is still in the cache
  });
}

}  // namespace origami
