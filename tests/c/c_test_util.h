/* File: tests/c/c_test_util.h
 * What the C API's tests (c_api_test.c, c_checkpoint_test.c; C11) share: failure checks that
 * count and print instead of aborting (CHECK, CALL, EXPECT_FAIL: each returns 1 from the calling
 * function), hashed test values, and ranks as threads over the in-process backend. Each test is
 * one translation unit, so the counters are per test. */
#ifndef SHARDLINE_TESTS_C_C_TEST_UTIL_H_
#define SHARDLINE_TESTS_C_C_TEST_UTIL_H_

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shardline.h"

static int failures = 0;
static pthread_mutex_t failures_mu = PTHREAD_MUTEX_INITIALIZER;

/* Unless `cond` holds: counts a failure, prints the location and the printf-style message, and
 * returns 1 from the calling function. */
#define CHECK(cond, ...)                              \
  do {                                                \
    if (!(cond)) {                                    \
      pthread_mutex_lock(&failures_mu);               \
      ++failures;                                     \
      fprintf(stderr, "%s:%d: ", __FILE__, __LINE__); \
      fprintf(stderr, __VA_ARGS__);                   \
      fprintf(stderr, "\n");                          \
      pthread_mutex_unlock(&failures_mu);             \
      return 1;                                       \
    }                                                 \
  } while (0)
/* `expr` (a shardline call) succeeds; else its result and error text are the failure. */
#define CALL(expr)                                                                  \
  do {                                                                              \
    shardlineResult_t r_ = (expr);                                                  \
    CHECK(r_ == shardlineSuccess, "%s: %s: %s", #expr, shardline_result_string(r_), \
          shardline_last_error());                                                  \
  } while (0)
/* `expr` fails with `code` and a message containing `text`. */
#define EXPECT_FAIL(expr, code, text)                                                           \
  do {                                                                                          \
    shardlineResult_t r_ = (expr);                                                              \
    CHECK(r_ == (code), "%s: %s (wanted %s): %s", #expr, shardline_result_string(r_),           \
          shardline_result_string(code), shardline_last_error());                               \
    CHECK(strstr(shardline_last_error(), (text)) != NULL, "%s: '%s' does not name '%s'", #expr, \
          shardline_last_error(), (text));                                                      \
  } while (0)

/* A 64-bit hash of three values (splitmix64's finalizer over a mix of them). */
static inline uint64_t Mix(uint64_t a, uint64_t b, uint64_t c) {
  uint64_t x = a * 0x9e3779b97f4a7c15ULL ^ (b + 0x632be59bd9b4e019ULL) * 0xbf58476d1ce4e5b9ULL ^ c;
  x ^= x >> 31;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 29;
  return x;
}
/* Mix as a float in [-1, 1). */
static inline float Hash(uint64_t a, uint64_t b, uint64_t c) {
  return (float)((double)(Mix(a, b, c) >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

/* One rank of a world of ranks as threads: its communicator, rank and world size, and the
 * argument the test passed to RunRanks. */
struct TestRank {
  shardlineComm_t comm;
  int rank;
  int size;
  const void* arg;
};
typedef void (*TestRankFn)(const struct TestRank* rank);

struct TestRankThread {
  struct TestRank rank;
  TestRankFn fn;
};
static inline void* TestRankMain(void* arg) {
  const struct TestRankThread* t = (const struct TestRankThread*)arg;
  t->fn(&t->rank);
  return NULL;
}

/* Runs fn on `size` ranks, each a thread, over the in-process backend (shardline_comm_init_local
 * with 30 s timeouts), joins them and destroys the communicators. 1 (printed) if the
 * communicators cannot be made; fn reports its failures through CHECK. */
static inline int RunRanks(int size, TestRankFn fn, const void* arg) {
  shardlineComm_t* comms = calloc((size_t)size, sizeof(shardlineComm_t));
  pthread_t* threads = calloc((size_t)size, sizeof(pthread_t));
  struct TestRankThread* ranks = calloc((size_t)size, sizeof(struct TestRankThread));
  int rc = 0;
  if (comms == NULL || threads == NULL || ranks == NULL) {
    fprintf(stderr, "RunRanks: out of memory\n");
    rc = 1;
  } else if (shardline_comm_init_local(size, 30, comms) != shardlineSuccess) {
    fprintf(stderr, "shardline_comm_init_local: %s\n", shardline_last_error());
    rc = 1;
  } else {
    for (int r = 0; r < size; ++r) {
      ranks[r].rank = (struct TestRank){comms[r], r, size, arg};
      ranks[r].fn = fn;
      pthread_create(&threads[r], NULL, TestRankMain, &ranks[r]);
    }
    for (int r = 0; r < size; ++r) pthread_join(threads[r], NULL);
    for (int r = 0; r < size; ++r) shardline_comm_destroy(comms[r]);
  }
  free(comms);
  free(threads);
  free(ranks);
  return rc;
}

/* 1 (printed, naming `test`) if any CHECK failed, else 0. */
static inline int ReportFailures(const char* test) {
  if (failures == 0) return 0;
  fprintf(stderr, "%s: %d failure(s)\n", test, failures);
  return 1;
}

#endif /* SHARDLINE_TESTS_C_C_TEST_UTIL_H_ */
