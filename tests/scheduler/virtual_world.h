// File: tests/scheduler/virtual_world.h
// A group of schedulers on virtual time (runtime/virtual_time.h) over the sim backend, the
// harness of scheduler_virtual_test.cc and scheduler_property_test.cc: every stream is a virtual
// stream on one timeline, compute ops declare their duration, collectives take the sim cost
// model's time, no thread sleeps and no memory is touched (run_ops off, move_data off).

#ifndef SHARDLINE_TESTS_SCHEDULER_VIRTUAL_WORLD_H_
#define SHARDLINE_TESTS_SCHEDULER_VIRTUAL_WORLD_H_

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "collectives/sim/sim_communicator.h"
#include "runtime/status.h"
#include "runtime/stream.h"
#include "runtime/virtual_time.h"
#include "scheduler/scheduler.h"
#include "tests/common/rank_threads.h"

namespace shardline::testing {

// One scheduler and one compute stream per rank, all on `timeline`.
struct World {
  std::unique_ptr<VirtualTimeline> timeline;
  std::vector<std::unique_ptr<Stream>> compute;
  std::vector<std::unique_ptr<Scheduler>> schedulers;

  // The schedulers before the compute streams they were created with.
  ~World() {
    schedulers.clear();
    compute.clear();
  }
};

// `ranks` schedulers with `options` over sim communicators of 2 us latency and `bytes_per_s`;
// the schedulers' own streams are virtual streams on the same timeline. Creation splits
// communicators, a rendezvous: each rank's scheduler is created on a thread of its own.
inline absl::StatusOr<std::unique_ptr<World>> MakeWorld(int ranks, SchedulerOptions options,
                                                        double bytes_per_s) {
  auto world = std::make_unique<World>();
  SL_ASSIGN_OR_RETURN(world->timeline, VirtualTimeline::Create({.run_ops = false}));
  VirtualTimeline* tl = world->timeline.get();
  SL_ASSIGN_OR_RETURN(auto comms, CreateSimCommunicators(*tl, ranks,
                                                         {.latency = absl::Microseconds(2),
                                                          .bandwidth_bytes_per_s = bytes_per_s,
                                                          .move_data = false,
                                                          .dup_without_rendezvous = false}));
  options.stream_factory = [tl](StreamOptions so) { return CreateVirtualStream(*tl, so); };
  world->schedulers.resize(ranks);
  for (int r = 0; r < ranks; ++r) {
    SL_ASSIGN_OR_RETURN(auto stream,
                        CreateVirtualStream(*tl, {.name = absl::StrCat("rank", r, ".compute")}));
    world->compute.push_back(std::move(stream));
  }
  std::vector<absl::Status> status = RunRankThreads(ranks, [&](int r) -> absl::Status {
    SL_ASSIGN_OR_RETURN(
        world->schedulers[r],
        Scheduler::Create(comms[r], *world->compute[r], options, absl::Now() + absl::Seconds(30)));
    return absl::OkStatus();
  });
  for (const absl::Status& s : status) SL_RETURN_IF_ERROR(s);
  return world;
}

// Submits a compute op named `name` that takes `d` of virtual time and does nothing.
inline absl::Status Compute(Stream& stream, absl::Duration d, std::string name) {
  return stream.Submit(
      {.name = std::move(name), .kind = StreamOpKind::kCompute, .duration = d, .run = [] {
         return absl::OkStatus();
       }});
}

}  // namespace shardline::testing

#endif  // SHARDLINE_TESTS_SCHEDULER_VIRTUAL_WORLD_H_
