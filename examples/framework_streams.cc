// A framework's own streams, events and memory, driven through shardline.
//
// A "framework" here is what an embedding training framework brings: an executor thread with a
// queue (its compute stream), its own events (a counter of finished work), and its own parameter
// and gradient memory. It exposes them through a small table of C callbacks — the shape the C API
// will let any framework provide — and this example adapts that table to shardline's Stream and
// Event interfaces (`CallbackStream`, `CallbackEvent`). Memory is adopted (`Buffer::View`) as the
// units' master shards.
//
// Two ranks (threads, local backend) then run one FSDP step on a 3-unit model: gather each unit
// on shardline's gather stream, compute on the framework's stream (which waits for the gather
// through a shardline host event), write the gradient on the framework's stream, reduce-scatter
// on shardline's reduce stream (which waits for the framework's event through
// Event::OnComplete), accumulate, and check the sharded gradients against a plain loop. Exit 0
// and "framework_streams: OK" when every element matches.

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "collectives/local/local_communicator.h"
#include "runtime/allocator.h"
#include "runtime/caching_pool.h"
#include "runtime/flat_layout.h"
#include "runtime/status.h"
#include "runtime/stream.h"
#include "scheduler/flat_parameter.h"

namespace {

// ---- The framework (knows nothing of shardline) ------------------------------------------------

// An executor thread with a FIFO. Its events are "the number of tasks submitted so far": done
// once that many tasks have finished.
class Executor {
 public:
  Executor() : thread_([this] { Loop(); }) {}
  ~Executor() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  void Submit(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(task));
      ++submitted_;
    }
    cv_.notify_all();
  }
  uint64_t Mark() {
    std::lock_guard<std::mutex> lock(mu_);
    return submitted_;
  }
  bool Done(uint64_t mark) {
    std::lock_guard<std::mutex> lock(mu_);
    return finished_ >= mark;
  }
  // Calls `fn` once `mark` tasks have finished (at once if they have).
  void WhenDone(uint64_t mark, std::function<void()> fn) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (finished_ < mark) {
        watchers_.push_back({mark, std::move(fn)});
        return;
      }
    }
    fn();
  }

 private:
  void Loop() {
    while (true) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      task();
      std::vector<std::function<void()>> ready;
      {
        std::lock_guard<std::mutex> lock(mu_);
        ++finished_;
        for (auto it = watchers_.begin(); it != watchers_.end();) {
          if (it->first <= finished_) {
            ready.push_back(std::move(it->second));
            it = watchers_.erase(it);
          } else {
            ++it;
          }
        }
      }
      for (auto& fn : ready) fn();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  std::vector<std::pair<uint64_t, std::function<void()>>> watchers_;
  uint64_t submitted_ = 0;
  uint64_t finished_ = 0;
  bool stop_ = false;
  std::thread thread_;
};

// The framework's callback table (C types only: what a C API would pass).
struct FrameworkStreamApi {
  void* ctx;
  void (*submit)(void* ctx, void (*fn)(void* arg), void* arg);
  uint64_t (*record)(void* ctx);
  int (*query)(void* ctx, uint64_t event);
  void (*on_complete)(void* ctx, uint64_t event, void (*fn)(void* arg), void* arg);
};

FrameworkStreamApi ExecutorApi(Executor& executor) {
  return FrameworkStreamApi{
      &executor,
      [](void* ctx, void (*fn)(void*), void* arg) {
        static_cast<Executor*>(ctx)->Submit([fn, arg] { fn(arg); });
      },
      [](void* ctx) { return static_cast<Executor*>(ctx)->Mark(); },
      [](void* ctx, uint64_t event) { return static_cast<Executor*>(ctx)->Done(event) ? 1 : 0; },
      [](void* ctx, uint64_t event, void (*fn)(void*), void* arg) {
        static_cast<Executor*>(ctx)->WhenDone(event, [fn, arg] { fn(arg); });
      }};
}

}  // namespace

namespace shardline {
namespace {

// ---- The adapter: shardline's Stream and Event over the callback table ------------------------

class CallbackEvent final : public Event {
 public:
  explicit CallbackEvent(FrameworkStreamApi api, uint64_t stream_id)
      : api_(api), stream_id_(stream_id) {}

  Device device() const override { return Device::Host(); }
  absl::Status Record(Stream& stream) override;
  absl::StatusOr<bool> Query() override {
    const std::optional<uint64_t> mark = Mark();
    return !mark.has_value() || api_.query(api_.ctx, *mark) != 0;
  }
  absl::Status Synchronize(absl::Time deadline) override {
    auto done = std::make_shared<std::pair<std::mutex, std::condition_variable>>();
    auto flag = std::make_shared<bool>(false);
    OnComplete([done, flag](absl::Status) {
      std::lock_guard<std::mutex> lock(done->first);
      *flag = true;
      done->second.notify_all();
    });
    std::unique_lock<std::mutex> lock(done->first);
    if (!done->second.wait_until(lock, absl::ToChronoTime(deadline), [&] { return *flag; })) {
      return absl::DeadlineExceededError("framework event: not done by the deadline");
    }
    return absl::OkStatus();
  }
  void OnComplete(EventCallback callback) override {
    const std::optional<uint64_t> mark = Mark();
    if (!mark.has_value()) return std::move(callback)(absl::OkStatus());
    auto* boxed = new EventCallback(std::move(callback));
    api_.on_complete(
        api_.ctx, *mark,
        [](void* arg) {
          std::unique_ptr<EventCallback> fn(static_cast<EventCallback*>(arg));
          std::move (*fn)(absl::OkStatus());
        },
        boxed);
  }
  uint64_t recorded_stream_id() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return mark_.has_value() ? stream_id_ : 0;
  }

  std::optional<uint64_t> Mark() const {
    std::lock_guard<std::mutex> lock(mu_);
    return mark_;
  }

 private:
  const FrameworkStreamApi api_;
  const uint64_t stream_id_;
  mutable std::mutex mu_;
  std::optional<uint64_t> mark_;
  friend class CallbackStream;
};

// Ops run on the framework's executor; an op that fails poisons the adapter (later ops are
// cancelled); waits on the framework's own events are free (FIFO), waits on other events block
// the executor's thread, bounded.
class CallbackStream final : public Stream {
 public:
  CallbackStream(FrameworkStreamApi api, std::string name) : api_(api), name_(std::move(name)) {}

  Device device() const override { return Device::Host(); }
  const std::string& name() const override { return name_; }

  absl::Status Submit(StreamOp op) override {
    SL_RETURN_IF_ERROR(status());
    struct Task {
      CallbackStream* stream;
      StreamOp op;
    };
    auto* task = new Task{this, std::move(op)};
    api_.submit(
        api_.ctx,
        [](void* arg) {
          std::unique_ptr<Task> t(static_cast<Task*>(arg));
          const absl::Status poison = t->stream->status();
          if (!poison.ok()) {
            if (t->op.cancel != nullptr) std::move(t->op.cancel)(poison);
            return;
          }
          absl::Status result = std::move(t->op.run)();
          if (!result.ok()) t->stream->Poison(std::move(result));
        },
        task);
    return absl::OkStatus();
  }

  absl::Status WaitEvent(Event& event) override {
    if (event.recorded_stream_id() == id()) return status();  // FIFO covers it
    // Another kind of event: a framework task that blocks (bounded) until the event's completion
    // callback, registered now, has fired.
    struct Signal {
      std::mutex mu;
      std::condition_variable cv;
      bool done = false;
      absl::Status status;
    };
    auto signal = std::make_shared<Signal>();
    event.OnComplete([signal](absl::Status status) {
      std::lock_guard<std::mutex> lock(signal->mu);
      signal->done = true;
      signal->status = std::move(status);
      signal->cv.notify_all();
    });
    return Enqueue([signal]() -> absl::Status {
      std::unique_lock<std::mutex> lock(signal->mu);
      if (!signal->cv.wait_for(lock, std::chrono::seconds(60), [&] { return signal->done; })) {
        return absl::DeadlineExceededError("framework stream: waiting for an event timed out");
      }
      return signal->status;
    });
  }

  absl::Status Synchronize(absl::Time deadline) override {
    CallbackEvent event(api_, id());
    SL_RETURN_IF_ERROR(event.Record(*this));
    SL_RETURN_IF_ERROR(event.Synchronize(deadline));
    return status();
  }
  absl::Status status() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return status_;
  }
  std::shared_ptr<Event> CreateEvent() override {
    return std::make_shared<CallbackEvent>(api_, id());
  }

  FrameworkStreamApi api() const { return api_; }

 private:
  void Poison(absl::Status status) {
    std::lock_guard<std::mutex> lock(mu_);
    if (status_.ok()) status_ = std::move(status);
  }

  const FrameworkStreamApi api_;
  const std::string name_;
  mutable std::mutex mu_;
  absl::Status status_;
};

absl::Status CallbackEvent::Record(Stream& stream) {
  auto* callback_stream = dynamic_cast<CallbackStream*>(&stream);
  if (callback_stream == nullptr || callback_stream->api().ctx != api_.ctx) {
    return absl::InvalidArgumentError(
        absl::StrCat("a framework event cannot be recorded on stream '", stream.name(), "'"));
  }
  std::lock_guard<std::mutex> lock(mu_);
  mark_ = api_.record(api_.ctx);
  return absl::OkStatus();
}

// ---- One FSDP step over the framework's streams and memory ------------------------------------

constexpr int kRanks = 2;
constexpr int kUnits = 3;

float Weight(int unit, size_t i) {
  return static_cast<float>(std::sin(0.37 * static_cast<double>(i) + unit));
}
float Input(int rank, size_t i) {
  return static_cast<float>(std::cos(0.11 * static_cast<double>(i) * (rank + 1)));
}

absl::Status RunRank(int rank, Communicator& comm, const std::vector<FlatLayout>& layouts,
                     std::vector<std::vector<float>>& grads_out) {
  Executor executor;  // the framework's compute stream
  CallbackStream compute(ExecutorApi(executor), absl::StrCat("framework.compute", rank));
  SL_ASSIGN_OR_RETURN(std::unique_ptr<Stream> gather, CreateHostStream({.name = "gather"}));
  SL_ASSIGN_OR_RETURN(std::unique_ptr<Stream> reduce, CreateHostStream({.name = "reduce"}));
  std::unique_ptr<Allocator> host = CreateHostAllocator();
  CachingPool pool(*host);
  const MixedPrecisionPolicy policy{DType::kF32, DType::kF32, DType::kF32, false};

  // The framework's own parameter memory: this rank's shard of each unit.
  std::vector<std::vector<float>> params(kUnits);
  std::vector<std::unique_ptr<FlatParameter>> units;
  for (int u = 0; u < kUnits; ++u) {
    const FlatLayout& layout = layouts[u];
    params[u].resize(layout.shard_elements());
    const size_t begin = layout.ShardBegin(rank);
    for (size_t i = 0; i < params[u].size(); ++i) params[u][i] = Weight(u, begin + i);
    SL_ASSIGN_OR_RETURN(
        std::unique_ptr<FlatParameter> unit,
        FlatParameter::Create(
            layout, rank, policy,
            {.unsharded_pool = &pool,
             .name = absl::StrCat("unit", u),
             .master_shard = Buffer::View(params[u].data(), params[u].size() * sizeof(float),
                                          Device::Host())}));
    units.push_back(std::move(unit));
  }
  // Forward and backward of a toy layer per unit: grad[i] = weight[i] * input[i] (the
  // derivative of 0.5 * sum(w^2 * x)), written by the framework's compute stream.
  std::vector<std::shared_ptr<Event>> reduced(kUnits);
  for (int u = kUnits - 1; u >= 0; --u) {
    FlatParameter& unit = *units[u];
    SL_RETURN_IF_ERROR(unit.Gather(comm, *gather).status());
    SL_RETURN_IF_ERROR(unit.WaitGathered(compute));
    SL_RETURN_IF_ERROR(unit.PrepareGrad(compute));
    SL_ASSIGN_OR_RETURN(TensorView w, unit.View(0));
    SL_ASSIGN_OR_RETURN(TensorView g, unit.GradView(0));
    const size_t n = w.numel;
    SL_RETURN_IF_ERROR(compute.Enqueue([w, g, n, rank]() {
      const float* weight = static_cast<const float*>(w.data);
      float* grad = static_cast<float*>(g.data);
      for (size_t i = 0; i < n; ++i) grad[i] += weight[i] * Input(rank, i);
      return absl::OkStatus();
    }));
    SL_ASSIGN_OR_RETURN(std::shared_ptr<Event> ready, RecordEvent(compute));
    SL_RETURN_IF_ERROR(unit.ReduceScatter(comm, *reduce, ready, {.op = ReduceOp::kSum}).status());
    SL_ASSIGN_OR_RETURN(reduced[u], unit.Accumulate(*reduce));
  }
  for (int u = 0; u < kUnits; ++u) {
    SL_RETURN_IF_ERROR(units[u]->WaitReduced(absl::Now() + absl::Seconds(60)));
    SL_ASSIGN_OR_RETURN(FlatShardView grad, units[u]->ShardGrad());
    const float* data = static_cast<const float*>(grad.data);
    grads_out[u].assign(data, data + grad.elements);
  }
  return compute.Synchronize(absl::Now() + absl::Seconds(60));
}

int Main() {
  std::vector<FlatLayout> layouts;
  for (int u = 0; u < kUnits; ++u) {
    const std::vector<TensorSpec> specs = {
        {.name = "w", .shape = {static_cast<int64_t>(1000 + 37 * u)}, .dtype = DType::kF32}};
    absl::StatusOr<FlatLayout> layout = FlatLayout::Create(specs, {.num_shards = kRanks});
    if (!layout.ok()) {
      std::fprintf(stderr, "layout: %s\n", layout.status().ToString().c_str());
      return 1;
    }
    layouts.push_back(*std::move(layout));
  }
  absl::StatusOr<std::vector<std::shared_ptr<Communicator>>> comms =
      CreateLocalCommunicators(kRanks, {.timeout = absl::Seconds(60)});
  if (!comms.ok()) return 1;
  std::vector<std::vector<std::vector<float>>> grads(kRanks,
                                                     std::vector<std::vector<float>>(kUnits));
  std::vector<absl::Status> results(kRanks);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] { results[r] = RunRank(r, *(*comms)[r], layouts, grads[r]); });
  }
  for (std::thread& t : threads) t.join();
  size_t checked = 0;
  for (int r = 0; r < kRanks; ++r) {
    if (!results[r].ok()) {
      std::fprintf(stderr, "rank %d: %s\n", r, results[r].ToString().c_str());
      return 1;
    }
    for (int u = 0; u < kUnits; ++u) {
      const size_t begin = layouts[u].ShardBegin(r);
      const size_t numel = layouts[u].tensor(0).numel;
      for (size_t i = 0; i < grads[r][u].size(); ++i) {
        const size_t flat = begin + i;
        double want = 0;
        if (flat < numel) {
          for (int s = 0; s < kRanks; ++s) want += double{Weight(u, flat)} * Input(s, flat);
        }
        if (std::abs(grads[r][u][i] - want) > 1e-5) {
          std::fprintf(stderr, "rank %d unit %d element %zu: %g, want %g\n", r, u, i,
                       grads[r][u][i], want);
          return 1;
        }
        ++checked;
      }
    }
  }
  std::printf(
      "framework_streams: OK (%zu gradient elements checked; gathers and reductions on "
      "shardline's streams, compute on the framework's, memory the framework's)\n",
      checked);
  return 0;
}

}  // namespace
}  // namespace shardline

int main() { return shardline::Main(); }
