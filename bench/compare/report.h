// File: bench/compare/report.h
// -----------------------------------------------------------------------------
// What the peer drivers (mpi_perf, gloo_perf, memcpy_perf) share with bench/perf: the flags they
// understand (-b -e -f -n -w -c, a subset of nccl-tests', plus -G), nccl-tests' columns, the float
// input pattern and a reference check.
//
// Header-only and free of shardline, so the drivers build with nothing but mpicxx or g++ -lgloo
// (run_comparison.py compiles them; the main build does not).
//
// -G lo:hi:factor:iters:warmup (repeatable, in increasing size order) replaces -b -e -f -n -w with
// a schedule: one process sweeps every group with the group's own iteration counts, as if
// bench/perf's binary had been launched once per group with those flags. run_comparison.py uses
// it so that a peer costs one launch per round instead of one per group.

#ifndef SHARDLINE_BENCH_COMPARE_REPORT_H_
#define SHARDLINE_BENCH_COMPARE_REPORT_H_

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace peer {

// One -G group: sizes lo, lo * factor, ... <= hi, each timed with `iters` calls after `warmup`.
struct Group {
  size_t lo = 0, hi = 0, factor = 2;
  int iters = 20, warmup = 5;
};

struct Flags {
  std::vector<Group> groups;  // from -G, or one group from -b -e -f -n -w
  size_t min_bytes = 32 << 20;
  size_t max_bytes = 32 << 20;
  size_t factor = 2;
  int iters = 20;
  int warmup = 5;
  int check = 1;
  std::string collective = "all";
};

inline size_t ParseSize(const char* text) {
  char* end = nullptr;
  double v = std::strtod(text, &end);
  if (end == text || v < 0) {
    std::fprintf(stderr, "invalid size '%s'\n", text);
    std::exit(2);
  }
  switch (*end) {
    case 'K':
    case 'k':
      v *= 1024.0;
      ++end;
      break;
    case 'M':
    case 'm':
      v *= 1024.0 * 1024;
      ++end;
      break;
    case 'G':
    case 'g':
      v *= 1024.0 * 1024 * 1024;
      ++end;
      break;
    default:
      break;
  }
  if (*end != '\0') {
    std::fprintf(stderr, "invalid size '%s'\n", text);
    std::exit(2);
  }
  return static_cast<size_t>(v);
}

inline int ParseCount(const char* flag, const char* text, int min) {
  char* end = nullptr;
  const long v = std::strtol(text, &end, 10);
  if (end == text || *end != '\0' || v < min) {
    std::fprintf(stderr, "invalid value '%s' for %s\n", text, flag);
    std::exit(2);
  }
  return static_cast<int>(v);
}

// "lo:hi:factor:iters:warmup", e.g. "4K:64K:2:20:3".
inline Group ParseGroup(const char* text) {
  std::vector<std::string> parts;
  std::string cur;
  for (const char* c = text;; ++c) {
    if (*c == ':' || *c == '\0') {
      parts.push_back(cur);
      cur.clear();
      if (*c == '\0') break;
    } else {
      cur += *c;
    }
  }
  if (parts.size() != 5) {
    std::fprintf(stderr, "invalid value '%s' for -G (lo:hi:factor:iters:warmup)\n", text);
    std::exit(2);
  }
  Group g;
  g.lo = ParseSize(parts[0].c_str());
  g.hi = ParseSize(parts[1].c_str());
  g.factor = ParseCount("-G factor", parts[2].c_str(), 2);
  g.iters = ParseCount("-G iters", parts[3].c_str(), 1);
  g.warmup = ParseCount("-G warmup", parts[4].c_str(), 0);
  if (g.lo == 0 || g.lo > g.hi) {
    std::fprintf(stderr, "invalid value '%s' for -G: need 0 < lo <= hi\n", text);
    std::exit(2);
  }
  return g;
}

// <collective> [-b B] [-e B] [-f F] [-n N] [-w N] [-c 0|1] | [-G lo:hi:factor:iters:warmup]...
inline Flags ParseFlags(int argc, char** argv) {
  Flags f;
  int i = 1;
  if (i < argc && argv[i][0] != '-') f.collective = argv[i++];
  for (; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr, "%s needs a value\n", a.c_str());
      std::exit(2);
    }
    const char* v = argv[++i];
    if (a == "-b")
      f.min_bytes = ParseSize(v);
    else if (a == "-e")
      f.max_bytes = ParseSize(v);
    else if (a == "-f")
      f.factor = ParseCount("-f", v, 2);
    else if (a == "-n")
      f.iters = ParseCount("-n", v, 1);
    else if (a == "-w")
      f.warmup = ParseCount("-w", v, 0);
    else if (a == "-c")
      f.check = ParseCount("-c", v, 0);
    else if (a == "-G")
      f.groups.push_back(ParseGroup(v));
    else {
      std::fprintf(stderr, "invalid option '%s'\n", a.c_str());
      std::exit(2);
    }
  }
  if (f.groups.empty()) {
    if (f.min_bytes == 0 || f.min_bytes > f.max_bytes) {
      std::fprintf(stderr, "need 0 < -b <= -e\n");
      std::exit(2);
    }
    f.groups.push_back({f.min_bytes, f.max_bytes, f.factor, f.iters, f.warmup});
  }
  for (size_t i = 1; i < f.groups.size(); ++i) {
    if (f.groups[i].lo <= f.groups[i - 1].hi) {
      std::fprintf(stderr, "-G groups must be in increasing, disjoint size order\n");
      std::exit(2);
    }
  }
  f.min_bytes = f.groups.front().lo;
  f.max_bytes = f.groups.back().hi;
  return f;
}

// One size of the sweep and the iteration counts it is timed with.
struct Point {
  size_t bytes;
  int iters;
  int warmup;
};

inline std::vector<Point> Points(const Flags& f) {
  std::vector<Point> points;
  for (const Group& g : f.groups) {
    for (size_t s = g.lo; s <= g.hi; s *= g.factor) points.push_back({s, g.iters, g.warmup});
  }
  return points;
}

// splitmix64's finalizer, as bench/perf/values.cc.
inline unsigned long long Mix(unsigned long long x) {
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// The same float pattern as bench/perf/values.cc's InputValue: small integers hashed from
// (rank, index, seed), with no period that a misplaced block could hide in.
inline float Input(bool reducing, int rank, size_t index, unsigned seed) {
  const unsigned long long key =
      Mix(seed * 0x9e3779b97f4a7c15ull + static_cast<unsigned long long>(rank)) + index;
  const unsigned long long h = Mix(key);
  return static_cast<float>(reducing ? h % 13 : h % 251);
}

inline void Fill(float* p, size_t count, bool reducing, int rank, unsigned seed) {
  for (size_t i = 0; i < count; ++i) p[i] = Input(reducing, rank, i, seed);
}

inline float ReducedSum(int nranks, size_t index, unsigned seed) {
  float acc = 0;
  for (int s = 0; s < nranks; ++s) acc += Input(true, s, index, seed);
  return acc;
}

inline double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Cell {
  bool present = false;
  double time_us = 0;
  double algbw = 0;
  double busbw = 0;
  long wrong = -1;
};

inline std::string TimeText(double us) {
  char b[32];
  std::snprintf(b, sizeof(b), us >= 10000.0 ? "%7.0f" : us >= 100.0 ? "%7.1f" : "%7.2f", us);
  return b;
}

inline void PrintColumns(const char* system, const char* collective, int nranks) {
  std::printf("# collective %s system %s nranks %d\n", collective, system, nranks);
  std::printf(
      "# %10s  %12s  %8s  %6s  %6s           out-of-place                       "
      "in-place          \n",
      "", "", "", "", "");
  std::printf("# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s %6s  %7s  %6s  %6s %6s\n", "size",
              "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "time", "algbw",
              "busbw", "#wrong");
  std::printf("# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %5s  %7s  %6s  %6s  %5s\n", "(B)",
              "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)",
              "");
}

inline void PrintCell(const Cell& c) {
  if (!c.present) {
    std::printf("  %7s  %6s  %6s  %5s", "N/A", "N/A", "N/A", "N/A");
    return;
  }
  const std::string wrong = c.wrong < 0 ? "N/A" : std::to_string(c.wrong);
  std::printf("  %7s  %6.2f  %6.2f  %5s", TimeText(c.time_us).c_str(), c.algbw, c.busbw,
              wrong.c_str());
}

inline void PrintRow(size_t bytes, size_t count, const char* redop, int root, const Cell& oop,
                     const Cell& ip) {
  std::printf("%12zu  %12zu  %8s  %6s  %6i", bytes, count, "float", redop, root);
  PrintCell(oop);
  PrintCell(ip);
  std::printf("\n");
  std::fflush(stdout);
}

inline void PrintFooter(long errors, double busbw_sum, int cells) {
  std::printf("# Out of bounds values : %ld %s\n", errors, errors ? "FAILED" : "OK");
  std::printf("# Avg bus bandwidth    : %g \n#\n", cells ? busbw_sum / cells : 0.0);
  std::fflush(stdout);
}

// ---- the sweep, shared by the MPI and Gloo drivers ----------------------------------------------

enum class Kind { kAllGather, kReduceScatter, kAllReduce, kBroadcast, kAllToAll };

struct CollInfo {
  Kind kind;
  const char* name;  // the shardline binary's stem without _perf
  bool reduces;
};

inline const CollInfo kCollectives[] = {
    {Kind::kAllGather, "all_gather", false}, {Kind::kReduceScatter, "reduce_scatter", true},
    {Kind::kAllReduce, "all_reduce", true},  {Kind::kBroadcast, "broadcast", false},
    {Kind::kAllToAll, "alltoall", false},
};

// nccl-tests' getCollByteCount (elements) and bandwidth factors; see bench/perf/*_perf.cc.
inline void Counts(Kind k, size_t count, int n, size_t* send, size_t* recv, size_t* param) {
  const size_t per = count / n;
  switch (k) {
    case Kind::kAllGather:
      *send = per;
      *recv = per * n;
      *param = per;
      return;
    case Kind::kReduceScatter:
      *send = per * n;
      *recv = per;
      *param = per;
      return;
    case Kind::kAllToAll:
      *send = per * n;
      *recv = per * n;
      *param = per;
      return;
    default:
      *send = count;
      *recv = count;
      *param = count;
      return;
  }
}
inline double AlgElements(Kind k, size_t param, int n) {
  return k == Kind::kAllReduce || k == Kind::kBroadcast ? double(param) : double(param) * n;
}
inline double BusFactor(Kind k, int n) {
  if (k == Kind::kAllReduce) return 2.0 * (n - 1) / n;
  if (k == Kind::kBroadcast) return 1.0;
  return double(n - 1) / n;
}

// Expected output element j on `rank` (root 0 for broadcast, sum for reductions).
inline float Expected(Kind k, int rank, int n, size_t param, size_t j, unsigned seed) {
  switch (k) {
    case Kind::kAllGather:
      return Input(false, int(j / param), j % param, seed);
    case Kind::kReduceScatter:
      return ReducedSum(n, size_t(rank) * param + j, seed);
    case Kind::kAllReduce:
      return ReducedSum(n, j, seed);
    case Kind::kBroadcast:
      return Input(false, 0, j, seed);
    case Kind::kAllToAll:
      return Input(false, int(j / param), size_t(rank) * param + j % param, seed);
  }
  return 0;
}

// A peer library seen by the sweep. In place, the input lies in `recv` at InPlaceInput() and
// the output at InPlaceOutput() (elements); out of place, the input is `send`, the output `recv`.
//   int rank(), size();  void Barrier();  double AverageOverRanks(double);  long SumOverRanks(long)
//   bool Supports(Kind, bool in_place);  void Run(Kind, bool in_place, float* send, float* recv,
//   size_t param);  size_t InPlaceInput(Kind, size_t param), InPlaceOutput(Kind, size_t param)
template <typename Peer>
Cell BenchTime(Peer& p, const Flags& f, Kind k, size_t size, int iters, bool in_place, float* send,
               float* recv, unsigned* seed) {
  Cell cell;
  if (!p.Supports(k, in_place)) return cell;
  const int n = p.size(), r = p.rank();
  const bool reduces = k == Kind::kReduceScatter || k == Kind::kAllReduce;
  size_t ns, nr, param;
  Counts(k, size / sizeof(float), n, &ns, &nr, &param);
  auto init = [&](unsigned s) {
    std::memset(recv, 0xFF, std::max(nr, ns + (in_place ? p.InPlaceInput(k, param) : 0)) * 4);
    Fill(in_place ? recv + p.InPlaceInput(k, param) : send, ns, reduces, r, s);
  };
  if (f.check) init(99);
  p.Run(k, in_place, send, recv, param);  // the synchronising call
  p.Barrier();
  const double start = Now();
  for (int i = 0; i < iters; ++i) p.Run(k, in_place, send, recv, param);
  const double seconds = p.AverageOverRanks((Now() - start) / iters);
  cell.present = true;
  cell.time_us = seconds * 1e6;
  cell.algbw = AlgElements(k, param, n) * sizeof(float) / 1e9 / seconds;
  cell.busbw = cell.algbw * BusFactor(k, n);
  if (f.check) {
    init(++*seed);
    p.Run(k, in_place, send, recv, param);
    const float* out = in_place ? recv + p.InPlaceOutput(k, param) : recv;
    long wrong = 0;
    for (size_t j = 0; j < nr; ++j) {
      if (!(out[j] == Expected(k, r, n, param, j, *seed))) ++wrong;
    }
    cell.wrong = p.SumOverRanks(wrong);
  }
  return cell;
}

// Runs the sweep of every requested collective the peer has; returns the number of wrong cells.
template <typename Peer>
long Sweep(Peer& p, const Flags& f, const char* system) {
  std::vector<float> send(f.max_bytes / 4 + 16), recv(f.max_bytes / 4 + 16);
  long errors = 0;
  unsigned seed = 0;
  for (const CollInfo& c : kCollectives) {
    if (f.collective != "all" && f.collective != c.name) continue;
    if (!p.Supports(c.kind, false) && !p.Supports(c.kind, true)) continue;
    if (p.rank() == 0) PrintColumns(system, c.name, p.size());
    // Warm-up as bench/perf does per launch: each group's largest, then smallest size.
    for (const Group& g : f.groups) {
      size_t top = g.lo;
      while (top * g.factor <= g.hi) top *= g.factor;
      for (size_t size : {top, g.lo}) {
        size_t ns, nr, param;
        Counts(c.kind, size / 4, p.size(), &ns, &nr, &param);
        const bool ip = !p.Supports(c.kind, false);
        for (int i = 0; i < g.warmup; ++i) p.Run(c.kind, ip, send.data(), recv.data(), param);
      }
    }
    double busbw_sum = 0;
    int cells = 0;
    long wrong_cells = 0;
    for (const Point& pt : Points(f)) {
      const size_t size = pt.bytes;
      size_t ns, nr, param;
      Counts(c.kind, size / 4, p.size(), &ns, &nr, &param);
      const Cell oop =
          BenchTime(p, f, c.kind, size, pt.iters, false, send.data(), recv.data(), &seed);
      const Cell ip =
          BenchTime(p, f, c.kind, size, pt.iters, true, send.data(), recv.data(), &seed);
      for (const Cell* cell : {&oop, &ip}) {
        if (!cell->present) continue;
        busbw_sum += cell->busbw;
        ++cells;
        if (cell->wrong > 0) ++wrong_cells;
      }
      if (p.rank() == 0) {
        PrintRow(std::max(ns, nr) * 4, param, c.reduces ? "sum" : "none",
                 c.kind == Kind::kBroadcast ? 0 : -1, oop, ip);
      }
    }
    if (p.rank() == 0) PrintFooter(wrong_cells, busbw_sum, cells);
    errors += wrong_cells;
  }
  return errors;
}

}  // namespace peer

#endif  // SHARDLINE_BENCH_COMPARE_REPORT_H_
