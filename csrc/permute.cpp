// Row-permutation kernels for CPU tensors, JIT-built by moe_comm/kernels/native.py.
//
// Shapes legend: T tokens, K top-k slots, S = T*K slots, N permuted rows, H hidden size,
// E experts (global), C chunks.
// Semantics: moe_comm/kernels/reference.py and moe_comm/layout.py:layout_reference, the oracles the
// tests compare against (permute and unpermute bit for bit, layout exactly).
// Build flags that matter:
//   -ffp-contract=off  no FMA: y*w is rounded in the accumulation dtype before the add, as torch does.
//   -fopenmp           at::parallel_for is OpenMP in torch's CPU build; without it every loop is serial.
// The Python launchers validate arguments, make inputs contiguous, cast weights/scales to the
// accumulation dtype and allocate outputs (through the output cache below); the checks here are
// invariants plus index ranges.
//
// Speed, measured on this repo's 2-core AMD EPYC VM, 1 thread, T=8192 H=2048 K=2 fp32 (outputs of
// 64-128 MB, far beyond the caches):
//   - Non-temporal (streaming) stores for large outputs: a normal store first reads the destination
//     line (read-for-ownership), so a gather moves 3 bytes per byte written; streaming moves 2. glibc's
//     memcpy streams only above its threshold (192 MB here, set from the 256 MB L3 the VM reports), so
//     torch's copy_ and index_select do not. Row gather: 92% of torch's copy_ with memcpy per row,
//     128% streaming with AVX2, 143% adding a prefetch of the next source row's first lines.
//   - AVX2 + F16C row loops, picked at run time: without F16C every fp16 element goes through c10's
//     software conversion (fp16 unpermute was 9% of memcpy).
//   - Fresh outputs come from a cache of already-touched blocks (OutputCache): a fresh 64 MB output
//     page-faulted 16384 times on first touch (55-80 ms, the kernel itself takes 12-20 ms).

// Narrow headers instead of <torch/extension.h> (the whole C++ frontend): the build went 82 -> ~50 s.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>

#include <ATen/Dispatch.h>
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <type_traits>
#include <unordered_map>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <pthread.h>
#include <sys/mman.h>
#define MOE_HAVE_MMAP 1
#endif
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define MOE_X86 1
#endif
// The AVX2 path needs GCC's `#pragma GCC target` (clang ignores it); other compilers get the generic path.
#if defined(MOE_X86) && defined(__GNUC__) && !defined(__clang__)
#define MOE_AVX2 1
#endif

namespace {

// Accumulation dtype (reference.acc_dtype): float64 rows accumulate in double, all others in float.
template <typename scalar_t>
struct Acc {
  using type = float;
};
template <>
struct Acc<double> {
  using type = double;
};

// Grain of at::parallel_for: a second thread joins only when each gets at least this many bytes, so
// the OpenMP fork/join (a few us) stays small next to the work (64 KB is ~3 us at 20 GB/s). Above
// that, torch's OpenMP backend splits the range into one contiguous block per thread. With one thread
// at::parallel_for calls the body directly.
constexpr int64_t kTaskBytes = 64 * 1024;

// Hidden columns accumulated at a time in unpermute when a token has more than kGroup valid rows:
// 1024 fp32 = 4 KB of partial sums stays in L1 between groups.
constexpr int64_t kTile = 1024;

// Independent partial sums in the dot product, so the compiler can keep them in one vector register
// (a single running sum is a serial dependency chain it must not reorder).
constexpr int64_t kLanes = 16;

// Valid rows one pass over H adds side by side. A token with at most this many valid slots (every
// K <= 4 routing) is done in one pass: no accumulator round trip through memory, R + 1 long streams.
// Measured (2 threads, T=8192 H=2048 K=2 fp32, memcpy ~34 GB/s): 25 GB/s with one row at a time
// into a 1024-column accumulator tile, 31 GB/s with this fused pass.
constexpr int kGroup = 4;

// Outputs at least this large are written with streaming stores. Measured (1 thread, fp32 gather of
// 8 KB rows, then a sum reading the output back): streaming took 1.23x the time at 4 MB, 0.83x at
// 8 MB, 0.74-0.81x at 16-64 MB. Below, the output is better left in cache for its reader.
std::atomic<int64_t> g_stream_min_bytes{8 << 20};

bool cpu_has_avx2() {
#ifdef MOE_AVX2
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

std::atomic<bool> g_use_avx2{cpu_has_avx2()};

int64_t grain_for(int64_t bytes_per_item) {
  return std::max<int64_t>(1, kTaskBytes / std::max<int64_t>(1, bytes_per_item));
}

bool stream_output(const at::Tensor& out) {
  return out.nbytes() >= static_cast<size_t>(g_stream_min_bytes.load(std::memory_order_relaxed));
}

void check_cpu_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous (the launcher makes it so)");
}

// Serial pre-scan of an index array: errors are raised here, never inside a parallel region.
void check_index_range(const int64_t* idx, int64_t count, int64_t lo, int64_t hi, const char* name) {
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK_VALUE(idx[i] >= lo && idx[i] < hi, name, " values must be in [", lo, ", ", hi,
                      "), got ", idx[i], " at flat position ", i);
  }
}

// The first two cache lines of the row a loop reads next: the hardware prefetcher follows a row once
// it has started, not the jump to a random next row.
inline void prefetch_row_head(const void* p) {
  __builtin_prefetch(p, 0, 3);
  __builtin_prefetch(static_cast<const char*>(p) + 64, 0, 3);
}

// Makes this thread's streaming stores visible before the kernel returns (they are weakly ordered).
inline void store_fence() {
#ifdef MOE_X86
  _mm_sfence();
#endif
}

// ---------------------------------------------------------------------------------------------------
// Row primitives. Two implementations with one interface, chosen once per call (g_use_avx2):
//   add_rows<R, kFirst, kLast, kStream>(y_R, w_R, acc, out, len): one pass over len columns adding R rows,
//     in slot order, to the running sum of each column:
//       a = kFirst ? +0 : acc[i];  a = a + y_R[r][i] * w_R[r] for r = 0..R-1;  kLast ? out[i] = a : acc[i] = a.
//   scale_row<kStream>(x, s, out, len): out[i] = x[i] * s in the accumulation dtype, cast back.
//   stream_bytes(dst, src, n): copy with streaming stores (x86).
// kStream: write out with streaming stores where the implementation has them (the caller fences).
// Both round every product and sum exactly as torch does (no FMA, same order), so they agree bit for bit.
// ---------------------------------------------------------------------------------------------------
// The generic loops store normally even when asked to stream: computing a tile into an L1 buffer and
// streaming that out was slower than plain stores (AVX2 loops, K=1 unpermute of 8 KB rows: 72% of
// torch's copy_ vs 82%); only whole-row copies (stream_bytes) stream here.
struct RowsGeneric {
  template <int R, bool kFirst, bool kLast, bool kStream = false, typename scalar_t, typename acc_t>
  static void add_rows(const scalar_t* const* y_R, const acc_t* w_R, acc_t* __restrict__ acc,
                       scalar_t* __restrict__ out, int64_t len) {
    const scalar_t* p[R];
    acc_t wr[R];
    for (int r = 0; r < R; ++r) {
      p[r] = y_R[r];
      wr[r] = w_R[r];
    }
    for (int64_t i = 0; i < len; ++i) {
      acc_t a = kFirst ? acc_t(0) : acc[i];
      for (int r = 0; r < R; ++r) a = a + static_cast<acc_t>(p[r][i]) * wr[r];
      if constexpr (kLast) {
        out[i] = static_cast<scalar_t>(a);
      } else {
        acc[i] = a;
      }
    }
  }

  template <bool kStream = false, typename scalar_t, typename acc_t>
  static void scale_row(const scalar_t* __restrict__ x, acc_t s, scalar_t* __restrict__ out, int64_t len) {
    for (int64_t i = 0; i < len; ++i) out[i] = static_cast<scalar_t>(static_cast<acc_t>(x[i]) * s);
  }

  static void stream_bytes(char* dst, const char* src, int64_t n) {
#ifdef MOE_X86
    // SSE2 is in every x86-64 CPU. Head up to 16-byte alignment and the tail: plain copies.
    const int64_t head = std::min<int64_t>(n, (16 - reinterpret_cast<uintptr_t>(dst) % 16) % 16);
    std::memcpy(dst, src, static_cast<size_t>(head));
    int64_t i = head;
    for (; i + 64 <= n; i += 64) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
      const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
    }
    std::memcpy(dst + i, src + i, static_cast<size_t>(n - i));
#else
    std::memcpy(dst, src, static_cast<size_t>(n));
#endif
  }
};

}  // namespace

#ifdef MOE_AVX2
// Everything up to the pop is compiled for AVX2 + F16C and only called after the CPU check.
// (Only this file's own code: the torch headers above keep the baseline target.)
#pragma GCC push_options
#pragma GCC target("avx2,f16c")
namespace {
namespace avx2 {

// Vector of the accumulation dtype: 8 floats or 4 doubles.
template <typename acc_t>
struct AccVec;
template <>
struct AccVec<float> {
  using V = __m256;
  static constexpr int W = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float v) { return _mm256_set1_ps(v); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
};
template <>
struct AccVec<double> {
  using V = __m256d;
  static constexpr int W = 4;
  static V zero() { return _mm256_setzero_pd(); }
  static V set1(double v) { return _mm256_set1_pd(v); }
  static V add(V a, V b) { return _mm256_add_pd(a, b); }
  static V mul(V a, V b) { return _mm256_mul_pd(a, b); }
  static V load(const double* p) { return _mm256_loadu_pd(p); }
  static void store(double* p, V v) { _mm256_storeu_pd(p, v); }
};

// W elements of scalar_t loaded as / stored from an accumulation vector, with the rounding of c10's
// scalar casts: bf16 round-to-nearest-even with NaN -> 0x7FC0 (c10::detail::round_to_nearest_even),
// fp16 IEEE round-to-nearest-even (what torch's own AVX2 kernels use via F16C).
template <typename scalar_t>
struct Io;
// stream(p, v): the same store, non-temporal; p must be kAlign-byte aligned.
template <>
struct Io<float> {
  using A = AccVec<float>;
  static constexpr int kAlign = 32;
  static A::V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, A::V v) { _mm256_storeu_ps(p, v); }
  static void stream(float* p, A::V v) { _mm256_stream_ps(p, v); }
};
template <>
struct Io<double> {
  using A = AccVec<double>;
  static constexpr int kAlign = 32;
  static A::V load(const double* p) { return _mm256_loadu_pd(p); }
  static void store(double* p, A::V v) { _mm256_storeu_pd(p, v); }
  static void stream(double* p, A::V v) { _mm256_stream_pd(p, v); }
};
template <>
struct Io<c10::BFloat16> {
  using A = AccVec<float>;
  static constexpr int kAlign = 16;
  static A::V load(const c10::BFloat16* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static void store(c10::BFloat16* p, A::V v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), pack(v)); }
  static void stream(c10::BFloat16* p, A::V v) { _mm_stream_si128(reinterpret_cast<__m128i*>(p), pack(v)); }
  static __m128i pack(A::V v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)),
                                          _mm256_set1_epi32(0x7FFF));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    // Lanes hold values < 2^16: the unsigned-saturating pack keeps them as they are.
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  }
};
template <>
struct Io<c10::Half> {
  using A = AccVec<float>;
  static constexpr int kAlign = 16;
  static A::V load(const c10::Half* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store(c10::Half* p, A::V v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), pack(v)); }
  static void stream(c10::Half* p, A::V v) { _mm_stream_si128(reinterpret_cast<__m128i*>(p), pack(v)); }
  static __m128i pack(A::V v) { return _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
};

// Elements before p + n is kAlign-byte aligned (p is aligned to its element size), at most len.
template <typename scalar_t>
int64_t to_aligned(const scalar_t* p, int64_t len) {
  const uintptr_t a = Io<scalar_t>::kAlign;
  const int64_t n = static_cast<int64_t>((a - reinterpret_cast<uintptr_t>(p) % a) % a / sizeof(scalar_t));
  return std::min(n, len);
}

// Two vectors per iteration: with streaming stores that is one full 64-byte line of fp32/fp64 output
// (measured, K=2 fp32 unpermute of 8 KB rows: 80% of torch's copy_ vs 74% with one vector).
struct RowsAvx2 {
  template <int R, bool kFirst, bool kLast, bool kStream = false, typename scalar_t, typename acc_t>
  static void add_rows(const scalar_t* const* y_R, const acc_t* w_R, acc_t* acc, scalar_t* out, int64_t len) {
    using IO = Io<scalar_t>;
    using A = typename IO::A;
    constexpr int W = A::W;
    static_assert(std::is_same<typename Acc<scalar_t>::type, acc_t>::value, "accumulation dtype");
    const scalar_t* p[R];
    typename A::V wv[R];
    for (int r = 0; r < R; ++r) {
      p[r] = y_R[r];
      wv[r] = A::set1(w_R[r]);
    }
    // Columns outside the vector loop (a head up to the streaming stores' alignment, the tail): the
    // generic loop, same arithmetic one column at a time.
    auto scalar_part = [&](int64_t i0, int64_t n) {
      const scalar_t* q[R];
      for (int r = 0; r < R; ++r) q[r] = p[r] + i0;
      RowsGeneric::add_rows<R, kFirst, kLast>(q, w_R, acc + i0, out + i0, n);
    };
    auto sum = [&](int64_t i) {
      typename A::V a = kFirst ? A::zero() : A::load(acc + i);
      for (int r = 0; r < R; ++r) a = A::add(a, A::mul(IO::load(p[r] + i), wv[r]));
      return a;
    };
    auto put = [&](int64_t i, typename A::V a) {
      if constexpr (!kLast) {
        A::store(acc + i, a);
      } else if constexpr (kStream) {
        IO::stream(out + i, a);
      } else {
        IO::store(out + i, a);
      }
    };
    int64_t i = 0;
    if constexpr (kLast && kStream) {
      i = to_aligned(out, len);
      scalar_part(0, i);
    }
    for (; i + 2 * W <= len; i += 2 * W) {
      const typename A::V a = sum(i), b = sum(i + W);
      put(i, a);
      put(i + W, b);
    }
    for (; i + W <= len; i += W) put(i, sum(i));
    if (i < len) scalar_part(i, len - i);
  }

  template <bool kStream = false, typename scalar_t, typename acc_t>
  static void scale_row(const scalar_t* x, acc_t s, scalar_t* out, int64_t len) {
    using IO = Io<scalar_t>;
    using A = typename IO::A;
    const typename A::V sv = A::set1(s);
    int64_t i = 0;
    if constexpr (kStream) {
      i = to_aligned(out, len);
      RowsGeneric::scale_row(x, s, out, i);
    }
    for (; i + A::W <= len; i += A::W) {
      const typename A::V v = A::mul(IO::load(x + i), sv);
      if constexpr (kStream) {
        IO::stream(out + i, v);
      } else {
        IO::store(out + i, v);
      }
    }
    RowsGeneric::scale_row(x + i, s, out + i, len - i);
  }

  static void stream_bytes(char* dst, const char* src, int64_t n) {
    // Measured (64 MB copy, 1 thread): 165% of torch's copy_ with 32-byte streams, 140% with 16-byte.
    const int64_t head = std::min<int64_t>(n, (32 - reinterpret_cast<uintptr_t>(dst) % 32) % 32);
    std::memcpy(dst, src, static_cast<size_t>(head));
    int64_t i = head;
    for (; i + 128 <= n; i += 128) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 32));
      const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 64));
      const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 96));
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), a);
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 32), b);
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 64), c);
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 96), d);
    }
    for (; i + 32 <= n; i += 32) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i),
                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
    }
    std::memcpy(dst + i, src + i, static_cast<size_t>(n - i));
  }
};

}  // namespace avx2
}  // namespace
#pragma GCC pop_options
#endif  // MOE_AVX2

namespace {

// Runs fn(rows) with rows a RowsAvx2 or RowsGeneric: the row primitives this CPU supports.
template <typename Fn>
void with_rows(Fn&& fn) {
#ifdef MOE_AVX2
  if (g_use_avx2.load(std::memory_order_relaxed)) {
    fn(avx2::RowsAvx2{});
    return;
  }
#endif
  fn(RowsGeneric{});
}

template <class Rows, bool kFirst, bool kLast, bool kStream, typename scalar_t, typename acc_t>
void add_rows_n(int n, const scalar_t* const* y_R, const acc_t* w_R, acc_t* acc, scalar_t* out, int64_t len) {
  switch (n) {
    case 1: return Rows::template add_rows<1, kFirst, kLast, kStream>(y_R, w_R, acc, out, len);
    case 2: return Rows::template add_rows<2, kFirst, kLast, kStream>(y_R, w_R, acc, out, len);
    case 3: return Rows::template add_rows<3, kFirst, kLast, kStream>(y_R, w_R, acc, out, len);
    default: return Rows::template add_rows<kGroup, kFirst, kLast, kStream>(y_R, w_R, acc, out, len);
  }
}

// out_H = sum of the m rows y_R[0..m) times w_R[0..m), in that order (m >= 1).
template <class Rows, bool kStream, typename scalar_t, typename acc_t>
void sum_rows(int64_t m, const scalar_t* const* y_R, const acc_t* w_R, acc_t* acc_tile, scalar_t* out_H, int64_t H) {
  if (m <= kGroup) {
    add_rows_n<Rows, true, true, kStream>(static_cast<int>(m), y_R, w_R, acc_tile, out_H, H);
    return;
  }
  // More than kGroup valid rows: column tiles of kTile, groups of kGroup rows through the acc tile.
  for (int64_t h0 = 0; h0 < H; h0 += kTile) {
    const int64_t len = std::min(kTile, H - h0);
    const scalar_t* tile_R[kGroup];
    for (int64_t g = 0; g < m; g += kGroup) {
      const int n = static_cast<int>(std::min<int64_t>(kGroup, m - g));
      for (int r = 0; r < n; ++r) tile_R[r] = y_R[g + r] + h0;
      const bool first = g == 0, last = g + kGroup >= m;
      if (first) {
        add_rows_n<Rows, true, false, false>(n, tile_R, w_R + g, acc_tile, out_H + h0, len);
      } else if (last) {
        add_rows_n<Rows, false, true, kStream>(n, tile_R, w_R + g, acc_tile, out_H + h0, len);
      } else {
        add_rows_n<Rows, false, false, false>(n, tile_R, w_R + g, acc_tile, out_H + h0, len);
      }
    }
  }
}

// Runs fn(std::integral_constant<bool, stream>()).
template <typename Fn>
void with_stream(bool stream, Fn&& fn) {
  if (stream) {
    fn(std::true_type{});
  } else {
    fn(std::false_type{});
  }
}

// ---------------------------------------------------------------------------------------------------
// Output cache: a CPU allocator for the launchers' fresh outputs that keeps freed blocks for reuse.
// PyTorch has no caching allocator on CPU; a fresh large tensor is mmapped by glibc and page-faults on
// first touch, and even with malloc told to keep freed memory (moe_comm.tools.launch.cache_freed_memory)
// the heap took 2 to 8 calls to settle on reusable blocks (fresh processes, 64 MB unpermute outputs:
// 16384 faults per call until then; a process timed over those calls ran at 31% of memcpy).
// Here a freed block goes back to an idle list and the next output of a size it fits takes it, touched
// and fault-free, from the first reuse on (a `y = f(x)` loop: two new blocks, then none). Block sizes are
// rounded up to kSizeClass, so outputs whose row count varies a little (dropped slots) share blocks.
// Idle blocks are kept up to a byte limit (default 256 MiB, native.set_output_cache_limit); above it a freed
// block is unmapped. Thread-safe; the deleter may run on any thread. Blocks below kCacheMinBytes come
// from torch's allocator (malloc's heap reuses small blocks without faults).
// New blocks keep the system's default pages: advising MADV_HUGEPAGE made the first touches slower on
// this VM (the two faulting calls of a fresh process at 10-20% of memcpy vs 22-29% with 4 KB pages,
// 5 processes each; 2 MB first touches ranged from 12 to 150 ms), and reused blocks do not fault.
// ---------------------------------------------------------------------------------------------------
constexpr size_t kCacheMinBytes = size_t(1) << 20;
constexpr size_t kSizeClass = size_t(2) << 20;

class OutputCache final : public c10::Allocator {
 public:
  // Never destroyed: tensors holding cached blocks may be freed during interpreter exit.
  static OutputCache& get() {
    static OutputCache* cache = new OutputCache();
    return *cache;
  }

  OutputCache() {
#ifdef MOE_HAVE_MMAP
    // A fork while another thread holds the lock (a tensor freed on an autograd or gloo thread) would
    // leave the child's copy locked forever: hold it across fork, as glibc does for malloc.
    pthread_atfork([] { get().mu_.lock(); }, [] { get().mu_.unlock(); }, [] { get().mu_.unlock(); });
#endif
  }

  at::DataPtr allocate(size_t n) override {
    void* p = n >= kCacheMinBytes ? take(n) : nullptr;
    if (p == nullptr) return c10::GetDefaultCPUAllocator()->allocate(n);
    return {p, p, &OutputCache::release, at::Device(at::kCPU)};
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  int64_t set_limit(int64_t limit) {
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t previous = static_cast<int64_t>(limit_);
    limit_ = static_cast<size_t>(limit);
    while (idle_bytes_ > limit_) {  // largest idle blocks first
      auto it = std::prev(idle_.end());
      unmap_locked(it->second, it->first);
      idle_bytes_ -= it->first;
      idle_.erase(it);
    }
    return previous;
  }

  // (idle bytes, mapped bytes: idle plus in use, limit, hits, misses)
  std::vector<int64_t> stats() {
    std::lock_guard<std::mutex> lock(mu_);
    return {static_cast<int64_t>(idle_bytes_), static_cast<int64_t>(mapped_bytes_), static_cast<int64_t>(limit_),
            hits_, misses_};
  }

 private:
  static size_t round_up(size_t n) { return (n + kSizeClass - 1) / kSizeClass * kSizeClass; }

  // An idle block of capacity in [rounded n, 1.25 * rounded n], smallest first, else a new one.
  void* take(size_t n) {
    const size_t want = round_up(n);
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = idle_.lower_bound(want);
      if (it != idle_.end() && it->first <= want + want / 4) {
        void* p = it->second;
        idle_bytes_ -= it->first;
        idle_.erase(it);
        ++hits_;
        return p;
      }
      ++misses_;
    }
    void* p = map(want);
    if (p != nullptr) {
      std::lock_guard<std::mutex> lock(mu_);
      capacity_[p] = want;
      mapped_bytes_ += want;
    }
    return p;
  }

  static void release(void* p) {
    OutputCache& c = get();
    std::lock_guard<std::mutex> lock(c.mu_);
    const size_t cap = c.capacity_.at(p);
    if (c.idle_bytes_ + cap <= c.limit_) {
      c.idle_.emplace(cap, p);
      c.idle_bytes_ += cap;
    } else {
      c.unmap_locked(p, cap);
    }
  }

  void unmap_locked(void* p, size_t cap) {
    capacity_.erase(p);
    mapped_bytes_ -= cap;
#ifdef MOE_HAVE_MMAP
    munmap(p, cap);
#else
    std::free(p);
#endif
  }

  // bytes (a multiple of kSizeClass), page-aligned (torch wants 64), or nullptr.
  static void* map(size_t bytes) {
#ifdef MOE_HAVE_MMAP
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? nullptr : p;
#else
    return std::aligned_alloc(64, bytes);
#endif
  }

  std::mutex mu_;
  std::multimap<size_t, void*> idle_;           // capacity -> idle block
  std::unordered_map<void*, size_t> capacity_;  // every block mapped here, idle or in use
  size_t idle_bytes_ = 0, mapped_bytes_ = 0, limit_ = size_t(256) << 20;  // 256 MiB: 4 outputs of T 8192 x H 2048 fp32
  int64_t hits_ = 0, misses_ = 0;
};

}  // namespace

// A new uninitialised CPU tensor of `sizes` and like's dtype from the output cache (contiguous).
at::Tensor empty_cached(at::IntArrayRef sizes, const at::Tensor& like) {
  return at::Tensor(at::detail::empty_generic(sizes, &OutputCache::get(), c10::DispatchKeySet(c10::DispatchKey::CPU),
                                              like.scalar_type(), c10::nullopt));
}

int64_t set_output_cache_limit(int64_t limit_bytes) {
  TORCH_CHECK_VALUE(limit_bytes >= 0, "limit_bytes must be >= 0, got ", limit_bytes);
  return OutputCache::get().set_limit(limit_bytes);
}

std::vector<int64_t> output_cache_stats() { return OutputCache::get().stats(); }

// Tuning and test hooks: set each knob given >= 0, return both as they are then
// (stream_min_bytes, use_avx2). use_avx2 = 1 is refused where the CPU or the build lacks AVX2 + F16C.
std::vector<int64_t> kernel_config(int64_t stream_min_bytes, int64_t use_avx2) {
  if (stream_min_bytes >= 0) g_stream_min_bytes.store(stream_min_bytes);
  if (use_avx2 >= 0) {
    TORCH_CHECK_VALUE(use_avx2 == 0 || cpu_has_avx2(), "this CPU or build has no AVX2 + F16C path");
    g_use_avx2.store(use_avx2 != 0);
  }
  return {g_stream_min_bytes.load(), g_use_avx2.load() ? 1 : 0};
}

// out_NH[n] = x_TH[token_N[n]] (* scale_N[n], computed in the accumulation dtype, cast back).
// Example:
//   x_TH = [[1, 1], [2, 2]], token_N = [1, 0, 1]      -> out_NH = [[2, 2], [1, 1], [2, 2]]
//   with scale_N = [0.5, 1, 2]                        -> out_NH = [[1, 1], [1, 1], [4, 4]]
void permute_rows(const at::Tensor& x_TH, const at::Tensor& token_N, const c10::optional<at::Tensor>& scale_N,
                  const at::Tensor& out_NH) {
  check_cpu_contiguous(x_TH, "x_TH");
  check_cpu_contiguous(token_N, "token_N");
  check_cpu_contiguous(out_NH, "out");
  TORCH_CHECK(x_TH.dim() == 2 && out_NH.dim() == 2 && token_N.dim() == 1, "permute_rows: bad ranks");
  TORCH_CHECK(token_N.scalar_type() == at::kLong, "token_N must be int64");
  const int64_t T = x_TH.size(0), H = x_TH.size(1), N = token_N.size(0);
  TORCH_CHECK(out_NH.size(0) == N && out_NH.size(1) == H && out_NH.scalar_type() == x_TH.scalar_type(),
              "out must be [N, H] of x_TH's dtype");
  const int64_t* tok = token_N.data_ptr<int64_t>();
  check_index_range(tok, N, 0, T, "token_N");
  const bool stream = stream_output(out_NH);

  if (!scale_N.has_value()) {
    // One contiguous copy per row, any dtype. int64 offsets: N*H can exceed 2^31.
    const int64_t row_bytes = H * static_cast<int64_t>(x_TH.element_size());
    const char* src = static_cast<const char*>(x_TH.const_data_ptr());
    char* dst = static_cast<char*>(out_NH.data_ptr());
    with_rows([&](auto rows) {
      using Rows = decltype(rows);
      at::parallel_for(0, N, grain_for(2 * row_bytes), [&](int64_t begin, int64_t end) {
        for (int64_t n = begin; n < end; ++n) {
          if (n + 1 < end) prefetch_row_head(src + tok[n + 1] * row_bytes);
          if (stream) {
            Rows::stream_bytes(dst + n * row_bytes, src + tok[n] * row_bytes, row_bytes);
          } else {
            std::memcpy(dst + n * row_bytes, src + tok[n] * row_bytes, static_cast<size_t>(row_bytes));
          }
        }
        if (stream) store_fence();
      });
    });
    return;
  }

  const at::Tensor& scale = *scale_N;
  check_cpu_contiguous(scale, "scale_N");
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == N, "scale_N must be [N]");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x_TH.scalar_type(), "permute_rows", [&] {
    using acc_t = typename Acc<scalar_t>::type;
    TORCH_CHECK(scale.scalar_type() == c10::CppTypeToScalarType<acc_t>::value,
                "scale_N must be in the accumulation dtype (the launcher casts it)");
    const scalar_t* x = x_TH.const_data_ptr<scalar_t>();
    const acc_t* s = scale.const_data_ptr<acc_t>();
    scalar_t* out = out_NH.data_ptr<scalar_t>();
    const int64_t row_bytes = H * static_cast<int64_t>(sizeof(scalar_t));
    with_rows([&](auto rows) {
      with_stream(stream, [&](auto stream_c) {
        using Rows = decltype(rows);
        constexpr bool kStream = decltype(stream_c)::value;
        at::parallel_for(0, N, grain_for(2 * row_bytes), [&](int64_t begin, int64_t end) {
          for (int64_t n = begin; n < end; ++n) {
            if (n + 1 < end) prefetch_row_head(x + tok[n + 1] * H);
            Rows::template scale_row<kStream>(x + tok[n] * H, s[n], out + n * H, H);
          }
          if (kStream) store_fence();
        });
      });
    });
  });
}

// out_TH[t] = sum over k = 0..K-1, in that order, of weight_TK[t, k] * y_NH[row_TK[t, k]], skipping
// row -1 (dropped). acc starts at +0 and each step is acc = acc + (y * w) with the product rounded
// first, exactly torch's `total += rows * w` in reference.py; then cast to y's dtype. No weights:
// w = 1, and y * 1 == y exactly, as in the reference. A token with no valid slot gets a row of +0.
// Example:
//   y_NH = [[1, 1], [2, 2], [3, 3]], row_TK = [[2, 0], [1, -1]], weight_TK = [[.5, 1], [2, 9]]
//   -> out_TH = [[.5*3 + 1*1, ...], [2*2, ...]] = [[2.5, 2.5], [4, 4]]  (weight 9 belongs to a dropped slot)
void unpermute_rows(const at::Tensor& y_NH, const at::Tensor& row_TK, const c10::optional<at::Tensor>& weight_TK,
                    const at::Tensor& out_TH) {
  check_cpu_contiguous(y_NH, "y_NH");
  check_cpu_contiguous(row_TK, "row_TK");
  check_cpu_contiguous(out_TH, "out");
  TORCH_CHECK(y_NH.dim() == 2 && row_TK.dim() == 2 && out_TH.dim() == 2, "unpermute_rows: bad ranks");
  TORCH_CHECK(row_TK.scalar_type() == at::kLong, "row_TK must be int64");
  const int64_t N = y_NH.size(0), H = y_NH.size(1), T = row_TK.size(0), K = row_TK.size(1);
  TORCH_CHECK(out_TH.size(0) == T && out_TH.size(1) == H && out_TH.scalar_type() == y_NH.scalar_type(),
              "out must be [T, H] of y_NH's dtype");
  const int64_t* row = row_TK.data_ptr<int64_t>();
  check_index_range(row, T * K, -1, N, "row_TK");
  const bool stream = stream_output(out_TH);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, y_NH.scalar_type(), "unpermute_rows", [&] {
    using acc_t = typename Acc<scalar_t>::type;
    const acc_t* w = nullptr;  // nullptr: plain sum
    if (weight_TK.has_value()) {
      const at::Tensor& weight = *weight_TK;
      check_cpu_contiguous(weight, "weight_TK");
      TORCH_CHECK(weight.sizes() == row_TK.sizes(), "weight_TK must be [T, K]");
      TORCH_CHECK(weight.scalar_type() == c10::CppTypeToScalarType<acc_t>::value,
                  "weight_TK must be in the accumulation dtype (the launcher casts it)");
      w = weight.const_data_ptr<acc_t>();
    }
    const scalar_t* y = y_NH.const_data_ptr<scalar_t>();
    scalar_t* out = out_TH.data_ptr<scalar_t>();
    const size_t row_bytes = static_cast<size_t>(H) * sizeof(scalar_t);
    // Bytes per token: K rows read + 1 row written.
    const int64_t token_bytes = (K + 1) * static_cast<int64_t>(row_bytes);
    with_rows([&](auto rows) {
      with_stream(stream, [&](auto stream_c) {
        using Rows = decltype(rows);
        constexpr bool kStream = decltype(stream_c)::value;
        at::parallel_for(0, T, grain_for(token_bytes), [&](int64_t begin, int64_t end) {
          std::vector<const scalar_t*> y_R(K);  // the valid rows of one token, in slot order
          std::vector<acc_t> w_R(K);
          alignas(64) acc_t acc_tile[kTile];
          for (int64_t t = begin; t < end; ++t) {
            if (t + 1 < end) {
              for (int64_t k = 0; k < K; ++k) {
                const int64_t r = row[(t + 1) * K + k];
                if (r >= 0) prefetch_row_head(y + r * H);
              }
            }
            int64_t m = 0;
            for (int64_t k = 0; k < K; ++k) {
              const int64_t r = row[t * K + k];
              if (r < 0) continue;  // dropped slot
              y_R[m] = y + r * H;
              w_R[m] = w != nullptr ? w[t * K + k] : acc_t(1);
              ++m;
            }
            scalar_t* o_H = out + t * H;
            if (m == 0) {
              std::memset(static_cast<void*>(o_H), 0, row_bytes);  // +0 in every float dtype
            } else {
              sum_rows<Rows, kStream>(m, y_R.data(), w_R.data(), acc_tile, o_H, H);
            }
          }
          if (kStream) store_fence();
        });
      });
    });
  });
}

namespace {

template <typename scalar_t, typename grad_t>
void weight_grad_impl(const grad_t* grad, const scalar_t* y, const int64_t* row, typename Acc<scalar_t>::type* out,
                      int64_t T, int64_t K, int64_t H) {
  using acc_t = typename Acc<scalar_t>::type;
  const int64_t token_bytes = (K + 1) * H * static_cast<int64_t>(sizeof(scalar_t));
  at::parallel_for(0, T, grain_for(token_bytes), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const grad_t* g_H = grad + t * H;
      for (int64_t k = 0; k < K; ++k) {
        const int64_t r = row[t * K + k];
        if (r < 0) {  // dropped slot: gradient 0
          out[t * K + k] = acc_t(0);
          continue;
        }
        const scalar_t* y_H = y + r * H;
        acc_t part[kLanes] = {};
        int64_t h = 0;
        for (; h + kLanes <= H; h += kLanes) {
          for (int64_t j = 0; j < kLanes; ++j) {
            part[j] = part[j] + static_cast<acc_t>(g_H[h + j]) * static_cast<acc_t>(y_H[h + j]);
          }
        }
        for (; h < H; ++h) part[0] = part[0] + static_cast<acc_t>(g_H[h]) * static_cast<acc_t>(y_H[h]);
        acc_t dot = 0;
        for (int64_t j = 0; j < kLanes; ++j) dot = dot + part[j];
        out[t * K + k] = dot;
      }
    }
  });
}

}  // namespace

// g_TK[t, k] = <grad_TH[t], y_NH[row_TK[t, k]]> in the accumulation dtype, 0 for dropped slots.
// grad_TH is either y's dtype or the accumulation dtype. Summation order differs from torch's, so
// results match the reference to fp tolerance, not bit for bit.
// Example:
//   grad_TH = [[1, 2]], y_NH = [[3, 4], [5, 6]], row_TK = [[1, -1]]
//   -> g_TK = [[1*5 + 2*6, 0]] = [[17, 0]]
at::Tensor unpermute_weight_grad(const at::Tensor& grad_TH, const at::Tensor& y_NH, const at::Tensor& row_TK) {
  check_cpu_contiguous(grad_TH, "grad_TH");
  check_cpu_contiguous(y_NH, "y_NH");
  check_cpu_contiguous(row_TK, "row_TK");
  TORCH_CHECK(grad_TH.dim() == 2 && y_NH.dim() == 2 && row_TK.dim() == 2, "unpermute_weight_grad: bad ranks");
  TORCH_CHECK(row_TK.scalar_type() == at::kLong, "row_TK must be int64");
  const int64_t N = y_NH.size(0), H = y_NH.size(1), T = row_TK.size(0), K = row_TK.size(1);
  TORCH_CHECK(grad_TH.size(0) == T && grad_TH.size(1) == H, "grad_TH must be [T, H]");
  const int64_t* row = row_TK.data_ptr<int64_t>();
  check_index_range(row, T * K, -1, N, "row_TK");

  at::Tensor g_TK;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, y_NH.scalar_type(), "unpermute_weight_grad", [&] {
    using acc_t = typename Acc<scalar_t>::type;
    const auto acc_type = c10::CppTypeToScalarType<acc_t>::value;
    g_TK = at::empty({T, K}, y_NH.options().dtype(acc_type));
    const scalar_t* y = y_NH.const_data_ptr<scalar_t>();
    acc_t* out = g_TK.data_ptr<acc_t>();
    if (grad_TH.scalar_type() == y_NH.scalar_type()) {
      weight_grad_impl<scalar_t, scalar_t>(grad_TH.const_data_ptr<scalar_t>(), y, row, out, T, K, H);
    } else {
      TORCH_CHECK(grad_TH.scalar_type() == acc_type, "grad_TH must be y_NH's dtype or ", acc_type);
      weight_grad_impl<scalar_t, acc_t>(grad_TH.const_data_ptr<acc_t>(), y, row, out, T, K, H);
    }
  });
  return g_TK;
}

namespace {
// part[j] += g[h] * y[h] over the columns h = j (mod kLanes) of [0, len); a tail shorter than kLanes
// goes to part[0] (only the last tile of a row has one: kTile is a multiple of kLanes).
// The lanes are a local copy: through the pointer the compiler must assume part aliases g / y (float rows)
// and reload it every step.
template <typename scalar_t, typename acc_t>
inline void dot_lanes(const scalar_t* g, const scalar_t* y, int64_t len, acc_t* part) {
  acc_t p[kLanes];
  for (int64_t j = 0; j < kLanes; ++j) p[j] = part[j];
  int64_t h = 0;
  for (; h + kLanes <= len; h += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) p[j] = p[j] + static_cast<acc_t>(g[h + j]) * static_cast<acc_t>(y[h + j]);
  }
  for (; h < len; ++h) p[0] = p[0] + static_cast<acc_t>(g[h]) * static_cast<acc_t>(y[h]);
  for (int64_t j = 0; j < kLanes; ++j) part[j] = p[j];
}
}  // namespace

// Both gradients of unpermute_rows in one pass per token: grad_TH[t] is read once, in column tiles of
// kTile that stay in L1 while the K slots use them (the two-kernel backward read it 2K times: a
// scaled permute and then K dot products). For slot (t, k) with row r = row_TK[t, k] >= 0:
//   grad_y_NH[r] = grad_TH[t] * weight_TK[t, k] in the accumulation dtype, cast back (permute_rows with
//                  scales, bit for bit); without weights an exact copy of grad_TH[t];
//   grad_w_TK[t, k] = <grad_TH[t], y_NH[r]> in the accumulation dtype (0 for a dropped slot).
// Rows of grad_y no slot points at are not written. Either output may be absent.
// Measured (1 thread, T=2048 H=2048 fp32, medians of 15 on the shared 2-core VM, two runs): K=2 3.8-7.7 ms
// vs 6.9-9.5 ms for permute_rows + unpermute_weight_grad; K=8 22-39 ms vs 46-47 ms (1.2-2.1x).
// Example:
//   grad_TH = [[1, 2]], row_TK = [[1, -1]], weight_TK = [[0.5, 9]], y_NH = [[3, 4], [5, 6]]
//   -> grad_y_NH[1] = [0.5, 1] (row 0 untouched), grad_w_TK = [[17, 0]]
void unpermute_backward(const at::Tensor& grad_TH, const at::Tensor& row_TK, const c10::optional<at::Tensor>& weight_TK,
                        const c10::optional<at::Tensor>& y_NH, const c10::optional<at::Tensor>& grad_y_NH,
                        const c10::optional<at::Tensor>& grad_w_TK) {
  check_cpu_contiguous(grad_TH, "grad_TH");
  check_cpu_contiguous(row_TK, "row_TK");
  TORCH_CHECK(grad_TH.dim() == 2 && row_TK.dim() == 2, "unpermute_backward: bad ranks");
  TORCH_CHECK(row_TK.scalar_type() == at::kLong, "row_TK must be int64");
  const int64_t T = grad_TH.size(0), H = grad_TH.size(1), K = row_TK.size(1);
  TORCH_CHECK(row_TK.size(0) == T, "row_TK must be [T, K]");
  TORCH_CHECK(grad_y_NH.has_value() || grad_w_TK.has_value(), "unpermute_backward: no output asked for");
  TORCH_CHECK(grad_w_TK.has_value() == y_NH.has_value(), "grad_w_TK needs y_NH and y_NH serves only grad_w_TK");
  int64_t N = -1;
  if (grad_y_NH.has_value()) {
    check_cpu_contiguous(*grad_y_NH, "grad_y");
    N = grad_y_NH->size(0);
    TORCH_CHECK(grad_y_NH->dim() == 2 && grad_y_NH->size(1) == H && grad_y_NH->scalar_type() == grad_TH.scalar_type(),
                "grad_y must be [N, H] of grad_TH's dtype");
  }
  if (y_NH.has_value()) {
    check_cpu_contiguous(*y_NH, "y_NH");
    TORCH_CHECK(y_NH->dim() == 2 && y_NH->size(1) == H && y_NH->scalar_type() == grad_TH.scalar_type() &&
                (N < 0 || y_NH->size(0) == N), "y_NH must be [N, H] of grad_TH's dtype");
    N = y_NH->size(0);
    check_cpu_contiguous(*grad_w_TK, "grad_w");
    TORCH_CHECK(grad_w_TK->sizes() == row_TK.sizes(), "grad_w must be [T, K]");
  }
  const int64_t* row = row_TK.data_ptr<int64_t>();
  check_index_range(row, T * K, -1, N, "row_TK");
  const bool stream = grad_y_NH.has_value() && stream_output(*grad_y_NH);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad_TH.scalar_type(), "unpermute_backward", [&] {
    using acc_t = typename Acc<scalar_t>::type;
    const acc_t* w = nullptr;  // nullptr: plain sum, grad_y rows are copies
    if (weight_TK.has_value()) {
      check_cpu_contiguous(*weight_TK, "weight_TK");
      TORCH_CHECK(weight_TK->sizes() == row_TK.sizes(), "weight_TK must be [T, K]");
      TORCH_CHECK(weight_TK->scalar_type() == c10::CppTypeToScalarType<acc_t>::value,
                  "weight_TK must be in the accumulation dtype (the launcher casts it)");
      w = weight_TK->const_data_ptr<acc_t>();
    }
    acc_t* gw = nullptr;
    if (grad_w_TK.has_value()) {
      TORCH_CHECK(grad_w_TK->scalar_type() == c10::CppTypeToScalarType<acc_t>::value,
                  "grad_w must be in the accumulation dtype");
      gw = grad_w_TK->data_ptr<acc_t>();
    }
    const scalar_t* g = grad_TH.const_data_ptr<scalar_t>();
    const scalar_t* y = y_NH.has_value() ? y_NH->const_data_ptr<scalar_t>() : nullptr;
    scalar_t* gy = grad_y_NH.has_value() ? grad_y_NH->data_ptr<scalar_t>() : nullptr;
    // Bytes per token: grad read once, per slot a grad_y row written and / or a y row read.
    const int64_t token_bytes = (1 + K * ((gy ? 1 : 0) + (y ? 1 : 0))) * H * static_cast<int64_t>(sizeof(scalar_t));
    with_rows([&](auto rows) {
      with_stream(stream, [&](auto stream_c) {
        using Rows = decltype(rows);
        constexpr bool kStream = decltype(stream_c)::value;
        at::parallel_for(0, T, grain_for(token_bytes), [&](int64_t begin, int64_t end) {
          std::vector<acc_t> part(static_cast<size_t>(K * kLanes));
          for (int64_t t = begin; t < end; ++t) {
            const scalar_t* g_H = g + t * H;
            const int64_t* row_K = row + t * K;
            std::fill(part.begin(), part.end(), acc_t(0));
            for (int64_t h0 = 0; h0 < H; h0 += kTile) {
              const int64_t len = std::min(kTile, H - h0);
              for (int64_t k = 0; k < K; ++k) {
                const int64_t r = row_K[k];
                if (r < 0) continue;  // dropped slot: no row, gradient 0
                if (gy != nullptr) {
                  scalar_t* dst = gy + r * H + h0;
                  if (w == nullptr) {
                    std::memcpy(static_cast<void*>(dst), g_H + h0, static_cast<size_t>(len) * sizeof(scalar_t));
                  } else {
                    Rows::template scale_row<kStream>(g_H + h0, w[t * K + k], dst, len);
                  }
                }
                if (y != nullptr) dot_lanes(g_H + h0, y + r * H + h0, len, part.data() + k * kLanes);
              }
            }
            if (gw != nullptr) {
              for (int64_t k = 0; k < K; ++k) {
                acc_t dot = 0;
                for (int64_t j = 0; j < kLanes; ++j) dot = dot + part[k * kLanes + j];
                gw[t * K + k] = row_K[k] < 0 ? acc_t(0) : dot;
              }
            }
          }
          if (kStream) store_fence();
        });
      });
    });
  });
}

namespace {
// counts -> offsets in place: {2, 0, 3} -> {0, 2, 2}
void exclusive_prefix_sum(std::vector<int64_t>& v) {
  int64_t running = 0;
  for (auto& x : v) {
    const int64_t c = x;
    x = running;
    running += c;
  }
}
}  // namespace

// Counting sort of the slots by key = chunk * E + expert (dropped and invalid slots: key C*E, last):
// histogram of keys, exclusive prefix sum, then stable placement in slot order s = t*K + k.
// Chunk of token t is min(C-1, (2t(C-1) + T) / 2T): first and last chunk half-size (layout.py). Returns (dest_row_TK, src_slot_S, counts_CE, num_invalid), equal to
// layout_reference. Serial: the S int64 keys are a few hundred KB, far below the permute traffic.
// Example (E=2, C=1): topk_idx_TK = [[1, 0], [0, -1]] -> keys [1, 0, 0, 2], counts [2, 1, (1 dropped)]
//   offsets [0, 2, 3] -> dest_row_TK = [[2, 0], [1, -1]], src_slot_S = [1, 2, 0, 3]
//   counts_CE = [[2, 1]], num_invalid = 0
std::vector<at::Tensor> make_layout(const at::Tensor& topk_idx_TK, int64_t num_experts, int64_t num_chunks) {
  check_cpu_contiguous(topk_idx_TK, "topk_idx_TK");
  TORCH_CHECK(topk_idx_TK.dim() == 2 && topk_idx_TK.scalar_type() == at::kLong, "topk_idx_TK must be [T, K] int64");
  TORCH_CHECK_VALUE(num_experts >= 1 && num_chunks >= 1, "num_experts and num_chunks must be >= 1, got ",
                    num_experts, " and ", num_chunks);
  const int64_t T = topk_idx_TK.size(0), K = topk_idx_TK.size(1), S = T * K;
  const int64_t E = num_experts, C = num_chunks, B = C * E + 1;  // B buckets; bucket C*E = dropped
  const auto opts = topk_idx_TK.options();
  at::Tensor dest_row_TK = at::empty({T, K}, opts);
  at::Tensor src_slot_S = at::empty({S}, opts);
  at::Tensor counts_CE = at::empty({C, E}, opts);
  at::Tensor num_invalid = at::empty({}, opts);

  const int64_t* idx = topk_idx_TK.const_data_ptr<int64_t>();
  int64_t* dest = dest_row_TK.data_ptr<int64_t>();  // holds the key until placement overwrites it
  int64_t* src = src_slot_S.data_ptr<int64_t>();
  std::vector<int64_t> offset(B, 0);
  int64_t invalid = 0;

  for (int64_t t = 0; t < T; ++t) {  // pass 1: keys and histogram
    const int64_t chunk = std::min(C - 1, (2 * t * (C - 1) + T) / (2 * T));
    for (int64_t k = 0; k < K; ++k) {
      const int64_t s = t * K + k, e = idx[s];
      const bool valid = e >= 0 && e < E;
      invalid += (e < -1 || e >= E) ? 1 : 0;
      dest[s] = valid ? chunk * E + e : C * E;
      ++offset[dest[s]];
    }
  }
  int64_t* counts = counts_CE.data_ptr<int64_t>();
  std::copy(offset.begin(), offset.begin() + C * E, counts);
  exclusive_prefix_sum(offset);  // pass 2: offset[b] = first row of bucket b
  for (int64_t s = 0; s < S; ++s) {  // pass 3: stable placement in slot order
    const int64_t key = dest[s];
    const int64_t d = offset[key]++;
    src[d] = s;
    dest[s] = key == C * E ? -1 : d;
  }
  num_invalid.fill_(invalid);
  return {dest_row_TK, src_slot_S, counts_CE, num_invalid};
}

// One row per (token, destination rank), ops.make_rank_rows: the first slot of each (token, rank) pair
// holds the pair's row; rows sorted by key chunk * W + rank, stable in slot order (make_layout over the W
// ranks), then every routed slot writes its local expert into its pair's row. Returns (dest_row_TK,
// src_slot_S, counts_CW, local_idx_SK, slot_pos_TK, slot_counts_CE, num_invalid), equal to the torch
// reference (layout.rank_rows_reference). Serial, three passes over the S slots.
// Example (E=4, W=2, C=1): topk_idx_TK = [[0, 1], [3, 0]] -> ranks [[0, 0], [1, 0]], first slots (0,0),
//   (1,0), (1,1); keys [0, drop, 1, 0] -> rows: slot 0 -> 0, slot 3 -> 1, slot 2 -> 2;
//   local_idx_SK rows [[0, 1], [-1, 0], [1, -1], ...-1], slot_pos_TK = [[0, 1], [4, 3]]
std::vector<at::Tensor> make_rank_rows(const at::Tensor& topk_idx_TK, int64_t num_experts, int64_t num_ranks,
                                       int64_t num_chunks) {
  check_cpu_contiguous(topk_idx_TK, "topk_idx_TK");
  TORCH_CHECK(topk_idx_TK.dim() == 2 && topk_idx_TK.scalar_type() == at::kLong, "topk_idx_TK must be [T, K] int64");
  TORCH_CHECK_VALUE(num_experts >= 1 && num_ranks >= 1 && num_chunks >= 1 && num_experts % num_ranks == 0,
                    "need num_experts, num_ranks, num_chunks >= 1 and num_ranks | num_experts, got ", num_experts,
                    ", ", num_ranks, ", ", num_chunks);
  const int64_t T = topk_idx_TK.size(0), K = topk_idx_TK.size(1), S = T * K;
  const int64_t E = num_experts, W = num_ranks, C = num_chunks, e = E / W, DROP = C * W;
  const auto opts = topk_idx_TK.options();
  at::Tensor dest_row_TK = at::empty({T, K}, opts);
  at::Tensor src_slot_S = at::empty({S}, opts);
  at::Tensor counts_CW = at::empty({C, W}, opts);
  at::Tensor local_idx_SK = at::full({S, K}, -1, opts);
  at::Tensor slot_pos_TK = at::empty({T, K}, opts);
  at::Tensor slot_counts_CE = at::zeros({C, E}, opts);
  at::Tensor num_invalid = at::empty({}, opts);

  const int64_t* idx = topk_idx_TK.const_data_ptr<int64_t>();
  int64_t* dest = dest_row_TK.data_ptr<int64_t>();  // the key until placement overwrites it
  int64_t* src = src_slot_S.data_ptr<int64_t>();
  int64_t* first = slot_pos_TK.data_ptr<int64_t>();  // the first slot of the pair until pass 3 overwrites it
  int64_t* slot_counts = slot_counts_CE.data_ptr<int64_t>();
  std::vector<int64_t> offset(DROP + 1, 0);
  int64_t invalid = 0;
  for (int64_t t = 0; t < T; ++t) {  // pass 1: each slot's pair (first slot with its rank), keys, histograms
    const int64_t chunk = std::min(C - 1, (2 * t * (C - 1) + T) / (2 * T));
    const int64_t* id = idx + t * K;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t s = t * K + k, g = id[k];
      const bool valid = g >= 0 && g < E;
      invalid += (g < -1 || g >= E) ? 1 : 0;
      int64_t f = k;
      if (valid) {
        for (int64_t j = 0; j < k; ++j) {
          if (id[j] >= 0 && id[j] < E && id[j] / e == g / e) {
            f = j;
            break;
          }
        }
        ++slot_counts[chunk * E + g];
      }
      first[s] = f;
      dest[s] = (valid && f == k) ? chunk * W + g / e : DROP;
      ++offset[dest[s]];
    }
  }
  std::copy(offset.begin(), offset.begin() + DROP, counts_CW.data_ptr<int64_t>());
  exclusive_prefix_sum(offset);  // offset[b] = first row of bucket b
  for (int64_t s = 0; s < S; ++s) {  // pass 2: stable placement in slot order
    const int64_t key = dest[s];
    const int64_t d = offset[key]++;
    src[d] = s;
    dest[s] = key == DROP ? -1 : d;
  }
  int64_t* local = local_idx_SK.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; ++s) {  // pass 3: each routed slot's local expert into its pair's row
    const int64_t t = s / K, k = s % K, g = idx[s];
    if (g >= 0 && g < E) {
      const int64_t pos = dest[t * K + first[s]] * K + k;
      local[pos] = g % e;
      first[s] = pos;
    } else {
      first[s] = S * K;
    }
  }
  num_invalid.fill_(invalid);
  return {dest_row_TK, src_slot_S, counts_CW, local_idx_SK, slot_pos_TK, slot_counts_CE, num_invalid};
}

// quant.cpp: quantize_rows, dequantize_rows and their conversion test hooks.
void register_quant(pybind11::module_& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "moe_comm C++ CPU kernels: permute_rows, unpermute_rows, unpermute_weight_grad, unpermute_backward, "
            "make_layout, make_rank_rows, "
            "FP8 quantize_rows / dequantize_rows, and the output cache the launchers allocate from";
  // The GIL is released: the kernels touch no Python objects, and other Python threads may run meanwhile.
  m.def("permute_rows", &permute_rows, "out_NH[n] = x_TH[token_N[n]] (* scale_N[n])", py::arg("x_TH"),
        py::arg("token_N"), py::arg("scale_N"), py::arg("out"), py::call_guard<py::gil_scoped_release>());
  m.def("unpermute_rows", &unpermute_rows, "out_TH[t] = sum_k weight_TK[t, k] * y_NH[row_TK[t, k]]",
        py::arg("y_NH"), py::arg("row_TK"), py::arg("weight_TK"), py::arg("out"),
        py::call_guard<py::gil_scoped_release>());
  m.def("unpermute_weight_grad", &unpermute_weight_grad, "g_TK[t, k] = <grad_TH[t], y_NH[row_TK[t, k]]>",
        py::arg("grad_TH"), py::arg("y_NH"), py::arg("row_TK"), py::call_guard<py::gil_scoped_release>());
  m.def("unpermute_backward", &unpermute_backward,
        "one pass per token: grad_y[row_TK[t, k]] = grad_TH[t] * weight_TK[t, k], grad_w[t, k] = <grad_TH[t], y[row]>",
        py::arg("grad_TH"), py::arg("row_TK"), py::arg("weight_TK"), py::arg("y_NH"), py::arg("grad_y"),
        py::arg("grad_w"), py::call_guard<py::gil_scoped_release>());
  m.def("make_layout", &make_layout, "counting-sort layout: (dest_row_TK, src_slot_S, counts_CE, num_invalid)",
        py::arg("topk_idx_TK"), py::arg("num_experts"), py::arg("num_chunks"),
        py::call_guard<py::gil_scoped_release>());
  m.def("make_rank_rows", &make_rank_rows,
        "one row per (token, rank): (dest_row_TK, src_slot_S, counts_CW, local_idx_SK, slot_pos_TK, slot_counts_CE, "
        "num_invalid)", py::arg("topk_idx_TK"), py::arg("num_experts"), py::arg("num_ranks"), py::arg("num_chunks"),
        py::call_guard<py::gil_scoped_release>());
  m.def("empty_cached", &empty_cached, "uninitialised contiguous CPU tensor of like's dtype from the output cache",
        py::arg("sizes"), py::arg("like"));
  m.def("set_output_cache_limit", &set_output_cache_limit, "idle bytes the output cache keeps; returns the old limit",
        py::arg("limit_bytes"));
  m.def("output_cache_stats", &output_cache_stats, "(idle bytes, mapped bytes, limit, hits, misses)");
  m.def("kernel_config", &kernel_config, "set knobs given >= 0; returns (stream_min_bytes, use_avx2)",
        py::arg("stream_min_bytes"), py::arg("use_avx2"));
  register_quant(m);
}
