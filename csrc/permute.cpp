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
// accumulation dtype and allocate outputs; the checks here are invariants plus index ranges.

#include <torch/extension.h>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

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
// that, torch's OpenMP backend splits the range into one contiguous block per thread.
constexpr int64_t kTaskBytes = 64 * 1024;

// Hidden columns accumulated at a time in unpermute when a token has more than kGroup valid rows:
// 1024 fp32 = 4 KB of partial sums stays in L1 between groups.
constexpr int64_t kTile = 1024;

// Independent partial sums in the dot product, so the compiler can keep them in one vector register
// (a single running sum is a serial dependency chain it must not reorder).
constexpr int64_t kLanes = 16;

int64_t grain_for(int64_t bytes_per_item) {
  return std::max<int64_t>(1, kTaskBytes / std::max<int64_t>(1, bytes_per_item));
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

}  // namespace

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

  if (!scale_N.has_value()) {
    // Fast path: one memcpy per row, any dtype. int64 offsets: N*H can exceed 2^31.
    // Measured at T=8192 H=2048 K=2 fp32: prefetching the next row or copying in 64-byte blocks was
    // no faster than plain memcpy (~85% of a contiguous copy; the gap is the random row order).
    const int64_t row_bytes = H * static_cast<int64_t>(x_TH.element_size());
    const char* src = static_cast<const char*>(x_TH.const_data_ptr());
    char* dst = static_cast<char*>(out_NH.data_ptr());
    at::parallel_for(0, N, grain_for(2 * row_bytes), [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        std::memcpy(dst + n * row_bytes, src + tok[n] * row_bytes, static_cast<size_t>(row_bytes));
      }
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
    at::parallel_for(0, N, grain_for(2 * row_bytes), [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        const scalar_t* x_H = x + tok[n] * H;
        scalar_t* o_H = out + n * H;
        const acc_t sn = s[n];
        for (int64_t h = 0; h < H; ++h) {
          o_H[h] = static_cast<scalar_t>(static_cast<acc_t>(x_H[h]) * sn);
        }
      }
    });
  });
}

namespace {

// Valid rows one pass over H adds side by side. A token with at most this many valid slots (every
// K <= 4 routing) is done in one pass: no accumulator round trip through memory, R + 1 long streams.
// Measured (2 threads, T=8192 H=2048 K=2 fp32, memcpy ~34 GB/s): 25 GB/s with one row at a time
// into a 1024-column accumulator tile, 31 GB/s with this fused pass.
constexpr int kGroup = 4;

// One pass over `len` columns adding R rows, in slot order, to the running sum of each column:
//   a = kFirst ? +0 : acc[i];  a = a + y_R[r][i] * w_R[r] for r = 0..R-1;  kLast ? out[i] = a : acc[i] = a.
// Fixed R lets the compiler unroll over r and vectorise over i.
template <int R, bool kFirst, bool kLast, typename scalar_t, typename acc_t>
void add_rows(const scalar_t* const* y_R, const acc_t* w_R, acc_t* __restrict__ acc, scalar_t* __restrict__ out,
              int64_t len) {
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

template <bool kFirst, bool kLast, typename scalar_t, typename acc_t>
void add_rows_n(int n, const scalar_t* const* y_R, const acc_t* w_R, acc_t* acc, scalar_t* out, int64_t len) {
  switch (n) {
    case 1: return add_rows<1, kFirst, kLast>(y_R, w_R, acc, out, len);
    case 2: return add_rows<2, kFirst, kLast>(y_R, w_R, acc, out, len);
    case 3: return add_rows<3, kFirst, kLast>(y_R, w_R, acc, out, len);
    default: return add_rows<kGroup, kFirst, kLast>(y_R, w_R, acc, out, len);
  }
}

// out_H = sum of the m rows y_R[0..m) times w_R[0..m), in that order (m >= 1).
template <typename scalar_t, typename acc_t>
void sum_rows(int64_t m, const scalar_t** y_R, const acc_t* w_R, acc_t* acc_tile, scalar_t* out_H, int64_t H) {
  if (m <= kGroup) {
    add_rows_n<true, true>(static_cast<int>(m), y_R, w_R, acc_tile, out_H, H);
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
        add_rows_n<true, false>(n, tile_R, w_R + g, acc_tile, out_H + h0, len);
      } else if (last) {
        add_rows_n<false, true>(n, tile_R, w_R + g, acc_tile, out_H + h0, len);
      } else {
        add_rows_n<false, false>(n, tile_R, w_R + g, acc_tile, out_H + h0, len);
      }
    }
  }
}

}  // namespace

// out_TH[t] = sum over k = 0..K-1, in that order, of weight_TK[t, k] * y_NH[row_TK[t, k]], skipping
// row -1 (dropped). acc starts at +0 and each step is acc = acc + (y * w) with the product rounded
// first, exactly torch's `total += rows * w` in reference.py; then cast to y's dtype. No weights:
// w = 1, and y * 1 == y exactly, as in the reference.
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
    // Bytes per token: K rows read + 1 row written.
    const int64_t token_bytes = (K + 1) * H * static_cast<int64_t>(sizeof(scalar_t));
    at::parallel_for(0, T, grain_for(token_bytes), [&](int64_t begin, int64_t end) {
      std::vector<const scalar_t*> y_R(K);  // the valid rows of one token, in slot order
      std::vector<acc_t> w_R(K);
      std::vector<acc_t> acc_tile(K > kGroup ? kTile : 0);
      for (int64_t t = begin; t < end; ++t) {
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
          std::fill(o_H, o_H + H, static_cast<scalar_t>(0));
        } else {
          sum_rows(m, y_R.data(), w_R.data(), acc_tile.data(), o_H, H);
        }
      }
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
  int64_t running = 0;  // pass 2: exclusive prefix sum, offset[b] = first row of bucket b
  for (int64_t b = 0; b < B; ++b) {
    const int64_t c = offset[b];
    offset[b] = running;
    running += c;
  }
  for (int64_t s = 0; s < S; ++s) {  // pass 3: stable placement in slot order
    const int64_t key = dest[s];
    const int64_t d = offset[key]++;
    src[d] = s;
    dest[s] = key == C * E ? -1 : d;
  }
  num_invalid.fill_(invalid);
  return {dest_row_TK, src_slot_S, counts_CE, num_invalid};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "moe_comm C++ CPU kernels: permute_rows, unpermute_rows, unpermute_weight_grad, make_layout";
  // The GIL is released: the kernels touch no Python objects, and other Python threads may run meanwhile.
  m.def("permute_rows", &permute_rows, "out_NH[n] = x_TH[token_N[n]] (* scale_N[n])", py::arg("x_TH"),
        py::arg("token_N"), py::arg("scale_N"), py::arg("out"), py::call_guard<py::gil_scoped_release>());
  m.def("unpermute_rows", &unpermute_rows, "out_TH[t] = sum_k weight_TK[t, k] * y_NH[row_TK[t, k]]",
        py::arg("y_NH"), py::arg("row_TK"), py::arg("weight_TK"), py::arg("out"),
        py::call_guard<py::gil_scoped_release>());
  m.def("unpermute_weight_grad", &unpermute_weight_grad, "g_TK[t, k] = <grad_TH[t], y_NH[row_TK[t, k]]>",
        py::arg("grad_TH"), py::arg("y_NH"), py::arg("row_TK"), py::call_guard<py::gil_scoped_release>());
  m.def("make_layout", &make_layout, "counting-sort layout: (dest_row_TK, src_slot_S, counts_CE, num_invalid)",
        py::arg("topk_idx_TK"), py::arg("num_experts"), py::arg("num_chunks"),
        py::call_guard<py::gil_scoped_release>());
}
