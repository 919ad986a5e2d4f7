// memcpy_perf: memcpy bandwidth at the sweep's sizes, the reference a shared-memory collective on
// one host is measured against.
//   memcpy_perf -b 4K -e 256M -f 4 -n 20 -w 5      (or -G groups, see report.h)
//   memcpy_perf -t 4 -s 1 -b 16M -e 64M -f 4        (4 concurrent copiers, non-temporal stores)
// Printed in the nccl-tests columns as "all_gather-like" rows: algbw = busbw = bytes copied per
// second, all copiers together (one copier: bytes / time of one memcpy of `size` bytes between
// two distinct, pre-faulted buffers).
//
// Beyond report.h's flags:
//   -t N  N threads copy at once, each `size` bytes between its own pair of buffers, started
//         together for every timed point (a barrier), timed from the first copier's start to
//         the last one's end: the machine's aggregate copy bandwidth under the concurrency of N
//         ranks (bench/compare/ceiling_comparison.py). Default 1.
//   -s 1  non-temporal stores (shardline's CopyStreaming: 16-byte streaming stores after an
//         aligned head), so that a copied byte costs exactly one read and one write of memory,
//         no read of the destination line first. Default 0: glibc's memcpy.

#include <emmintrin.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>

#include "report.h"

namespace {

void CopyNonTemporal(char* d, const char* s, size_t bytes) {
  const size_t head = std::min(bytes, (16 - (reinterpret_cast<uintptr_t>(d) & 15)) & 15);
  std::memcpy(d, s, head);
  d += head;
  s += head;
  bytes -= head;
  const size_t body = bytes & ~size_t{63};
  for (size_t i = 0; i < body; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
  }
  std::memcpy(d + body, s + body, bytes - body);
  _mm_sfence();
}

// A reusable barrier that sleeps (copiers may outnumber the CPUs).
class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  void Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    const uint64_t gen = generation_;
    if (++arrived_ == n_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    cv_.wait(lock, [&] { return generation_ != gen; });
  }

 private:
  const int n_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
};

// Removes "-t N" and "-s B" from argv (report.h's parser rejects them).
void TakeOwnFlags(int* argc, char** argv, int* threads, bool* streaming) {
  int out = 1;
  for (int i = 1; i < *argc; ++i) {
    const std::string a = argv[i];
    if ((a == "-t" || a == "-s") && i + 1 < *argc) {
      const int v = peer::ParseCount(a.c_str(), argv[++i], a == "-t" ? 1 : 0);
      if (a == "-t")
        *threads = v;
      else
        *streaming = v != 0;
      continue;
    }
    argv[out++] = argv[i];
  }
  *argc = out;
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 1;
  bool streaming = false;
  TakeOwnFlags(&argc, argv, &threads, &streaming);
  peer::Flags flags = peer::ParseFlags(argc, argv);
  std::vector<std::vector<char>> src(threads), dst(threads);
  for (int t = 0; t < threads; ++t) {
    src[t].assign(flags.max_bytes, static_cast<char>(1 + t));
    dst[t].assign(flags.max_bytes, 2);
  }
  const char* name = streaming ? "memcpy_nt" : "memcpy";
  std::printf("# memcpy_perf: %d concurrent copier%s, %s\n", threads, threads == 1 ? "" : "s",
              streaming ? "non-temporal stores" : "glibc memcpy");
  peer::PrintColumns(name, name, threads);
  auto copy = [&](int t, size_t size) {
    if (streaming) {
      CopyNonTemporal(dst[t].data(), src[t].data(), size);
    } else {
      std::memcpy(dst[t].data(), src[t].data(), size);
    }
    asm volatile("" : : "r"(dst[t].data()) : "memory");
  };
  const std::vector<peer::Point> points = peer::Points(flags);
  // Timed by the copiers themselves, from the first one's start to the last one's end (a
  // coordinating thread of its own may not get a CPU when the copiers start).
  Barrier barrier(threads);
  std::vector<std::atomic<long>> wrong(points.size());
  std::vector<std::vector<double>> starts(points.size(), std::vector<double>(threads));
  std::vector<std::vector<double>> ends(points.size(), std::vector<double>(threads));
  std::vector<std::thread> workers;
  // Each copier, per point: warm up, meet, copy `iters` times, meet, check (untimed).
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      for (size_t k = 0; k < points.size(); ++k) {
        const peer::Point& pt = points[k];
        for (int i = 0; i < pt.warmup + 1; ++i) copy(t, pt.bytes);
        barrier.Wait();
        starts[k][t] = peer::Now();
        for (int i = 0; i < pt.iters; ++i) copy(t, pt.bytes);
        ends[k][t] = peer::Now();
        barrier.Wait();
        if (std::memcmp(dst[t].data(), src[t].data(), pt.bytes) != 0) wrong[k].fetch_add(1);
      }
    });
  }
  for (std::thread& w : workers) w.join();
  std::vector<double> seconds(points.size());
  for (size_t k = 0; k < points.size(); ++k) {
    seconds[k] = *std::max_element(ends[k].begin(), ends[k].end()) -
                 *std::min_element(starts[k].begin(), starts[k].end());
  }
  double sum = 0;
  int cells = 0;
  for (size_t k = 0; k < points.size(); ++k) {
    const peer::Point& pt = points[k];
    peer::Cell c;
    c.present = true;
    c.time_us = seconds[k] / pt.iters * 1e6;
    c.algbw = c.busbw = static_cast<double>(pt.bytes) * pt.iters * threads / 1e9 / seconds[k];
    c.wrong = wrong[k].load();
    sum += c.busbw;
    ++cells;
    peer::PrintRow(pt.bytes, pt.bytes, "none", -1, c, peer::Cell());
  }
  peer::PrintFooter(0, sum, cells);
  return 0;
}
