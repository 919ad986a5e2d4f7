// VirtualTimeline: the public face of the virtual-time engine (runtime/virtual_engine.cc); its
// streams and events are in runtime/virtual_stream.cc.

#include "runtime/virtual_time.h"

#include <cmath>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "runtime/check.h"
#include "runtime/internal/virtual_time_internal.h"
#include "runtime/virtual_sharing.h"

namespace shardline {

VirtualTimeline::VirtualTimeline() : VirtualTimeline(VirtualTimelineOptions()) {}

VirtualTimeline::VirtualTimeline(VirtualTimelineOptions options)
    : options_(std::move(options)),
      impl_(std::make_shared<Impl>(options_)),
      sharing_(std::make_shared<VirtualSharing>(
          *this, options_.host_cores > 0 ? options_.host_cores : 1.0)) {
  if (options_.host_cores > 0) impl_->SetSharing(sharing_.get());
}

absl::StatusOr<std::unique_ptr<VirtualTimeline>> VirtualTimeline::Create(
    VirtualTimelineOptions options) {
  const std::pair<const char*, double> rates[] = {
      {"copy_bytes_per_s", options.copy_bytes_per_s},
      {"cast_bytes_per_s", options.cast_bytes_per_s},
      {"reduce_bytes_per_s", options.reduce_bytes_per_s},
      {"fill_bytes_per_s", options.fill_bytes_per_s},
      {"collective_bytes_per_s", options.collective_bytes_per_s},
      {"compute_flops_per_s", options.compute_flops_per_s},
  };
  for (const auto& [name, rate] : rates) {
    if (!(rate > 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("VirtualTimelineOptions.", name, " must be positive, got ", rate));
    }
  }
  if (!(options.host_cores >= 0) || std::isinf(options.host_cores)) {
    return absl::InvalidArgumentError(
        absl::StrCat("VirtualTimelineOptions.host_cores must be finite and not negative, got ",
                     options.host_cores));
  }
  if (options.op_overhead < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("VirtualTimelineOptions.op_overhead must not be negative, got ",
                     absl::FormatDuration(options.op_overhead)));
  }
  return std::unique_ptr<VirtualTimeline>(new VirtualTimeline(std::move(options)));
}

VirtualTimeline::~VirtualTimeline() {
  const std::vector<std::string> alive = impl_->Shutdown();
  SL_CHECK(alive.empty()) << "VirtualTimeline destroyed while " << alive.size()
                          << " of its streams are alive ('" << absl::StrJoin(alive, "', '")
                          << "'): destroy the streams first";
}

absl::Time VirtualTimeline::Now() const { return impl_->Now(); }

bool VirtualTimeline::WaitUntil(std::condition_variable& cv, std::unique_lock<std::mutex>& lock,
                                absl::Time deadline, absl::FunctionRef<bool()> done) const {
  if (done()) return true;
  if (impl_->OnDriverThread()) return false;  // the clock cannot move while its driver waits
  return impl_->clock().WaitUntil(cv, lock, deadline, done);
}

absl::Duration VirtualTimeline::OpDuration(const StreamOp& op) const {
  return impl_->OpDuration(op);
}

absl::Status VirtualTimeline::RunUntilIdle() { return impl_->RunUntilIdle(); }
absl::Status VirtualTimeline::RunUntil(absl::Time t) { return impl_->RunUntil(t); }
int64_t VirtualTimeline::steps() const { return impl_->steps(); }
int64_t VirtualTimeline::host_blocking_runs() const { return impl_->host_blocking_runs(); }

VirtualTimer VirtualTimeline::ScheduleAt(absl::Time at, absl::AnyInvocable<void() &&> callback,
                                         bool progress) {
  return impl_->ScheduleCallback(at, std::move(callback), progress);
}

void VirtualTimeline::Cancel(const VirtualTimer& timer) { impl_->Cancel(timer); }

}  // namespace shardline
