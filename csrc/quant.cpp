// FP8 (float8_e4m3fn) block quantization of rows for CPU tensors, JIT-built with permute.cpp by
// moe_comm/kernels/native.py (one extension; permute.cpp's module calls register_quant).
//
// Shapes legend: T tokens, R rows, H hidden size, B bytes of a packed row, n = ceil(H / 128) blocks.
// Semantics and packed layout: moe_comm/kernels/reference.py, the oracle the tests compare against bit for
// bit (packed bytes and dequantized rows). Summary of a packed row (little endian):
//   [0, H) e4m3fn payload | [S0 = round_up(H, 4), S0 + n * sb) block scales (float32, sb = 4; or ue8m0
//   exponents, sb = 1) | zero padding to B = round_up(S0 + n * sb, 4).
// Build flags that matter: -ffp-contract=off (no FMA: x / s and q * s are single IEEE operations, as in
// torch). No -ffast-math: NaN and signed zeros follow IEEE (the compiler may not reorder or drop them).
// float32 -> e4m3fn is integer bit manipulation equal to torch's c10 conversion (checked over a strided
// sweep of all float32 bit patterns by tests/kernels/test_fp8_quant.py).
//
// Speed: the element loops are branch-free so the compiler vectorises them, and they are compiled twice,
// generic and AVX2 (picked at run time; quant_config forces one for the tests). Measured on this repo's
// 2-core AMD EPYC VM while it was shared, 1 thread, quantize_rows of 64 x 7168 float32 / bfloat16 rows
// (in cache): generic 4.3-4.8 ns per element, AVX2 1.9-2.0 ns; a branchy scalar conversion was 2.9-4.1
// ns per element in a standalone loop where the AVX2 branch-free one took 1.6-2.5 ns.

// Narrow headers instead of <torch/extension.h> (the whole C++ frontend): the build went 82 -> ~50 s.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <type_traits>
#include <cstdint>
#include <cstring>
#include <limits>

// The AVX2 copies need GCC's target attribute on templates; other compilers get the generic loops only.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MOE_QUANT_AVX2 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 128;              // elements per scale
constexpr float kFp8Max = 448.0f;            // largest finite e4m3fn
constexpr float kFp8TopLimit = 240.0f;       // largest e4m3fn below 256: the payload limit at the top ue8m0 scale
constexpr uint32_t kCanonicalNaN = 0x7FC00000u;

inline uint32_t bits_of(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  return b;
}

inline float float_of(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
}

// float32 -> float8_e4m3fn bits, torch's conversion (c10 fp8e4m3fn_from_fp32_value) in integers only:
//   NaN -> 0x7F (sign kept); |f| >= 448 after rounding, inf included -> 0x7E (saturate, as torch does), so
//   the clamp to [-448, 448] before it changes no bits and is left out;
//   |f| < 2^-6 -> subnormal: round |f| / 2^-9 to nearest even (8 means 2^-6, code 0x08);
//   else rebias the exponent (127 -> 7) and round the mantissa to 3 bits, nearest even.
// Branch-free (every case computed, then selected) so that loops over it vectorise.
// Example: 1.0625f (0x3F880000, half-way between 1 and 1.125) -> 0x38 = 1.0 (tie to even);
//          2^-10 -> 0x00 (tie between 0 and 2^-9, to even); -3e-3 -> 0x82 (-2 * 2^-9).
inline uint8_t e4m3_from_f32(float f) {
  const uint32_t bits = bits_of(f);
  const uint32_t sign = bits & 0x80000000u;
  const uint32_t a = bits ^ sign;
  const uint32_t e = a >> 23;
  uint32_t normal = (a + 0xC4000000u + 0x7FFFFu + ((a >> 20) & 1u)) >> 20;  // 0xC4000000 = (7 - 127) << 23
  normal = normal == 0x7Fu ? 0x7Eu : normal;  // rounded past 448
  // below 2^-6: value m * 2^(max(e, 1) - 150) is m >> sh in units of 2^-9 (sh >= 21, capped at 31)
  const uint32_t m = (a & 0x7FFFFFu) | (e ? 0x800000u : 0u);
  uint32_t sh = e ? 141u - e : 140u;
  sh = sh < 31u ? sh : 31u;
  const uint32_t half = 1u << (sh - 1), rem = m & ((1u << sh) - 1u);
  uint32_t sub = m >> sh;
  sub += (rem > half) | ((rem == half) & sub);  // nearest, ties to even (the low bit of sub)
  uint32_t r = a < 0x3C800000u ? sub : normal;  // 0x3C800000 = 2^-6
  r = a >= 0x43F00000u ? 0x7Eu : r;  // >= 480, inf included
  r = a > 0x7F800000u ? 0x7Fu : r;   // NaN
  return static_cast<uint8_t>((r | (sign >> 24)) & 0xFFu);
}

// float8_e4m3fn bits -> float32, the same bits as torch's conversion (NaN 0x7F -> 0x7FF00000, sign kept).
// Example: 0x38 -> 1.0; 0x01 -> 2^-9; 0x80 -> -0.0; 0xFF -> NaN with the sign bit set.
inline float e4m3_to_f32(uint8_t q) {
  const uint32_t sign = static_cast<uint32_t>(q & 0x80) << 24;
  const uint32_t e = (q >> 3) & 0xF, m = q & 7u;
  uint32_t bits;
  if ((q & 0x7F) == 0x7F) {
    bits = 0x7FF00000u;
  } else if (e == 0) {
    bits = bits_of(static_cast<float>(m) * 0.001953125f);  // m * 2^-9, exact
  } else {
    bits = ((e + 120u) << 23) | (m << 20);
  }
  return float_of(bits | sign);
}

struct DecodeTable {
  float v[256];
  DecodeTable() {
    for (int i = 0; i < 256; ++i) v[i] = e4m3_to_f32(static_cast<uint8_t>(i));
  }
};

const DecodeTable& decode_table() {
  static const DecodeTable table;
  return table;
}

struct PackedLayout {
  int64_t s0, n, sb, width;
};

PackedLayout packed_layout(int64_t H, bool ue8m0) {
  const int64_t s0 = (H + 3) / 4 * 4, n = (H + kBlock - 1) / kBlock, sb = ue8m0 ? 1 : 4;
  return {s0, n, sb, (s0 + n * sb + 3) / 4 * 4};
}

// ue8m0 scale 2^(b - 127) from its bits (exact); b = 255 -> NaN.
inline float ue8m0_scale(uint32_t b) { return float_of((b << 23) | (b == 255 ? 0x400000u : 0u)); }

// A block's scale from its stored bytes: a ue8m0 exponent, or a little-endian float32.
inline float block_scale(const uint8_t* code, bool ue8m0) {
  if (ue8m0) return ue8m0_scale(code[0]);
  uint32_t sbits = 0;
  for (int k = 0; k < 4; ++k) sbits |= static_cast<uint32_t>(code[k]) << (8 * k);
  return float_of(sbits);
}

int64_t grain_rows(int64_t bytes_per_row) {
  return std::max<int64_t>(1, (64 * 1024) / std::max<int64_t>(1, bytes_per_row));  // ~64 KB per task
}

// float32 -> out_t, nearest even; NaN -> the dtype's canonical quiet NaN (as the reference writes it: the
// payload of NaN * NaN is whichever operand the compiler put first, and torch's own casts give NaN
// different bits per path). Branch-free for float / double / bfloat16 so the loops vectorise.
template <typename out_t>
inline out_t from_f32(float y) {
  return y != y ? std::numeric_limits<out_t>::quiet_NaN() : static_cast<out_t>(y);
}
template <>
inline float from_f32<float>(float y) {
  return y != y ? float_of(kCanonicalNaN) : y;
}
template <>
inline at::BFloat16 from_f32<at::BFloat16>(float y) {
  const uint32_t bits = bits_of(y);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;  // nearest even, as c10
  return at::BFloat16(static_cast<uint16_t>(y != y ? 0x7FC0u : rounded), at::BFloat16::from_bits());
}

// The ue8m0 code from which 448 * s overflows rows of scalar_t (reference.ue8m0_top_code): s = 2^(emax + 1) / 256;
// there the payload is clamped to +-240 so q * s stays finite (x / s in [248, 256) would round to 256).
template <typename scalar_t>
constexpr uint32_t ue8m0_top_code() {
  return 127u + (std::is_same<scalar_t, at::Half>::value ? 16u : 128u) - 8u;
}

// The per-block work, inlined into a generic and an AVX2 copy of each row function below.
// One block: amax (NaN if any NaN), scale, payload bytes, scale bytes.
template <typename scalar_t>
__attribute__((always_inline)) inline void quantize_block(const scalar_t* x, int64_t len, bool ue8m0, uint8_t* q,
                                                          uint8_t* scale_dst) {
  float v[kBlock];
  uint32_t amax_bits = 0;  // max of |x| bits: orders like the values, and any NaN is above inf
  for (int64_t i = 0; i < len; ++i) {
    v[i] = static_cast<float>(x[i]);  // double -> float rounds to nearest even
    amax_bits = std::max(amax_bits, bits_of(v[i]) & 0x7FFFFFFFu);
  }
  if (amax_bits > 0x7F800000u) amax_bits = kCanonicalNaN;
  const float r = float_of(amax_bits) / kFp8Max;
  float s;
  if (ue8m0) {
    const uint32_t rb = bits_of(r), e = (rb >> 23) & 0xFF;
    uint32_t b = std::min<uint32_t>(std::max<uint32_t>(e + ((rb & 0x7FFFFFu) != 0 ? 1u : 0u), 1u), 254u);
    if (r == 0.0f) b = 127;
    if (e == 255) b = 255;  // r inf or NaN
    s = ue8m0_scale(b);
    *scale_dst = static_cast<uint8_t>(b);
    if (b >= ue8m0_top_code<scalar_t>()) {  // rare (amax > ~3.0e38, float16 > 57344): its own loop
      // (a < b ? b : a) and (b < a ? b : a) pass a NaN through with its sign, as torch's clamp
      for (int64_t i = 0; i < len; ++i) {
        q[i] = e4m3_from_f32(std::min(std::max(v[i] / s, -kFp8TopLimit), kFp8TopLimit));
      }
      return;
    }
  } else {
    s = r == 0.0f ? 1.0f : r;
    if (amax_bits == kCanonicalNaN) s = float_of(kCanonicalNaN);
    const uint32_t sbits = bits_of(s);
    for (int k = 0; k < 4; ++k) scale_dst[k] = static_cast<uint8_t>(sbits >> (8 * k));  // little endian
  }
  // one IEEE division each; no clamp needed: the conversion saturates to +-448 and keeps NaN
  for (int64_t i = 0; i < len; ++i) q[i] = e4m3_from_f32(v[i] / s);
}

// One packed row: its blocks, then the zero padding.
template <typename scalar_t>
__attribute__((always_inline)) inline void quantize_row_body(const scalar_t* x_H, int64_t H, bool ue8m0,
                                                             const PackedLayout& L, uint8_t* q_B) {
  for (int64_t j = 0; j < L.n; ++j) {
    quantize_block(x_H + j * kBlock, std::min(kBlock, H - j * kBlock), ue8m0, q_B + j * kBlock,
                   q_B + L.s0 + j * L.sb);
  }
  std::memset(q_B + H, 0, static_cast<size_t>(L.s0 - H));
  const int64_t end_scales = L.s0 + L.n * L.sb;
  std::memset(q_B + end_scales, 0, static_cast<size_t>(L.width - end_scales));
}

// One row back: float32(q) * s per block, cast.
template <typename scalar_t>
__attribute__((always_inline)) inline void dequantize_row_body(const uint8_t* q_B, int64_t H, bool ue8m0,
                                                               const PackedLayout& L, const float* lut,
                                                               scalar_t* y_H) {
  for (int64_t j = 0; j < L.n; ++j) {
    const float s = block_scale(q_B + L.s0 + j * L.sb, ue8m0);
    const int64_t h0 = j * kBlock, len = std::min(kBlock, H - h0);
    for (int64_t i = 0; i < len; ++i) y_H[h0 + i] = from_f32<scalar_t>(lut[q_B[h0 + i]] * s);  // one multiply
  }
}

template <typename scalar_t>
void quantize_row_generic(const scalar_t* x_H, int64_t H, bool ue8m0, const PackedLayout& L, uint8_t* q_B) {
  quantize_row_body(x_H, H, ue8m0, L, q_B);
}
template <typename scalar_t>
void dequantize_row_generic(const uint8_t* q_B, int64_t H, bool ue8m0, const PackedLayout& L, const float* lut,
                            scalar_t* y_H) {
  dequantize_row_body(q_B, H, ue8m0, L, lut, y_H);
}

#ifdef MOE_QUANT_AVX2
template <typename scalar_t>
__attribute__((target("avx2"))) void quantize_row_avx2(const scalar_t* x_H, int64_t H, bool ue8m0,
                                                       const PackedLayout& L, uint8_t* q_B) {
  quantize_row_body(x_H, H, ue8m0, L, q_B);
}
// 8 codes -> float32(q) * s (a table gather, one IEEE multiply), NaN -> the canonical quiet NaN.
__attribute__((target("avx2"))) inline __m256 dequantize8(const uint8_t* q, const float* lut, __m256 s) {
  const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
  const __m256 v = _mm256_mul_ps(_mm256_i32gather_ps(lut, idx, 4), s);
  const __m256 nan = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(kCanonicalNaN)));
  return _mm256_blendv_ps(v, nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}

// float32 and bfloat16 rows: 8 elements per step with the same operations as from_f32 (bfloat16: nearest
// even on the bits; the canonical float NaN rounds to 0x7FC0); other dtypes and the tail: the plain loop.
// Measured (1 thread, 8192 x 1024 float32 rows): 16 ms with the plain loop, see benchmarks/wire.py.
template <typename scalar_t>
__attribute__((target("avx2"))) void dequantize_row_avx2(const uint8_t* q_B, int64_t H, bool ue8m0,
                                                         const PackedLayout& L, const float* lut, scalar_t* y_H) {
  if constexpr (!std::is_same<scalar_t, float>::value && !std::is_same<scalar_t, at::BFloat16>::value) {
    dequantize_row_body(q_B, H, ue8m0, L, lut, y_H);
  } else {
    for (int64_t j = 0; j < L.n; ++j) {
      const float s = block_scale(q_B + L.s0 + j * L.sb, ue8m0);
      const __m256 s8 = _mm256_set1_ps(s);
      const int64_t h0 = j * kBlock, len = std::min(kBlock, H - h0);
      int64_t i = 0;
      for (; i + 8 <= len; i += 8) {
        const __m256 v = dequantize8(q_B + h0 + i, lut, s8);
        if constexpr (std::is_same<scalar_t, float>::value) {
          _mm256_storeu_ps(reinterpret_cast<float*>(y_H + h0 + i), v);
        } else {
          const __m256i b = _mm256_castps_si256(v);
          const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
          const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7FFF)), odd), 16);
          const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, _mm256_setzero_si256()), 0x08);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(y_H + h0 + i), _mm256_castsi256_si128(packed));
        }
      }
      for (; i < len; ++i) y_H[h0 + i] = from_f32<scalar_t>(lut[q_B[h0 + i]] * s);
    }
  }
}
#endif

bool cpu_has_avx2() {
#ifdef MOE_QUANT_AVX2
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2");
#else
  return false;
#endif
}

std::atomic<bool> g_quant_avx2{cpu_has_avx2()};

// out_TB[t] = packed FP8 row of x_TH[t]; every byte of out is written (padding 0).
// Example (H = 2, fp32 scales, B = 8): x_TH = [[896, -1]] -> s = 2, out = [[0x7E, 0xB0, 0, 0, 0, 0, 0, 0x40]]
void quantize_rows(const at::Tensor& x_TH, bool ue8m0, const at::Tensor& out_TB) {
  TORCH_CHECK(x_TH.device().is_cpu() && x_TH.is_contiguous() && x_TH.dim() == 2,
              "x_TH must be a contiguous 2-D CPU tensor (the launcher makes it so)");
  TORCH_CHECK(out_TB.device().is_cpu() && out_TB.is_contiguous() && out_TB.scalar_type() == at::kByte,
              "out must be a contiguous uint8 CPU tensor");
  const int64_t T = x_TH.size(0), H = x_TH.size(1);
  const PackedLayout L = packed_layout(H, ue8m0);
  TORCH_CHECK(out_TB.dim() == 2 && out_TB.size(0) == T && out_TB.size(1) == L.width,
              "out must be [T, packed_width(H)] = [", T, ", ", L.width, "], got ", out_TB.sizes());
  if (T == 0 || L.width == 0) return;
  uint8_t* out = out_TB.data_ptr<uint8_t>();
  const bool avx2 = g_quant_avx2.load(std::memory_order_relaxed);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x_TH.scalar_type(), "quantize_rows", [&] {
    const scalar_t* x = x_TH.const_data_ptr<scalar_t>();
    auto row = &quantize_row_generic<scalar_t>;
#ifdef MOE_QUANT_AVX2
    if (avx2) row = &quantize_row_avx2<scalar_t>;
#endif
    at::parallel_for(0, T, grain_rows(H * static_cast<int64_t>(sizeof(scalar_t)) + L.width),
                     [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) row(x + t * H, H, ue8m0, L, out + t * L.width);  // int64 offsets
    });
  });
}

// out_RH[r] = rows back from packed FP8 rows: float32(q) * s per block (one IEEE multiply), cast to
// out's dtype (nearest even). A NaN scale (ue8m0 b = 255) or an inf scale times 0 gives NaN, written as
// the dtype's canonical quiet NaN.
// Example (H = 2, fp32 scales): q_RB = [[0x7E, 0xB0, 0, 0, 0, 0, 0, 0x40]] -> [[896, -1]]
void dequantize_rows(const at::Tensor& q_RB, int64_t H, bool ue8m0, const at::Tensor& out_RH) {
  TORCH_CHECK(q_RB.device().is_cpu() && q_RB.is_contiguous() && q_RB.scalar_type() == at::kByte && q_RB.dim() == 2,
              "q_RB must be a contiguous 2-D uint8 CPU tensor (the launcher makes it so)");
  TORCH_CHECK(out_RH.device().is_cpu() && out_RH.is_contiguous() && out_RH.dim() == 2,
              "out must be a contiguous 2-D CPU tensor");
  const int64_t R = q_RB.size(0);
  const PackedLayout L = packed_layout(H, ue8m0);
  TORCH_CHECK(q_RB.size(1) == L.width, "q_RB must have ", L.width, " bytes per row, got ", q_RB.size(1));
  TORCH_CHECK(out_RH.size(0) == R && out_RH.size(1) == H, "out must be [R, H] = [", R, ", ", H, "]");
  if (R == 0 || H == 0) return;
  const uint8_t* q = q_RB.data_ptr<uint8_t>();
  const float* lut = decode_table().v;
  const bool avx2 = g_quant_avx2.load(std::memory_order_relaxed);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out_RH.scalar_type(), "dequantize_rows", [&] {
    scalar_t* out = out_RH.data_ptr<scalar_t>();
    auto row = &dequantize_row_generic<scalar_t>;
#ifdef MOE_QUANT_AVX2
    if (avx2) row = &dequantize_row_avx2<scalar_t>;
#endif
    at::parallel_for(0, R, grain_rows(H * static_cast<int64_t>(sizeof(scalar_t)) + L.width),
                     [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) row(q + r * L.width, H, ue8m0, L, lut, out + r * H);
    });
  });
}

// Test hook: use_avx2 >= 0 sets whether the AVX2 loops run (ValueError where the CPU or build lacks
// them); returns whether they run.
bool quant_config(int64_t use_avx2) {
  if (use_avx2 >= 0) {
    TORCH_CHECK_VALUE(use_avx2 == 0 || cpu_has_avx2(), "this CPU or build has no AVX2 path");
    g_quant_avx2.store(use_avx2 != 0);
  }
  return g_quant_avx2.load();
}

// Test hooks: the element conversions alone, on whole tensors.
at::Tensor e4m3_from_f32_tensor(const at::Tensor& f) {
  TORCH_CHECK(f.device().is_cpu() && f.scalar_type() == at::kFloat, "expects a float32 CPU tensor");
  const at::Tensor src = f.contiguous();
  at::Tensor out = at::empty(src.sizes(), src.options().dtype(at::kByte));
  const float* x = src.const_data_ptr<float>();
  uint8_t* q = out.data_ptr<uint8_t>();
  at::parallel_for(0, src.numel(), 1 << 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) q[i] = e4m3_from_f32(x[i]);
  });
  return out;
}

at::Tensor e4m3_to_f32_tensor(const at::Tensor& q) {
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kByte, "expects a uint8 CPU tensor");
  const at::Tensor src = q.contiguous();
  at::Tensor out = at::empty(src.sizes(), src.options().dtype(at::kFloat));
  const uint8_t* p = src.const_data_ptr<uint8_t>();
  float* y = out.data_ptr<float>();
  for (int64_t i = 0; i < src.numel(); ++i) y[i] = e4m3_to_f32(p[i]);
  return out;
}

}  // namespace

void register_quant(pybind11::module_& m) {
  m.def("quantize_rows", &quantize_rows, "out_TB = packed FP8 rows (e4m3fn payload + block scales) of x_TH",
        py::arg("x_TH"), py::arg("ue8m0"), py::arg("out"), py::call_guard<py::gil_scoped_release>());
  m.def("dequantize_rows", &dequantize_rows, "out_RH = float32(q) * s per block of the packed rows q_RB",
        py::arg("q_RB"), py::arg("hidden"), py::arg("ue8m0"), py::arg("out"),
        py::call_guard<py::gil_scoped_release>());
  m.def("e4m3_from_f32", &e4m3_from_f32_tensor, "test hook: float32 -> float8_e4m3fn bits (uint8)",
        py::arg("f"));
  m.def("e4m3_to_f32", &e4m3_to_f32_tensor, "test hook: float8_e4m3fn bits (uint8) -> float32", py::arg("q"));
  m.def("quant_config", &quant_config, "test hook: use_avx2 >= 0 sets the loops; returns whether AVX2 runs",
        py::arg("use_avx2"));
}
