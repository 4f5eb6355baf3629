/* The block-read instrument of bench/attention_cpu.py: reads given chunks of memory (the K and V
 * blocks one decode step reads) with plain vector loads and no other arithmetic, so its time is what
 * reading those scattered blocks costs on this machine. Built by the benchmark with the system C
 * compiler for this CPU (-O2 -march=native); not part of jpaged.
 *
 * read_chunks: for i in [0, n): reads bytes [offsets[i], offsets[i] + sizes[i]) of k, then the same
 * bytes of v; returns a sum of what it read (so the loads cannot be dropped). Every size is a
 * multiple of 64 bytes. With `prefetch`, before reading chunk i it touches (a software prefetch) the
 * first two cache lines of every 4 KiB page of chunk i + 1, which starts the hardware prefetchers on
 * those pages early: on the machines measured this reads scattered 12 KiB runs faster than plain
 * loads (and faster than prefetching every line). The caller runs one call per thread (ctypes
 * releases the GIL). */
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

static void touch_pages(const char* p, int64_t size) {
  const char* end = p + size;
  for (const char* q = p; q < end; q = (const char*)(((uintptr_t)q & ~(uintptr_t)4095) + 4096)) {
    __builtin_prefetch(q);
    if (q + 64 < end) __builtin_prefetch(q + 64);
  }
}

float read_chunks(const char* k, const char* v, const int64_t* offsets, const int64_t* sizes, int64_t n,
                  int prefetch) {
  v16 acc[4] = {{0}, {0}, {0}, {0}};
  for (int64_t i = 0; i < n; ++i) {
    if (prefetch && i + 1 < n) {
      touch_pages(k + offsets[i + 1], sizes[i + 1]);
      touch_pages(v + offsets[i + 1], sizes[i + 1]);
    }
    sum_chunk(k + offsets[i], sizes[i], acc);
    sum_chunk(v + offsets[i], sizes[i], acc);
  }
  v16 all = acc[0] + acc[1] + acc[2] + acc[3];
  float total = 0.0f;
  for (int j = 0; j < 16; ++j) total += all[j];
  return total;
}
