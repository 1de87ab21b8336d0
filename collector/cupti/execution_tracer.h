// The cuda backend's tracer as the interpreter sees it (executor/tracer.h): an adapter over the
// CUPTI collector. Each instruction's issue is bracketed by the collector's external correlation
// (PushInstruction / PopInstruction), so the kernels, copies and collectives CUPTI records map to
// their instruction; CUPTI records the device's allocations itself, so the interpreter's memory
// events are not repeated. Kept apart from dc_cupti, which stays free of protobuf for
// libdc_inject.so.
#pragma once

#include <functional>

#include "collector/cupti/cupti_collector.h"
#include "executor/tracer.h"

namespace dc {

// CuptiCollectorOptions::stream_blobs for a run of `schedule` (which must outlive the
// collector): the plan's TC_BLOB rows, as the cpu backend's streamed rank file carries them.
std::function<Status(collector_internal::Database*)> StreamScheduleBlobs(
    const proto::Schedule& schedule);

class CuptiExecutionTracer : public ExecutionTracer {
 public:
  explicit CuptiExecutionTracer(CuptiCollector* collector) : collector_(collector) {}

  int64_t NowNs() const override { return collector_->NowNs(); }
  void DescribeInstruction(int index, const TracedInstruction& instruction) override;
  Status BeginInstruction(const InstructionRef& ref) override {
    return collector_->PushInstruction(ref.step, ref.instruction);
  }
  StatusOr<int64_t> EndInstruction(const InstructionRef& /*ref*/, int64_t /*start_ns*/,
                                   int64_t /*end_ns*/) override {
    DC_RETURN_IF_ERROR(collector_->PopInstruction());
    return int64_t{0};
  }
  void Memory(int64_t /*ts_ns*/, int64_t /*address*/, int64_t /*bytes*/, bool /*alloc*/,
              const std::string& /*name*/, BufferKind /*kind*/,
              int64_t /*correlation_id*/) override {}
  void Step(int step, int64_t start_ns, int64_t end_ns, double loss, bool warmup) override {
    collector_->Step(step, start_ns, end_ns, loss, warmup);
  }
  void Evaluation(int64_t step, int64_t start_ns, int64_t end_ns, double loss) override {
    collector_->Evaluation(step, start_ns, end_ns, loss);
  }

 private:
  CuptiCollector* collector_;
};

}  // namespace dc
