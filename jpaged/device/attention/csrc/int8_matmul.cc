// Weight-only int8 matrix products on the CPU, as an XLA FFI handler: the dense layers of a model
// whose parameters are `jpaged.device.quant.QuantizedWeight`s, for the few-row steps (decode) where
// XLA's CPU dot would first widen the whole int8 matrix to float32 in memory.
//
// Operands (see jpaged/device/quant.py, which flattens a parameter's logical layout to these):
//   x       f32[M, K]            activations, M rows
//   values  s8[N, K]             the weight, one output channel per row (GGUF's / torch's [out, in])
//   scales  f32 or f16 [N, K/G]  one scale per group of G consecutive input columns of a channel
//                                (G = K: per output channel; G = 32: GGUF's Q8_0 blocks)
// Result: f32[M, N], y[m, n] = sum_g scales[n, g] * sum_{k in group g} values[n, k] * x[m, k].
//
// Each int8 weight is read once per call from memory: 16 at a time, widened to float32 and scaled in
// registers, then multiplied into up to 8 rows of x (float32 accumulation). Output channels are
// split in tiles between the calling thread and XLA's intra-op threads; inside a tile, rows go in
// chunks of up to 8, so a tile's weights are reused from cache by every chunk.
//
// Built into the same per-instruction-set libraries as paged_attention.cc (setup.py), with GCC's
// vector extensions: the variants differ only in the instructions the compiler may use.

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
// GCC 12 warns of the "undefined" source register inside _mm512_cvtepi8_epi32 (a known false positive)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float VF __attribute__((vector_size(64)));

constexpr int kLanes = 16;
constexpr int kMaxRows = 8;   // rows of x per pass over a tile's weights
constexpr int64_t kTile = 32; // output channels per work item

inline VF LoadF(const float* p) {
  VF v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// 16 int8 weights widened to float32: one sign extension and one conversion per register (GCC's
// generic conversion of a char vector goes lane by lane).
inline VF LoadB(const int8_t* p) {
  VF f;
#if defined(__AVX512F__)
  const __m512 x = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  std::memcpy(&f, &x, sizeof f);
#elif defined(__AVX2__)
  const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))));
  std::memcpy(&f, &lo, sizeof lo);
  std::memcpy(reinterpret_cast<char*>(&f) + sizeof lo, &hi, sizeof hi);
#else
  for (int i = 0; i < kLanes; ++i) f[i] = static_cast<float>(p[i]);
#endif
  return f;
}

inline float AddLanes(VF x) {
  x += __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  x += __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  x += __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  x += __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return x[0];
}

template <typename S>
inline float Scale(const S* s) {
  return static_cast<float>(*s);
}

struct Problem {
  const float* x;
  const int8_t* w;
  const void* scales;
  int64_t M, N, K, G;
  float* y;
};

// Rows [m0, m0 + R) by output channels [n0, n0 + NO): R * NO independent accumulators.
template <typename S, int R, int NO>
inline void Block(const Problem& p, int64_t m0, int64_t n0) {
  const int64_t K = p.K, G = p.G, groups = K / G;
  const S* scales = static_cast<const S*>(p.scales);
  VF acc[R][NO] = {};
  float tail[R][NO] = {};
  for (int64_t g = 0; g < groups; ++g) {
    float s[NO];
    for (int o = 0; o < NO; ++o) s[o] = Scale(scales + (n0 + o) * groups + g);
    const int64_t k1 = (g + 1) * G;
    int64_t k = g * G;
    for (; k + kLanes <= k1; k += kLanes) {
      VF xv[R];
      for (int r = 0; r < R; ++r) xv[r] = LoadF(p.x + (m0 + r) * K + k);
      for (int o = 0; o < NO; ++o) {
        const VF wv = LoadB(p.w + (n0 + o) * K + k) * s[o];
        for (int r = 0; r < R; ++r) acc[r][o] += wv * xv[r];
      }
    }
    for (; k < k1; ++k)  // a group that is not a multiple of 16 columns
      for (int o = 0; o < NO; ++o) {
        const float wk = static_cast<float>(p.w[(n0 + o) * K + k]) * s[o];
        for (int r = 0; r < R; ++r) tail[r][o] += wk * p.x[(m0 + r) * K + k];
      }
  }
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < NO; ++o) p.y[(m0 + r) * p.N + n0 + o] = AddLanes(acc[r][o]) + tail[r][o];
}

// Rows [m0, m0 + R) by the channels [n0, n1): NO at a time (8 accumulators or so), the rest one by one.
template <typename S, int R>
void Rows(const Problem& p, int64_t m0, int64_t n0, int64_t n1) {
  constexpr int NO = R >= 8 ? 1 : R >= 4 ? 2 : R >= 2 ? 4 : 8;
  int64_t n = n0;
  for (; n + NO <= n1; n += NO) Block<S, R, NO>(p, m0, n);
  for (; n < n1; ++n) Block<S, R, 1>(p, m0, n);
}

template <typename S>
void Tile(const Problem& p, int64_t n0, int64_t n1) {
  for (int64_t m = 0; m < p.M; m += kMaxRows) {
    switch (std::min<int64_t>(kMaxRows, p.M - m)) {
      case 1: Rows<S, 1>(p, m, n0, n1); break;
      case 2: Rows<S, 2>(p, m, n0, n1); break;
      case 3: Rows<S, 3>(p, m, n0, n1); break;
      case 4: Rows<S, 4>(p, m, n0, n1); break;
      case 5: Rows<S, 5>(p, m, n0, n1); break;
      case 6: Rows<S, 6>(p, m, n0, n1); break;
      case 7: Rows<S, 7>(p, m, n0, n1); break;
      default: Rows<S, 8>(p, m, n0, n1); break;
    }
  }
}

// The tiles, claimed by the calling thread and XLA's intra-op threads; threads that start after the
// last tile was claimed return without touching the buffers (which live only until the handler returns).
struct Work {
  Problem problem;
  bool f16_scales;
  int64_t tiles;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable finished;

  void Drain() {
    for (int64_t t = next.fetch_add(1); t < tiles; t = next.fetch_add(1)) {
      const int64_t n0 = t * kTile, n1 = std::min(problem.N, n0 + kTile);
      if (f16_scales)
        Tile<_Float16>(problem, n0, n1);
      else
        Tile<float>(problem, n0, n1);
      if (done.fetch_add(1) + 1 == tiles) {
        std::lock_guard<std::mutex> lock(mu);
        finished.notify_all();
      }
    }
  }
};

ffi::Error Int8Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> values,
                      ffi::AnyBuffer scales, ffi::ResultBuffer<ffi::F32> y) {
  auto x_dims = x.dimensions();
  auto w_dims = values.dimensions();
  auto s_dims = scales.dimensions();
  if (x_dims.size() != 2 || w_dims.size() != 2 || s_dims.size() != 2)
    return ffi::Error::InvalidArgument("int8 matmul: x must be [M, K], values [N, K], scales [N, K / G]");
  const int64_t M = x_dims[0], K = x_dims[1], N = w_dims[0];
  if (w_dims[1] != K || s_dims[0] != N || s_dims[1] < 1 || K % s_dims[1] != 0)
    return ffi::Error::InvalidArgument("int8 matmul: values must be [N, K] with x's K, and scales [N, K / G] "
                                       "with G dividing K");
  const auto type = scales.element_type();
  if (type != ffi::DataType::F32 && type != ffi::DataType::F16)
    return ffi::Error::InvalidArgument("int8 matmul: scales must be float32 or float16");
  if (M == 0 || N == 0) return ffi::Error::Success();
  auto work = std::make_shared<Work>();
  work->problem = Problem{x.typed_data(), values.typed_data(), scales.untyped_data(), M, N, K,
                          K / s_dims[1], y->typed_data()};
  work->f16_scales = type == ffi::DataType::F16;
  work->tiles = (N + kTile - 1) / kTile;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), work->tiles) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->Drain(); });
  work->Drain();
  std::unique_lock<std::mutex> lock(work->mu);
  work->finished.wait(lock, [&] { return work->done.load() == work->tiles; });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JpagedInt8Matmul, Int8Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::S8>>()   // values
                                  .Arg<ffi::AnyBuffer>()         // scales
                                  .Ret<ffi::Buffer<ffi::F32>>());
