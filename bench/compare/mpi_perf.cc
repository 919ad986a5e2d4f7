// mpi_perf: Open MPI's collectives in the nccl-tests columns, for bench/compare.
//   mpirun -n 2 mpi_perf all -b 4K -e 64M -f 4 -n 20 -w 5 -c 1
// MPI_Allgather, MPI_Reduce_scatter_block, MPI_Allreduce, MPI_Bcast (root 0; in place only, as
// it has one buffer) and MPI_Alltoall, on MPI_FLOAT with MPI_SUM; in place means MPI_IN_PLACE.

#include <mpi.h>

#include "report.h"

namespace {

class MpiPeer {
 public:
  MpiPeer() {
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
  }
  int rank() const { return rank_; }
  int size() const { return size_; }
  void Barrier() { MPI_Barrier(MPI_COMM_WORLD); }
  double AverageOverRanks(double v) {
    double sum = 0;
    MPI_Allreduce(&v, &sum, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    return sum / size_;
  }
  long SumOverRanks(long v) {
    long sum = 0;
    MPI_Allreduce(&v, &sum, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
    return sum;
  }
  bool Supports(peer::Kind k, bool in_place) { return in_place || k != peer::Kind::kBroadcast; }
  size_t InPlaceInput(peer::Kind k, size_t param) {
    return k == peer::Kind::kAllGather ? size_t(rank_) * param : 0;
  }
  // MPI_Reduce_scatter_block in place leaves this rank's block at the start of recvbuf.
  size_t InPlaceOutput(peer::Kind k, size_t param) { return 0; }

  void Run(peer::Kind k, bool ip, float* send, float* recv, size_t param) {
    const int c = static_cast<int>(param);
    switch (k) {
      case peer::Kind::kAllGather:
        if (ip)
          MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, recv, c, MPI_FLOAT, MPI_COMM_WORLD);
        else
          MPI_Allgather(send, c, MPI_FLOAT, recv, c, MPI_FLOAT, MPI_COMM_WORLD);
        return;
      case peer::Kind::kReduceScatter:
        MPI_Reduce_scatter_block(ip ? MPI_IN_PLACE : send, recv, c, MPI_FLOAT, MPI_SUM,
                                 MPI_COMM_WORLD);
        return;
      case peer::Kind::kAllReduce:
        MPI_Allreduce(ip ? MPI_IN_PLACE : send, recv, c, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        return;
      case peer::Kind::kBroadcast:
        MPI_Bcast(recv, c, MPI_FLOAT, 0, MPI_COMM_WORLD);
        return;
      case peer::Kind::kAllToAll:
        if (ip)
          MPI_Alltoall(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, recv, c, MPI_FLOAT, MPI_COMM_WORLD);
        else
          MPI_Alltoall(send, c, MPI_FLOAT, recv, c, MPI_FLOAT, MPI_COMM_WORLD);
        return;
    }
  }

 private:
  int rank_ = 0;
  int size_ = 1;
};

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  const peer::Flags flags = peer::ParseFlags(argc, argv);
  MpiPeer mpi;
  if (mpi.rank() == 0) {
    char version[MPI_MAX_LIBRARY_VERSION_STRING];
    int len = 0;
    MPI_Get_library_version(version, &len);
    std::printf("# mpi_perf: %.*s\n", len > 0 && version[len - 1] == '\n' ? len - 1 : len, version);
  }
  const long errors = peer::Sweep(mpi, flags, "openmpi");
  MPI_Finalize();
  return errors ? 1 : 0;
}
