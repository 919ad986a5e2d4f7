// File: collectives/internal/flight_dump.h
// -----------------------------------------------------------------------------
// The process-wide side of the flight recorder (collectives-private): its knobs, the registry of
// communicators that SIGUSR1 dumps, and the watcher thread that does those dumps.

#ifndef SHARDLINE_COLLECTIVES_INTERNAL_FLIGHT_DUMP_H_
#define SHARDLINE_COLLECTIVES_INTERNAL_FLIGHT_DUMP_H_

#include <cstddef>
#include <memory>
#include <string>

namespace shardline {
class Communicator;
}

namespace shardline::flight_internal {

// SHARDLINE_FLIGHT_RECORDER (an invalid value falls back to the default; ValidateAllParams
// reports it).
size_t Capacity();
// SHARDLINE_FLIGHT_RECORDER_DIR; empty: no automatic dumps.
std::string Dir();

// Adds `comm` to the communicators that SIGUSR1 dumps. The first call with a dump directory set
// installs the SIGUSR1 handler (unless the process already handles SIGUSR1) and starts the
// watcher thread.
void Register(std::weak_ptr<Communicator> comm);

}  // namespace shardline::flight_internal

#endif  // SHARDLINE_COLLECTIVES_INTERNAL_FLIGHT_DUMP_H_
