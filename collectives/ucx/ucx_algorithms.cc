#include "collectives/ucx/internal/ucx_algorithms.h"

#include <algorithm>
#include <cstring>

#include "runtime/host_kernels.h"
#include "runtime/status.h"

namespace shardline::ucx_internal {
namespace {

// Bytes per rank of the op: the block each rank contributes (all-gather, all-to-all per peer),
// receives (reduce-scatter) or the whole buffer (all-reduce, broadcast).
size_t BlockBytes(const CollectiveRun& run) { return run.fp().count * run.esize(); }

// A rank's own block into its output (the output is not read again by this collective).
void CopyBytes(void* dst, const void* src, size_t bytes) {
  if (bytes > 0 && dst != src) CopyStreaming(dst, src, bytes);
}

absl::Status FinishAverage(const CollectiveRun& run, void* data, size_t count) {
  if (run.fp().op != ReduceOp::kAvg || count == 0) return absl::OkStatus();
  return Scale(data, count, run.fp().dtype, 1.0 / run.size());
}

// The pipeline chunk: the knob, rounded to whole elements, large enough that a block has fewer
// chunks than the tag's chunk field can count.
size_t ChunkBytes(const CollectiveRun& run, size_t max_block) {
  const size_t e = run.esize();
  size_t chunk = std::max(e, run.tuning().chunk_bytes / e * e);
  size_t floor = (max_block + kMaxChunks - 2) / (kMaxChunks - 1);
  floor = (floor + e - 1) / e * e;
  return std::max(chunk, floor);
}

// In place, a reduce-scatter's own block streams from this size on (see ReducePipeline).
constexpr size_t kStreamInPlaceMinBytes = size_t{16} << 20;

struct Block {
  size_t offset = 0;  // bytes into the input (and, for all-reduce, the output)
  size_t bytes = 0;
};

// The direct pipelined reduction shared by reduce-scatter and all-reduce: this rank reduces
// blocks[rank] of every rank's input into `target`; with `gather`, each reduced chunk is sent
// to every peer and their reduced chunks are received into the output at their block offsets.
absl::Status ReducePipeline(CollectiveRun& run, const std::vector<Block>& blocks, uint8_t* target,
                            bool gather) {
  const int n = run.size();
  const int me = run.rank();
  const size_t e = run.esize();
  size_t max_block = 0;
  for (const Block& b : blocks) max_block = std::max(max_block, b.bytes);
  const size_t chunk = ChunkBytes(run, max_block);
  auto num_chunks = [&](size_t bytes) { return (bytes + chunk - 1) / chunk; };
  auto chunk_len = [&](size_t bytes, size_t c) { return std::min(chunk, bytes - c * chunk); };

  // A peer that reads this rank's memory (single copy, same host) is offered its share of the
  // input whole: one descriptor and, once it has reduced the last chunk, one fin, however many
  // chunks the block has; it reads the chunks straight out of its mapping (or with
  // process_vm_readv) at its own pace. The input is all there from the start, so offering it
  // chunk by chunk only cost messages and waits: a descriptor and a fin per chunk and peer, and
  // a window of offers paced by the fins, which cost 2 ranks 14-19% of a 64 MiB reduce-scatter's
  // bandwidth with the default spin (docs/benchmarks.md). Not for the all-reduce: reducing
  // without that pacing, its ranks posted their gather offers (a descriptor per reduced chunk
  // and peer) faster than the shared-memory queues drain them, and 4 ranks lost 13-22% at
  // 64 MiB.
  //
  // Other peers (on other hosts or without single copy, and every peer of the all-reduce) get
  // chunks, a message each, a window ahead of what the peer has received. Not all at once: each is
  // a message, and a transport's queue to a peer holds only so many (UCX's mm FIFO: 64 by default);
  // the rest wait in UCX's pending queue and move only when this rank progresses its worker, which
  // nothing wakes it for. A peer's completion of chunk c lets chunk c + offer_window go: two
  // receive windows, so that the next chunks are already on their way when the peer posts its
  // receives, and few enough for the queue beside the all-reduce's gather messages (UCX releases
  // FIFO slots in batches: four windows ahead stalled).
  auto whole = [&](int p) { return !gather && run.PulledBy(p); };
  auto offers_for = [&](int p) -> size_t {
    const size_t c = num_chunks(blocks[p].bytes);
    return whole(p) ? std::min<size_t>(c, 1) : c;
  };
  const size_t offer_window =
      std::clamp<size_t>(2 * static_cast<size_t>(std::max(run.tuning().window, 1)), 4, 16);
  std::vector<std::vector<Completion*>>& offers = run.scratch().offers;
  offers.assign(n, {});
  size_t offers_left = 0;
  auto offer = [&](int p) {
    const Block& b = blocks[p];
    const size_t c = offers[p].size();
    const size_t bytes = whole(p) ? b.bytes : chunk_len(b.bytes, c);
    offers[p].push_back(run.Send(p, run.input() + b.offset + c * chunk, bytes, Phase::kData, c));
    --offers_left;
  };
  for (int i = 1; i < n; ++i) {
    const int p = (me + i) % n;
    offers_left += offers_for(p);
    while (offers[p].size() < std::min(offer_window, offers_for(p))) offer(p);
  }
  // Offers the next chunks to every peer that has read far enough (cheap: one check per peer).
  auto offer_more = [&]() -> absl::Status {
    if (offers_left == 0) return absl::OkStatus();
    for (int i = 1; i < n; ++i) {
      const int p = (me + i) % n;
      while (offers[p].size() < offers_for(p)) {
        SL_ASSIGN_OR_RETURN(const bool read, run.Done(offers[p][offers[p].size() - offer_window]));
        if (!read) break;
        offer(p);
      }
    }
    return absl::OkStatus();
  };
  if (gather) {
    for (int i = 1; i < n; ++i) {
      const int p = (me - i + n) % n;
      const Block& b = blocks[p];
      for (size_t c = 0; c < num_chunks(b.bytes); ++c) {
        run.Recv(p, run.output() + b.offset + c * chunk, chunk_len(b.bytes, c), Phase::kGather, c);
      }
    }
  }

  const Block& mine = blocks[me];
  const size_t total = num_chunks(mine.bytes);
  if (total == 0) {
    return run.Drive([&]() -> absl::StatusOr<bool> {
      SL_RETURN_IF_ERROR(offer_more());
      return offers_left == 0;
    });
  }
  const size_t window = std::min<size_t>(run.tuning().window, total);
  SL_ASSIGN_OR_RETURN(uint8_t* const scratch, run.Staging(window * (n - 1) * chunk));
  auto slot = [&](size_t c, int p) {
    return scratch + ((c % window) * (n - 1) + (p < me ? p : p - 1)) * chunk;
  };
  // Block `me` of the peers that offer it whole, leased for the whole reduction.
  std::vector<Completion*> leases(n, nullptr);
  for (int i = 1; i < n; ++i) {
    const int p = (me - i + n) % n;
    if (!gather && run.PullsFrom(p)) leases[p] = run.Lease(p, mine.bytes, Phase::kData, 0);
  }
  std::vector<std::vector<Completion*>> pending(window, std::vector<Completion*>(n, nullptr));
  auto post = [&](size_t c) {
    for (int i = 1; i < n; ++i) {
      const int p = (me - i + n) % n;
      if (leases[p] != nullptr) continue;
      pending[c % window][p] =
          run.Recv(p, slot(c, p), chunk_len(mine.bytes, c), Phase::kData, c, /*borrow=*/true);
    }
  };
  size_t next_post = 0;
  while (next_post < window) post(next_post++);

  // A reduce-scatter's output is written whole and not read again here: non-temporal stores
  // spare reading each line before it is overwritten (n + 1 bytes of memory traffic per output
  // byte instead of n + 2; 2 ranks out of place: +30% at 16 MiB, +40% at 64 MiB). In place the
  // output is this rank's own input block, whose lines the reduction has just read, so a plain
  // store reads nothing more, and it keeps them in the caches where a streaming store evicts
  // them: a small block is left to plain stores (2 ranks at 16 MiB, 8 MiB blocks: -20%
  // streaming), a block of kStreamInPlaceMinBytes or more streams (4 ranks at 64 MiB, 16 MiB
  // blocks: +22-33%; 2 ranks at 64 MiB: +1-9%). The all-reduce sends what it reduced to its
  // peers at once, and an average scales it again: both read the output back.
  const uint8_t* const input_end = run.input() + blocks.back().offset + blocks.back().bytes;
  const bool overlaps = target < input_end && run.input() < target + mine.bytes;
  const bool stream = !gather && (!overlaps || mine.bytes >= kStreamInPlaceMinBytes) &&
                      run.fp().op != ReduceOp::kAvg;
  size_t next_reduce = 0;
  std::vector<const void*> inputs(n);
  return run.Drive([&]() -> absl::StatusOr<bool> {
    SL_RETURN_IF_ERROR(offer_more());
    while (next_reduce < total) {
      const size_t c = next_reduce;
      for (int p = 0; p < n; ++p) {
        SL_ASSIGN_OR_RETURN(const bool done,
                            run.Done(leases[p] != nullptr ? leases[p] : pending[c % window][p]));
        if (!done) return false;
      }
      const size_t len = chunk_len(mine.bytes, c);
      // Rank order, as the local backend: the same bits whoever reduces.
      for (int p = 0; p < n; ++p) {
        if (p == me) {
          inputs[p] = run.input() + mine.offset + c * chunk;
        } else if (leases[p] == nullptr) {
          inputs[p] = pending[c % window][p]->view;
        } else if (leases[p]->view != nullptr) {
          inputs[p] = leases[p]->view + c * chunk;
        } else {
          SL_RETURN_IF_ERROR(run.ReadLeased(leases[p], c * chunk, slot(c, p), len));
          inputs[p] = slot(c, p);
        }
      }
      uint8_t* dst = target + c * chunk;
      const DType dtype = run.fp().dtype;
      const ReduceOp op = run.fp().op;
      SL_RETURN_IF_ERROR(stream ? ReduceManyStreaming(dst, inputs.data(), n, len / e, dtype, op)
                                : ReduceMany(dst, inputs.data(), n, len / e, dtype, op));
      for (int p = 0; p < n; ++p) run.Return(pending[c % window][p]);
      SL_RETURN_IF_ERROR(FinishAverage(run, dst, len / e));
      if (gather) {
        for (int i = 1; i < n; ++i) run.Send((me + i) % n, dst, len, Phase::kGather, c);
      }
      for (int p = 0; p < n; ++p) pending[c % window][p] = nullptr;
      ++next_reduce;
      if (next_reduce == total) {
        for (int p = 0; p < n; ++p) run.Return(leases[p]);
      }
      if (next_post < total) post(next_post++);
      // The peers' fins for this rank's chunks may have arrived meanwhile: offer on at once
      // rather than after the chunks ready now are all reduced (a peer may be waiting).
      if (offers_left > 0 && next_reduce < total) {
        SL_RETURN_IF_ERROR(run.PollOnce());
        SL_RETURN_IF_ERROR(offer_more());
      }
    }
    // Done reducing; the peers may still be reading this rank's chunks: offer the rest.
    SL_RETURN_IF_ERROR(offer_more());
    return offers_left == 0;
  });
}

}  // namespace

bool IsSmall(const CollectiveRun& run) {
  return run.fp().kind == CollectiveKind::kBarrier || BlockBytes(run) <= run.tuning().small_bytes;
}

size_t SmallPayloadBytes(const CollectiveRun& run, int from, int /*to*/) {
  switch (run.fp().kind) {
    case CollectiveKind::kAllGather:
    case CollectiveKind::kAllToAll:
    case CollectiveKind::kReduceScatter:
    case CollectiveKind::kAllReduce:
      return BlockBytes(run);
    case CollectiveKind::kBroadcast:
      return from == run.fp().root ? BlockBytes(run) : 0;
    case CollectiveKind::kBarrier:
    case CollectiveKind::kSend:  // point-to-point never runs here (ucx_point_to_point.cc)
    case CollectiveKind::kRecv:
      return 0;
  }
  return 0;
}

const void* SmallPayload(const CollectiveRun& run, int to) {
  switch (run.fp().kind) {
    case CollectiveKind::kAllToAll:
    case CollectiveKind::kReduceScatter:
      return run.input() + to * BlockBytes(run);
    default:
      return run.input();
  }
}

namespace {
// Whether the op sends each peer a block of its own (at SmallPayload(run, p)).
bool PerPeerBlocks(const CollectiveRun& run) {
  return run.fp().kind == CollectiveKind::kAllToAll ||
         run.fp().kind == CollectiveKind::kReduceScatter;
}
}  // namespace

void FillMailbox(const CollectiveRun& run, uint8_t* out) {
  const int me = run.rank();
  const size_t bytes = BlockBytes(run);
  if (PerPeerBlocks(run)) {
    for (int p = 0; p < run.size(); ++p) {
      if (p != me) CopyBytes(out + p * bytes, SmallPayload(run, p), bytes);
    }
    return;
  }
  // Every peer gets the same bytes (none from a broadcast's non-root).
  const int anyone = me == 0 ? 1 : 0;
  const size_t same = SmallPayloadBytes(run, me, anyone);
  if (same > 0) CopyBytes(out, SmallPayload(run, anyone), same);
}

const uint8_t* MailboxPayloadFor(const CollectiveRun& run, const uint8_t* box, int from) {
  if (SmallPayloadBytes(run, from, run.rank()) == 0) return nullptr;
  return PerPeerBlocks(run) ? box + run.rank() * BlockBytes(run) : box;
}

absl::Status FinishSmall(CollectiveRun& run, const std::vector<const uint8_t*>& staging) {
  const int n = run.size();
  const int me = run.rank();
  const size_t bytes = BlockBytes(run);
  const CollectiveFingerprint& fp = run.fp();
  if (bytes == 0) return absl::OkStatus();
  switch (fp.kind) {
    case CollectiveKind::kAllGather:
      for (int p = 0; p < n; ++p) {
        CopyBytes(run.output() + p * bytes, p == me ? run.input() : staging[p], bytes);
      }
      return absl::OkStatus();
    case CollectiveKind::kAllToAll:
      for (int p = 0; p < n; ++p) {
        CopyBytes(run.output() + p * bytes, p == me ? run.input() + me * bytes : staging[p], bytes);
      }
      return absl::OkStatus();
    case CollectiveKind::kBroadcast:
      if (me != fp.root) CopyBytes(run.output(), staging[fp.root], bytes);
      return absl::OkStatus();
    case CollectiveKind::kReduceScatter:
    case CollectiveKind::kAllReduce: {
      const size_t own = fp.kind == CollectiveKind::kReduceScatter ? me * bytes : 0;
      std::vector<const void*>& inputs = run.scratch().inputs;
      inputs.resize(n);
      for (int p = 0; p < n; ++p) inputs[p] = p == me ? run.input() + own : staging[p];
      SL_RETURN_IF_ERROR(ReduceMany(run.output(), inputs.data(), n, fp.count, fp.dtype, fp.op));
      return FinishAverage(run, run.output(), fp.count);
    }
    case CollectiveKind::kBarrier:
      return absl::OkStatus();
    case CollectiveKind::kSend:  // point-to-point never runs here (ucx_point_to_point.cc)
    case CollectiveKind::kRecv:
      break;
  }
  return absl::OkStatus();
}

namespace {

// Every peer's block straight into its slice of the output; this rank sends peer p the block
// at `input + send_stride * p` (stride 0: the same block to everyone, the all-gather).
absl::Status DirectExchange(CollectiveRun& run, size_t send_stride) {
  const int n = run.size();
  const int me = run.rank();
  const size_t bytes = BlockBytes(run);
  for (int i = 1; i < n; ++i) {
    const int p = (me - i + n) % n;
    run.Recv(p, run.output() + p * bytes, bytes, Phase::kData, 0);
  }
  for (int i = 1; i < n; ++i) {
    const int p = (me + i) % n;
    run.Send(p, run.input() + p * send_stride, bytes, Phase::kData, 0);
  }
  // In place (all-gather), the input already is this rank's slice.
  CopyBytes(run.output() + me * bytes, run.input() + me * send_stride, bytes);
  return absl::OkStatus();
}

}  // namespace

absl::Status LargeAllGather(CollectiveRun& run) { return DirectExchange(run, 0); }

absl::Status LargeAllToAll(CollectiveRun& run) { return DirectExchange(run, BlockBytes(run)); }

absl::Status LargeBroadcast(CollectiveRun& run) {
  const int n = run.size();
  const int me = run.rank();
  const int root = run.fp().root;
  const size_t bytes = BlockBytes(run);
  if (me == root) {
    for (int i = 1; i < n; ++i) run.Send((me + i) % n, run.output(), bytes, Phase::kData, 0);
  } else {
    run.Recv(root, run.output(), bytes, Phase::kData, 0);
  }
  return absl::OkStatus();
}

absl::Status LargeReduceScatter(CollectiveRun& run) {
  const size_t bytes = BlockBytes(run);
  std::vector<Block> blocks(run.size());
  for (int p = 0; p < run.size(); ++p) blocks[p] = {p * bytes, bytes};
  return ReducePipeline(run, blocks, run.output(), /*gather=*/false);
}

absl::Status LargeAllReduce(CollectiveRun& run) {
  const int n = run.size();
  const size_t count = run.fp().count;
  const size_t per = (count + n - 1) / n;
  std::vector<Block> blocks(n);
  for (int p = 0; p < n; ++p) {
    const size_t begin = std::min(count, per * p);
    const size_t end = std::min(count, per * (p + 1));
    blocks[p] = {begin * run.esize(), (end - begin) * run.esize()};
  }
  return ReducePipeline(run, blocks, run.output() + blocks[run.rank()].offset, /*gather=*/true);
}

}  // namespace shardline::ucx_internal
