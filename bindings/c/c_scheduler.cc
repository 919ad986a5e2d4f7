// File: bindings/c/c_scheduler.cc
// -----------------------------------------------------------------------------
// The C API's FSDP scheduler: creation from shardlineSchedulerConfig_t (with the framework's
// allocators, runtime/callback_stream.h), unit registration, the hooks, the views of parameters,
// gradients and shards, and the step metrics.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "bindings/c/c_internal.h"
#include "bindings/c/shardline.h"
#include "runtime/allocator.h"
#include "runtime/callback_stream.h"
#include "runtime/dtype.h"
#include "runtime/flat_layout.h"
#include "scheduler/scheduler.h"

// The ABI rule of the header: a field added to an option struct lies at or past the sizeof of
// every older layout, so that an older struct_size (trailing padding included) never covers it.
// The first release's shardlineSchedulerConfig_t ended with reduce_op.
static_assert(offsetof(shardlineSchedulerConfig_t, unsharded_allocator) >=
                  ((offsetof(shardlineSchedulerConfig_t, reduce_op) + sizeof(shardlineRedOp_t) +
                    alignof(shardlineSchedulerConfig_t) - 1) /
                   alignof(shardlineSchedulerConfig_t) * alignof(shardlineSchedulerConfig_t)),
              "a field added to shardlineSchedulerConfig_t overlaps the first layout's padding");
// The second layout ended with trace.
static_assert(offsetof(shardlineSchedulerConfig_t, time_communication) >=
                  ((offsetof(shardlineSchedulerConfig_t, trace) + sizeof(shardlineTrace_t) +
                    alignof(shardlineSchedulerConfig_t) - 1) /
                   alignof(shardlineSchedulerConfig_t) * alignof(shardlineSchedulerConfig_t)),
              "a field added to shardlineSchedulerConfig_t overlaps the second layout's padding");

namespace shardline::c_api {

absl::Status CheckUnit(shardlineScheduler_t s, int unit, const char* fn) {
  if (s == nullptr) return absl::InvalidArgumentError(absl::StrCat(fn, ": scheduler is NULL"));
  if (unit < 0 || unit >= s->scheduler->num_units()) {
    return absl::InvalidArgumentError(
        absl::StrCat(fn, ": no unit ", unit, " (", s->scheduler->num_units(), " registered)"));
  }
  return absl::OkStatus();
}

}  // namespace shardline::c_api

namespace {

using shardline::DType;
using shardline::c_api::CheckUnit;
using shardline::c_api::Fail;
using shardline::c_api::FromStatus;
using shardline::c_api::Guard;
using shardline::c_api::ReadConfig;
using shardline::c_api::Timeout;
using shardline::c_api::ToDType;
using shardline::c_api::ToOp;

// A framework allocator's callbacks, checked.
shardlineResult_t ReadCallbacks(const shardlineAllocator_t* in, shardlineAllocator_t* out,
                                const char* field) {
  const shardlineAllocator_t defaults = SHARDLINE_ALLOCATOR_INIT;
  if (shardlineResult_t r = ReadConfig(in, defaults, out, "shardlineAllocator_t");
      r != shardlineSuccess) {
    return r;
  }
  if (out->alloc == nullptr || out->free == nullptr) {
    return Fail(shardlineInvalidArgument,
                absl::StrCat("INVALID_ARGUMENT: shardlineSchedulerConfig_t.", field,
                             ": alloc and free must both be set"));
  }
  return shardlineSuccess;
}

// A checked framework allocator as the runtime's callback allocator.
shardline::AllocatorCallbacks FromC(const shardlineAllocator_t& a) {
  return {.user = a.user, .alloc = a.alloc, .free = a.free, .origin = "shardlineAllocator_t"};
}

double Seconds(const std::optional<absl::Duration>& d) {
  return d.has_value() ? absl::ToDoubleSeconds(*d) : -1.0;
}

template <typename Hook>
shardlineResult_t RunHook(shardlineScheduler_t s, int unit, const char* fn, Hook&& hook) {
  return Guard([&] {
    absl::Status status = CheckUnit(s, unit, fn);
    if (status.ok()) status = hook(*s->scheduler);
    return FromStatus(status);
  });
}

}  // namespace

extern "C" {

// ---- Scheduler -----------------------------------------------------------------------------

shardlineResult_t shardline_scheduler_create(shardlineComm_t world, shardlineStream_t compute,
                                             const shardlineSchedulerConfig_t* config,
                                             double timeout_s, shardlineScheduler_t* scheduler) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_REQUIRE(world != nullptr && compute != nullptr && scheduler != nullptr,
                 "shardline_scheduler_create: world, compute and scheduler must not be NULL");
    shardlineSchedulerConfig_t c;
    const shardlineSchedulerConfig_t defaults = SHARDLINE_SCHEDULER_CONFIG_INIT;
    if (shardlineResult_t r = ReadConfig(config, defaults, &c, "shardlineSchedulerConfig_t");
        r != shardlineSuccess) {
      return r;
    }
    shardline::SchedulerOptions o;
    if (c.name != nullptr) o.name = c.name;
    SL_C_REQUIRE(
        c.strategy >= shardlineFullShard && c.strategy <= shardlineHybridShard,
        absl::StrCat("shardlineSchedulerConfig_t.strategy ", static_cast<int>(c.strategy)));
    o.strategy = static_cast<shardline::ShardingStrategy>(c.strategy);
    o.shard_size = c.shard_size;
    o.forward_prefetch = c.forward_prefetch;
    SL_C_REQUIRE(c.backward_prefetch >= shardlineBackwardPrefetchOff &&
                     c.backward_prefetch <= shardlineBackwardPrefetchAfterGrad,
                 absl::StrCat("shardlineSchedulerConfig_t.backward_prefetch ",
                              static_cast<int>(c.backward_prefetch)));
    o.backward_prefetch = static_cast<shardline::BackwardPrefetch>(c.backward_prefetch);
    o.backward_prefetch_depth = c.backward_prefetch_depth;
    o.budget_bytes = c.budget_bytes;
    o.budget_units = c.budget_units;
    o.root_unit = c.root_unit;
    o.cpu_offload = c.cpu_offload != 0;
    o.time_communication = c.time_communication != 0;
    auto s = std::make_unique<shardlineScheduler_s>();
    DType param, reduce;
    SL_C_REQUIRE(ToDType(c.param_dtype, &param) && ToDType(c.reduce_dtype, &reduce),
                 "shardlineSchedulerConfig_t: unknown param_dtype or reduce_dtype");
    SL_C_REQUIRE(ToOp(c.reduce_op, &s->policy.reduce_op),
                 "shardlineSchedulerConfig_t: unknown reduce_op");
    s->policy.precision.param_dtype = param;
    s->policy.precision.reduce_dtype = reduce;
    const shardline::Device device = compute->stream->device();
    s->master_device = o.cpu_offload ? shardline::Device::Host() : device;
    if (c.unsharded_allocator != nullptr) {
      shardlineAllocator_t a;
      if (shardlineResult_t r = ReadCallbacks(c.unsharded_allocator, &a, "unsharded_allocator");
          r != shardlineSuccess) {
        return r;
      }
      // Two allocators over the same callbacks, each with its own accounting (the pools' peaks
      // in the metrics). Neither hands out a block before every stream that used it is done,
      // so sharing the framework's pool never makes the gather stream wait for a reduction
      // (the hazard SchedulerOptions::gather_pool warns of for shared caching pools).
      absl::StatusOr<std::unique_ptr<shardline::Allocator>> gather =
          shardline::CreateCallbackAllocator(FromC(a), device, o.name + ".gather (framework)");
      if (!gather.ok()) return FromStatus(gather.status());
      absl::StatusOr<std::unique_ptr<shardline::Allocator>> reduce =
          shardline::CreateCallbackAllocator(FromC(a), device, o.name + ".reduce (framework)");
      if (!reduce.ok()) return FromStatus(reduce.status());
      s->gather_pool = *std::move(gather);
      s->reduce_pool = *std::move(reduce);
      o.gather_pool = s->gather_pool.get();
      o.reduce_pool = s->reduce_pool.get();
    }
    if (c.shard_allocator != nullptr) {
      shardlineAllocator_t a;
      if (shardlineResult_t r = ReadCallbacks(c.shard_allocator, &a, "shard_allocator");
          r != shardlineSuccess) {
        return r;
      }
      // With CPU offload the shards are host memory: the framework's allocator replaces the
      // offload allocator (which replaces the shard allocator there).
      absl::StatusOr<std::unique_ptr<shardline::Allocator>> shards =
          shardline::CreateCallbackAllocator(FromC(a), s->master_device,
                                             o.name + ".shards (framework)");
      if (!shards.ok()) return FromStatus(shards.status());
      s->shard_allocator = *std::move(shards);
      (o.cpu_offload ? o.offload_allocator : o.shard_allocator) = s->shard_allocator.get();
    }
    if (c.trace != nullptr) o.trace = &c.trace->writer;
    absl::StatusOr<std::unique_ptr<shardline::Scheduler>> created = shardline::Scheduler::Create(
        world->comm, *compute->stream, std::move(o), absl::Now() + Timeout(timeout_s));
    if (!created.ok()) return FromStatus(created.status());
    s->scheduler = *std::move(created);
    *scheduler = s.release();
    return shardlineSuccess;
  });
}

shardlineResult_t shardline_scheduler_destroy(shardlineScheduler_t scheduler) {
  return Guard([&] {
    delete scheduler;
    return shardlineSuccess;
  });
}

namespace {

// The UnitSpec of a C tensor list (names and shapes checked), with the scheduler's policy.
shardlineResult_t BuildSpec(shardlineScheduler_t scheduler, const char* fn, const char* name,
                            const shardlineTensorSpec_t* tensors, int num_tensors,
                            shardline::UnitSpec* spec) {
  SL_C_REQUIRE(scheduler != nullptr && name != nullptr &&
                   (tensors != nullptr || num_tensors == 0) && num_tensors >= 0,
               absl::StrCat(fn, ": NULL or negative argument"));
  spec->name = name;
  spec->policy = scheduler->policy;
  for (int t = 0; t < num_tensors; ++t) {
    SL_C_REQUIRE(tensors[t].name != nullptr && tensors[t].ndim >= 0 &&
                     (tensors[t].shape != nullptr || tensors[t].ndim == 0),
                 absl::StrCat(fn, "('", name, "'): tensor ", t,
                              " has a NULL name or shape or a negative ndim"));
    spec->tensors.push_back(
        {.name = tensors[t].name,
         .shape = std::vector<int64_t>(tensors[t].shape, tensors[t].shape + tensors[t].ndim)});
  }
  return shardlineSuccess;
}

// This rank's master shard elements for `spec` (the layout RegisterUnit builds).
absl::StatusOr<size_t> ShardElements(const shardline::Scheduler& scheduler,
                                     const shardline::UnitSpec& spec) {
  absl::StatusOr<shardline::FlatLayout> layout = shardline::FlatLayout::Create(
      spec.tensors, {.num_shards = scheduler.mesh().shard_size(),
                     .element_dtype = spec.policy.precision.master_dtype});
  if (!layout.ok()) return layout.status();
  return layout->shard_elements();
}

}  // namespace

shardlineResult_t shardline_scheduler_register_unit(shardlineScheduler_t scheduler,
                                                    const char* name,
                                                    const shardlineTensorSpec_t* tensors,
                                                    int num_tensors, int* unit) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_REQUIRE(unit != nullptr, "shardline_scheduler_register_unit: unit is NULL");
    shardline::UnitSpec spec;
    if (shardlineResult_t r = BuildSpec(scheduler, "shardline_scheduler_register_unit", name,
                                        tensors, num_tensors, &spec);
        r != shardlineSuccess) {
      return r;
    }
    absl::StatusOr<int> id = scheduler->scheduler->RegisterUnit(std::move(spec));
    if (!id.ok()) return FromStatus(id.status());
    *unit = *id;
    return shardlineSuccess;
  });
}

shardlineResult_t shardline_scheduler_shard_elements(shardlineScheduler_t scheduler,
                                                     const shardlineTensorSpec_t* tensors,
                                                     int num_tensors, size_t* elements) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_REQUIRE(elements != nullptr, "shardline_scheduler_shard_elements: elements is NULL");
    shardline::UnitSpec spec;
    if (shardlineResult_t r = BuildSpec(scheduler, "shardline_scheduler_shard_elements", "unit",
                                        tensors, num_tensors, &spec);
        r != shardlineSuccess) {
      return r;
    }
    absl::StatusOr<size_t> n = ShardElements(*scheduler->scheduler, spec);
    if (!n.ok()) return FromStatus(n.status());
    *elements = *n;
    return shardlineSuccess;
  });
}

shardlineResult_t shardline_scheduler_register_unit_adopted(
    shardlineScheduler_t scheduler, const char* name, const shardlineTensorSpec_t* tensors,
    int num_tensors, void* master_shard, size_t bytes, void (*release)(void* user, void* data),
    void* user, int* unit) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_REQUIRE(unit != nullptr, "shardline_scheduler_register_unit_adopted: unit is NULL");
    shardline::UnitSpec spec;
    if (shardlineResult_t r = BuildSpec(scheduler, "shardline_scheduler_register_unit_adopted",
                                        name, tensors, num_tensors, &spec);
        r != shardlineSuccess) {
      return r;
    }
    absl::StatusOr<size_t> elements = ShardElements(*scheduler->scheduler, spec);
    if (!elements.ok()) return FromStatus(elements.status());
    const size_t needed = *elements * shardline::DTypeSize(spec.policy.precision.master_dtype);
    SL_C_REQUIRE(master_shard != nullptr || needed == 0,
                 absl::StrCat("shardline_scheduler_register_unit_adopted('", name,
                              "'): master_shard is NULL"));
    SL_C_REQUIRE(bytes == needed,
                 absl::StrCat("shardline_scheduler_register_unit_adopted('", name,
                              "'): master_shard has ", bytes, " bytes but this rank's shard needs ",
                              needed, " (", *elements, " x f32)"));
    // `release` runs only for a registered unit: a RegisterUnit that fails drops the buffer, and
    // the memory then stays the caller's (the header's promise).
    auto registered = std::make_shared<std::atomic<bool>>(false);
    if (master_shard != nullptr) {
      spec.master_shard = shardline::Buffer::Adopt(
          master_shard, bytes, scheduler->master_device, [release, user, registered](void* data) {
            if (release != nullptr && registered->load(std::memory_order_acquire)) {
              release(user, data);
            }
          });
    }
    absl::StatusOr<int> id = scheduler->scheduler->RegisterUnit(std::move(spec));
    if (!id.ok()) return FromStatus(id.status());
    registered->store(true, std::memory_order_release);
    *unit = *id;
    return shardlineSuccess;
  });
}

shardlineResult_t shardline_scheduler_set_post_optimizer_event(shardlineScheduler_t scheduler,
                                                               shardlineEvent_t event) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_REQUIRE(scheduler != nullptr && event != nullptr,
                 "shardline_scheduler_set_post_optimizer_event: NULL argument");
    scheduler->scheduler->SetPostOptimizerEvent(event->event);
    return shardlineSuccess;
  });
}

shardlineResult_t shardline_unit_set_values(shardlineScheduler_t scheduler, int unit,
                                            const void* const* values, int num_tensors) {
  return RunHook(scheduler, unit, "shardline_unit_set_values", [&](shardline::Scheduler& s) {
    if (values == nullptr || num_tensors < 0) {
      return absl::InvalidArgumentError("shardline_unit_set_values: values is NULL");
    }
    return s.unit(unit).SetShardFromTensors(absl::MakeConstSpan(values, num_tensors));
  });
}

shardlineResult_t shardline_pre_forward(shardlineScheduler_t s, int unit) {
  return RunHook(s, unit, "shardline_pre_forward",
                 [&](shardline::Scheduler& x) { return x.PreForward(unit); });
}
shardlineResult_t shardline_post_forward(shardlineScheduler_t s, int unit) {
  return RunHook(s, unit, "shardline_post_forward",
                 [&](shardline::Scheduler& x) { return x.PostForward(unit); });
}
shardlineResult_t shardline_pre_backward(shardlineScheduler_t s, int unit) {
  return RunHook(s, unit, "shardline_pre_backward",
                 [&](shardline::Scheduler& x) { return x.PreBackward(unit); });
}
shardlineResult_t shardline_post_backward(shardlineScheduler_t s, int unit) {
  return RunHook(s, unit, "shardline_post_backward",
                 [&](shardline::Scheduler& x) { return x.PostBackward(unit); });
}
shardlineResult_t shardline_end_forward(shardlineScheduler_t s) {
  SL_C_REQUIRE(s != nullptr, "shardline_end_forward: scheduler is NULL");
  return Guard([&] { return FromStatus(s->scheduler->EndForward()); });
}
shardlineResult_t shardline_finish_backward(shardlineScheduler_t s) {
  SL_C_REQUIRE(s != nullptr, "shardline_finish_backward: scheduler is NULL");
  return Guard([&] { return FromStatus(s->scheduler->FinishBackward()); });
}
shardlineResult_t shardline_zero_grad(shardlineScheduler_t s) {
  SL_C_REQUIRE(s != nullptr, "shardline_zero_grad: scheduler is NULL");
  return Guard([&] { return FromStatus(s->scheduler->ZeroGrad()); });
}

shardlineResult_t shardline_unit_param(shardlineScheduler_t s, int unit, int tensor, void** data,
                                       size_t* numel) {
  return RunHook(s, unit, "shardline_unit_param", [&](shardline::Scheduler& x) -> absl::Status {
    if (data == nullptr || numel == nullptr) {
      return absl::InvalidArgumentError("shardline_unit_param: data and numel must not be NULL");
    }
    absl::StatusOr<shardline::TensorView> v = x.unit(unit).View(tensor);
    if (!v.ok()) return v.status();
    *data = v->data;
    *numel = v->numel;
    return absl::OkStatus();
  });
}

shardlineResult_t shardline_unit_grad(shardlineScheduler_t s, int unit, int tensor, void** data,
                                      size_t* numel) {
  return RunHook(s, unit, "shardline_unit_grad", [&](shardline::Scheduler& x) -> absl::Status {
    if (data == nullptr || numel == nullptr) {
      return absl::InvalidArgumentError("shardline_unit_grad: data and numel must not be NULL");
    }
    absl::StatusOr<shardline::TensorView> v = x.unit(unit).GradView(tensor);
    if (!v.ok()) return v.status();
    *data = v->data;
    *numel = v->numel;
    return absl::OkStatus();
  });
}

shardlineResult_t shardline_unit_master_shard(shardlineScheduler_t s, int unit, void** data,
                                              size_t* elements) {
  return RunHook(s, unit, "shardline_unit_master_shard", [&](shardline::Scheduler& x) {
    if (data == nullptr || elements == nullptr) {
      return absl::InvalidArgumentError("shardline_unit_master_shard: NULL output");
    }
    const shardline::FlatShardView v = x.unit(unit).master_shard();
    *data = v.data;
    *elements = v.elements;
    return absl::OkStatus();
  });
}

shardlineResult_t shardline_unit_shard_grad(shardlineScheduler_t s, int unit, void** data,
                                            size_t* elements) {
  return RunHook(s, unit, "shardline_unit_shard_grad",
                 [&](shardline::Scheduler& x) -> absl::Status {
                   if (data == nullptr || elements == nullptr) {
                     return absl::InvalidArgumentError("shardline_unit_shard_grad: NULL output");
                   }
                   absl::StatusOr<shardline::FlatShardView> v = x.unit(unit).ShardGrad();
                   if (!v.ok()) return v.status();
                   *data = v->data;
                   *elements = v->elements;
                   return absl::OkStatus();
                 });
}

shardlineResult_t shardline_unit_shard_slice(shardlineScheduler_t s, int unit, int tensor,
                                             size_t* first, size_t* count, size_t* tensor_offset) {
  return RunHook(s, unit, "shardline_unit_shard_slice",
                 [&](shardline::Scheduler& x) -> absl::Status {
                   if (first == nullptr || count == nullptr || tensor_offset == nullptr) {
                     return absl::InvalidArgumentError("shardline_unit_shard_slice: NULL output");
                   }
                   const shardline::FlatLayout& layout = x.unit(unit).layout();
                   if (tensor < 0 || tensor >= layout.num_tensors()) {
                     return absl::InvalidArgumentError(
                         absl::StrCat("shardline_unit_shard_slice: no tensor ", tensor));
                   }
                   std::optional<shardline::ShardSlice> slice =
                       layout.Intersection(tensor, x.unit(unit).shard_rank());
                   *first = slice ? slice->shard_offset : 0;
                   *count = slice ? slice->length : 0;
                   *tensor_offset = slice ? slice->tensor_offset : 0;
                   return absl::OkStatus();
                 });
}

shardlineResult_t shardline_scheduler_metrics(shardlineScheduler_t s, double timeout_s,
                                              shardlineStepMetrics_t* metrics) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_REQUIRE(s != nullptr && metrics != nullptr, "shardline_scheduler_metrics: NULL argument");
    SL_C_REQUIRE(metrics->struct_size >= offsetof(shardlineStepMetrics_t, step) &&
                     metrics->struct_size <= sizeof(shardlineStepMetrics_t),
                 absl::StrCat("shardlineStepMetrics_t.struct_size is ", metrics->struct_size,
                              " (initialise it with SHARDLINE_STEP_METRICS_INIT)"));
    absl::StatusOr<shardline::StepMetrics> m =
        s->scheduler->LastStepMetrics(absl::Now() + Timeout(timeout_s));
    if (!m.ok()) return FromStatus(m.status());
    shardlineStepMetrics_t out = SHARDLINE_STEP_METRICS_INIT;
    out.step = m->step;
    out.bytes_gathered = m->bytes_gathered;
    out.bytes_reduced = m->bytes_reduced;
    out.budget_bytes = m->budget_bytes;
    out.peak_inflight_bytes = m->peak_inflight_bytes;
    out.peak_inflight_units = m->peak_inflight_units;
    out.budget_overshoots = m->budget_overshoots;
    out.deferred_prefetches = m->deferred_prefetches;
    out.order_deviations = m->order_deviations;
    out.step_time_s = Seconds(m->step_time);
    out.exposed_communication_s = Seconds(m->exposed_communication);
    out.overlap_fraction = m->overlap_fraction.value_or(-1.0);
    out.host_hook_time_s = absl::ToDoubleSeconds(m->host_hook_time);
    // Only as many bytes as the caller's struct has.
    const size_t size = metrics->struct_size;
    std::memcpy(static_cast<void*>(metrics), &out, size);
    metrics->struct_size = size;
    return shardlineSuccess;
  });
}

}  // extern "C"
