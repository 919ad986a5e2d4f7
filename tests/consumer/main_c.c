/* The installed C API from a C program: find_package(shardline) and shardline::c. */
#include <stdio.h>

#include "shardline.h"

int main(void) {
  int version = 0;
  shardlineComm_t comm;
  shardlineStream_t stream;
  shardlineWork_t work;
  double x = 1.5;
  if (shardline_get_version(&version) != shardlineSuccess ||
      shardline_comm_init_local(1, 10, &comm) != shardlineSuccess ||
      shardline_stream_create_caller("c consumer", &stream) != shardlineSuccess ||
      shardline_all_reduce(comm, &x, &x, 1, shardlineFloat64, shardlineSum, stream, &work) !=
          shardlineSuccess ||
      shardline_work_wait(work, 10) != shardlineSuccess || x != 1.5) {
    fprintf(stderr, "shardline C consumer: %s\n", shardline_last_error());
    return 1;
  }
  shardline_work_destroy(work);
  shardline_stream_destroy(stream);
  shardline_comm_destroy(comm);
  printf("shardline C consumer: version %d, a 1-rank all-reduce through libshardline_c\n", version);
  return 0;
}
