// ElasticGroup::TransferState: a live replica's state, streamed to the replicas that join.

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "collectives/elastic/elastic_group.h"
#include "runtime/crc32c.h"
#include "runtime/logging.h"
#include "runtime/status.h"
#include "runtime/stream.h"

namespace shardline {

absl::Status ElasticGroup::TransferState(absl::Span<const StatePiece> pieces, absl::Time deadline) {
  const ElasticOptions& o = options_;
  const std::string what = absl::StrCat("elastic group '", o.name, "', rank (", o.replica, ", ",
                                        o.shard, "): state transfer of round ", current_.round);
  if (!in_round_ || current_.replicate == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(what, ": not inside a round"));
  }
  if (current_.joiners.empty()) return absl::OkStatus();
  // The donor: the first member that does not join (BeginRound made sure there is one).
  int donor = -1;
  std::vector<int> joiner_ranks;
  for (size_t i = 0; i < current_.replicas.size(); ++i) {
    const int replica = current_.replicas[i];
    const bool joins = std::find(current_.joiners.begin(), current_.joiners.end(), replica) !=
                       current_.joiners.end();
    if (joins) {
      joiner_ranks.push_back(static_cast<int>(i));
    } else if (donor < 0) {
      donor = static_cast<int>(i);
    }
  }
  Communicator& comm = *current_.replicate;
  const int me = comm.rank();
  if (me != donor && !current_.joining) return absl::OkStatus();
  SL_ASSIGN_OR_RETURN(std::unique_ptr<Stream> stream,
                      CreateHostStream({.name = "elastic.transfer"}));
  // Each piece is preceded by its size and followed by its checksum, so that a joiner whose
  // model differs fails naming the piece instead of receiving garbage.
  struct Trailer {
    uint64_t bytes;
    uint32_t crc;
    uint32_t index;
  };
  PointToPointOptions p2p;
  p2p.label = "elastic state";
  for (size_t i = 0; i < pieces.size(); ++i) {
    const StatePiece& piece = pieces[i];
    const std::string where =
        absl::StrCat(what, ": piece ", i, " of ", pieces.size(), " (", piece.bytes, " bytes)");
    if (me == donor) {
      const Trailer trailer{piece.bytes, Crc32c(piece.data, piece.bytes), static_cast<uint32_t>(i)};
      for (int joiner : joiner_ranks) {
        SL_ASSIGN_OR_RETURN(Work head,
                            comm.Send(&trailer, sizeof(trailer), DType::kU8, joiner, *stream, p2p));
        SL_RETURN_IF_ERROR(Annotate(head.Wait(deadline), where));
        if (piece.bytes > 0) {
          SL_ASSIGN_OR_RETURN(Work body,
                              comm.Send(piece.data, piece.bytes, DType::kU8, joiner, *stream, p2p));
          SL_RETURN_IF_ERROR(Annotate(body.Wait(deadline), where));
        }
      }
      continue;
    }
    Trailer trailer{};
    SL_ASSIGN_OR_RETURN(Work head,
                        comm.Recv(&trailer, sizeof(trailer), DType::kU8, donor, *stream, p2p));
    SL_RETURN_IF_ERROR(Annotate(head.Wait(deadline), where));
    if (trailer.bytes != piece.bytes || trailer.index != i) {
      // The donor sends what it has regardless; give up on the round (the donor's sends fail
      // when this rank's communicators go).
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": the donor (replica ", current_.replicas[donor], ") sends piece ", trailer.index,
          " of ", trailer.bytes,
          " bytes here: the replicas' states differ in layout (same model and optimizer?)"));
    }
    if (piece.bytes > 0) {
      SL_ASSIGN_OR_RETURN(Work body,
                          comm.Recv(piece.data, piece.bytes, DType::kU8, donor, *stream, p2p));
      SL_RETURN_IF_ERROR(Annotate(body.Wait(deadline), where));
    }
    const uint32_t crc = Crc32c(piece.data, piece.bytes);
    if (crc != trailer.crc) {
      return absl::DataLossError(absl::StrCat(where, ": CRC-32C ", absl::Hex(crc),
                                              " where the donor sent ", absl::Hex(trailer.crc)));
    }
  }
  SL_LOG(INFO, COLL) << what << ": " << (me == donor ? "sent " : "received ") << pieces.size()
                     << " pieces";
  return absl::OkStatus();
}

}  // namespace shardline
