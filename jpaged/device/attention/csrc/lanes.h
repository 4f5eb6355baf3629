// Vectors of kLanes floats (GCC's vector extensions), kLanes being the width of one register of the
// variant being built: 16 under AVX-512, 8 under AVX (the AVX2 build), 4 in the portable build. A
// vector wider than the target's registers is no vector to GCC: it lives in memory (the AVX2 build of
// 16-lane code made 6x the stack accesses of the AVX-512 one and ran 4.4-8x slower). Shared by the
// kernels of this folder (paged_attention.cc, int8_matmul.cc); each includes it at file scope, and
// everything here is internal to the including file.

#ifndef JPAGED_CSRC_LANES_H_
#define JPAGED_CSRC_LANES_H_

#include <cstdint>
#include <utility>

namespace {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#elif defined(__AVX__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif

typedef float VF __attribute__((vector_size(4 * kLanes)));
typedef int32_t VI __attribute__((vector_size(4 * kLanes)));
typedef uint32_t VU __attribute__((vector_size(4 * kLanes)));
typedef uint16_t VH __attribute__((vector_size(2 * kLanes)));
typedef _Float16 VHF __attribute__((vector_size(2 * kLanes)));

constexpr auto kLaneSeq = std::make_integer_sequence<int, kLanes>{};

// x in every lane. x - 0 (not 0 + x, which is not x for x = -0): the compiler folds it to a bare broadcast,
// where 0 + x cost an add before each broadcast in the kernels' inner loops.
inline VF Splat(float x) { return x - VF{}; }

// x with lane i taken from lane i ^ S (S a power of two below kLanes): a butterfly of the lane tree.
template <int S, int... P>
inline VF SwapLanes(VF x, std::integer_sequence<int, P...>) { return __builtin_shufflevector(x, x, (P ^ S)...); }

// The sum of x's lanes (a butterfly tree).
template <int S = kLanes / 2>
inline float AddLanes(VF x) {
  x += SwapLanes<S>(x, kLaneSeq);
  if constexpr (S > 1) return AddLanes<S / 2>(x);
  return x[0];
}

}  // namespace

#endif  // JPAGED_CSRC_LANES_H_
