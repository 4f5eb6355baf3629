/* The plain-loop instrument of bench/one_row_read.py: one row of x times float32 weights [N, K], with the
 * access pattern of jpaged's native one-row kernel on AMD Zen 4 (jpaged/device/attention/csrc/int8_matmul.cc,
 * a channel at a time) and no XLA around it. Built by the benchmark with the system C compiler for this CPU
 * (-O2 -march=native -pthread); not part of jpaged.
 *
 * rr_pass(w, n, k, first, calls, x, y): runs `calls` calls one after another, as a decode step's chain of
 * products: call c multiplies x by the weights first[c] .. first[c + 1] - 1 (w[i]: [n[i], k[i]] float32,
 * each k a multiple of 16), writing each output channel's sum into y (scratch, as many floats as the
 * largest n). Two threads share a call's output channels as the kernel's do: the calling thread and one
 * helper (started with the pass, spinning between calls) claim guided runs, each a quarter of the channels
 * still unclaimed (at least 32, never past a weight's end); a channel's K weights are read whole while the
 * next channel's are prefetched, one cache line for each line read. The call returns once both threads
 * are done with it. Returns the pass's wall seconds. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef float v16 __attribute__((vector_size(64)));

static void pause_core(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

static float dot(const float* w, const float* x, int64_t k) {
  const char* ahead = (const char*)(w + k); /* the next channel */
  v16 acc = {0};
  for (int64_t j = 0; j < k; j += 16) {
    __builtin_prefetch(ahead, 0, 3);
    ahead += 64;
    v16 a, b;
    memcpy(&a, w + j, sizeof a);
    memcpy(&b, x + j, sizeof b);
    acc += a * b;
  }
  float s = 0;
  for (int i = 0; i < 16; ++i) s += acc[i];
  return s;
}

typedef struct {
  _Atomic int64_t next, done;
} call_state;

static struct {
  const float* const* w;
  const int64_t *n, *k;
  const int32_t* first;
  const float* x;
  float* y;
  call_state* state;
  _Atomic int published; /* calls published so far (call c runs once it is c + 1); -1: the pass is over */
} pass;

static int64_t items(int c) {
  int64_t total = 0;
  for (int i = pass.first[c]; i < pass.first[c + 1]; ++i) total += pass.n[i];
  return total;
}

static void drain(int c) {
  call_state* s = &pass.state[c];
  const int64_t total = items(c);
  int64_t start = atomic_load(&s->next);
  while (start < total) {
    int i = pass.first[c];
    int64_t begin = 0; /* the first channel of weight i in the call's numbering */
    while (start >= begin + pass.n[i]) begin += pass.n[i++];
    int64_t run = (total - start) / 4;
    if (run < 32) run = 32;
    if (run > begin + pass.n[i] - start) run = begin + pass.n[i] - start;
    if (!atomic_compare_exchange_weak(&s->next, &start, start + run)) continue;
    for (int64_t ch = start - begin; ch < start - begin + run; ++ch)
      pass.y[ch] = dot(pass.w[i] + ch * pass.k[i], pass.x, pass.k[i]);
    atomic_fetch_add(&s->done, run);
    start = atomic_load(&s->next);
  }
}

static void* helper(void* unused) {
  (void)unused;
  int seen = 0;
  for (;;) {
    int p;
    while ((p = atomic_load(&pass.published)) == seen) pause_core();
    if (p < 0) return NULL;
    for (int c = seen; c < p; ++c) drain(c); /* a call it missed is already claimed: drain returns */
    seen = p;
  }
}

double rr_pass(const float* const* w, const int64_t* n, const int64_t* k, const int32_t* first, int calls,
               const float* x, float* y) {
  pass.w = w, pass.n = n, pass.k = k, pass.first = first, pass.x = x, pass.y = y;
  pass.state = calloc(calls, sizeof(call_state));
  atomic_store(&pass.published, 0);
  pthread_t thread;
  const int threaded = pthread_create(&thread, NULL, helper, NULL) == 0;
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (int c = 0; c < calls; ++c) {
    atomic_store(&pass.published, c + 1);
    drain(c);
    const int64_t total = items(c);
    while (atomic_load(&pass.state[c].done) != total) pause_core();
  }
  clock_gettime(CLOCK_MONOTONIC, &t1);
  atomic_store(&pass.published, -1);
  if (threaded) pthread_join(thread, NULL);
  free(pass.state);
  return (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
}
