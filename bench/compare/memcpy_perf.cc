// memcpy_perf: single-thread memcpy bandwidth at the sweep's sizes, the physical limit of a
// shared-memory collective (every byte a rank receives is copied at least once, by one thread).
//   memcpy_perf -b 4K -e 256M -f 4 -n 20 -w 5      (or -G groups, see report.h)
// Printed in the nccl-tests columns as "all_gather-like" rows: algbw = busbw = bytes / time of
// one memcpy of `size` bytes between two distinct, pre-faulted buffers.

#include "report.h"

int main(int argc, char** argv) {
  peer::Flags flags = peer::ParseFlags(argc, argv);
  std::vector<char> src(flags.max_bytes, 1), dst(flags.max_bytes, 2);
  peer::PrintColumns("memcpy", "memcpy", 1);
  double sum = 0;
  int cells = 0;
  for (const peer::Point& pt : peer::Points(flags)) {
    const size_t size = pt.bytes;
    for (int i = 0; i < pt.warmup + 1; ++i) std::memcpy(dst.data(), src.data(), size);
    const double start = peer::Now();
    for (int i = 0; i < pt.iters; ++i) {
      std::memcpy(dst.data(), src.data(), size);
      asm volatile("" : : "r"(dst.data()) : "memory");
    }
    const double seconds = (peer::Now() - start) / pt.iters;
    peer::Cell c;
    c.present = true;
    c.time_us = seconds * 1e6;
    c.algbw = c.busbw = size / 1e9 / seconds;
    c.wrong = std::memcmp(dst.data(), src.data(), size) != 0;
    sum += c.busbw;
    ++cells;
    peer::PrintRow(size, size, "none", -1, c, peer::Cell());
  }
  peer::PrintFooter(0, sum, cells);
  return 0;
}
