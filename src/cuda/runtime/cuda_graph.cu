// CUDA graphs of the backend's stream (cuda_graph.hpp).
#include "cuda/runtime/cuda_graph.hpp"

#include <memory>
#include <string>

#include "cuda/runtime/caching_allocator.hpp"
#include "cuda/runtime/cuda_check.hpp"
#include "cuda/runtime/cuda_stream.hpp"
#include "cuda/runtime/device_checks.hpp"

namespace fp8moe::cuda {

namespace {

class CudaGraph final : public Graph::Impl {
 public:
  CudaGraph(cudaGraphExec_t exec, std::shared_ptr<const DeferredChecks> checks) : exec_(exec), checks_(std::move(checks)) {}
  ~CudaGraph() override { (void)cudaGraphExecDestroy(exec_); }
  void replay(const Stream& s) override {
    FP8MOE_CUDA_CHECK(cudaGraphLaunch(exec_, native(s)));
    // The replay writes the recorded checks' slots and flags again: their records return, to be
    // raised at the next synchronize.
    put_deferred_checks(*checks_);
  }

 private:
  cudaGraphExec_t exec_;
  std::shared_ptr<const DeferredChecks> checks_;
};

}  // namespace

void begin_capture(cudaStream_t stream) {
  if (checks_deferred()) raise_deferred_checks();
  begin_graph_pool(stream);
  const cudaError_t e = cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed);
  if (e != cudaSuccess) {
    end_graph_pool();
    FP8MOE_CUDA_CHECK(e);
  }
}

Graph end_capture(cudaStream_t stream) {
  cudaGraph_t graph = nullptr;
  const cudaError_t e = cudaStreamEndCapture(stream, &graph);
  end_graph_pool();
  std::shared_ptr<const DeferredChecks> checks = take_deferred_checks();
  if (e != cudaSuccess || !graph) {
    (void)cudaGetLastError();
    if (graph) (void)cudaGraphDestroy(graph);
    FP8MOE_CHECK(false, "graph capture failed (" << cudaGetErrorString(e)
                                                 << "): an op waited on the host or used the legacy stream while recording");
  }
  cudaGraphExec_t exec = nullptr;
  const cudaError_t ei = cudaGraphInstantiate(&exec, graph, 0);
  (void)cudaGraphDestroy(graph);
  FP8MOE_CUDA_CHECK(ei);
  return Graph(std::make_shared<CudaGraph>(exec, std::move(checks)));
}

}  // namespace fp8moe::cuda
