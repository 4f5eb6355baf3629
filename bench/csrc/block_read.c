/* The paged read bound's instrument (bench/attention_cpu.py): reads given chunks of memory (the K
 * and V blocks one decode step reads, in the kernel's order) with plain vector loads and no other
 * arithmetic, so the time is what reading those scattered blocks costs on this machine. Built by
 * the benchmark with the system C compiler for this CPU (-O2 -march=native); not part of jpaged.
 *
 * read_chunks: for i in [0, n): reads bytes [offsets[i], offsets[i] + sizes[i]) of k, then the same
 * bytes of v; returns a sum of what it read (so the loads cannot be dropped). Every size is a
 * multiple of 64 bytes. The caller runs one call per thread (ctypes releases the GIL). */
#include <stdint.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));

/* four independent sums: the additions never limit the loads */
static void sum_chunk(const char* p, int64_t size, v16 acc[4]) {
  for (int64_t b = 0; b < size; b += 256) {
    for (int j = 0; j < 4 && b + 64 * j < size; ++j) {
      v16 x;
      memcpy(&x, p + b + 64 * j, sizeof x);
      acc[j] += x;
    }
  }
}

float read_chunks(const char* k, const char* v, const int64_t* offsets, const int64_t* sizes, int64_t n) {
  v16 acc[4] = {{0}, {0}, {0}, {0}};
  for (int64_t i = 0; i < n; ++i) {
    sum_chunk(k + offsets[i], sizes[i], acc);
    sum_chunk(v + offsets[i], sizes[i], acc);
  }
  v16 all = acc[0] + acc[1] + acc[2] + acc[3];
  float total = 0.0f;
  for (int j = 0; j < 16; ++j) total += all[j];
  return total;
}
