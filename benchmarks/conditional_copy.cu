// Probe for benchmarks/conditional_copy.py (built there with nvcc; not part of the runtime): adds, inside an active
// stream capture, one kernel node that sets n IF-node conditions from a device bool array, and n conditional (IF)
// nodes after it, each holding one H2D memcpy node (src: pinned, mapped host memory). The capture then continues
// after all n. Every CUDA return code is checked and returned (0 = success).
#include <cuda_runtime.h>
#include <vector>

#define MAXN 512
struct Handles { cudaGraphConditionalHandle h[MAXN]; };

__global__ void set_conditions(Handles hs, const bool* pred, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) cudaGraphSetConditional(hs.h[i], pred[i] ? 1u : 0u);
}

#define CHECK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) return (int)e_; } while (0)

extern "C" int add_if_copies(void* stream_v, const bool* pred, const unsigned long long* dst,
                             const unsigned long long* src, size_t bytes, int n) {
  if (n <= 0 || n > MAXN) return -1;
  cudaStream_t s = (cudaStream_t)stream_v;
  cudaStreamCaptureStatus st;
  cudaGraph_t g;
  const cudaGraphNode_t* deps = nullptr;
  size_t nd = 0;
#if CUDART_VERSION >= 13000
  CHECK(cudaStreamGetCaptureInfo(s, &st, nullptr, &g, &deps, nullptr, &nd));
#else
  CHECK(cudaStreamGetCaptureInfo_v3(s, &st, nullptr, &g, &deps, nullptr, &nd));
#endif
  if (st != cudaStreamCaptureStatusActive) return -2;
  Handles hs;
  for (int i = 0; i < n; ++i) CHECK(cudaGraphConditionalHandleCreate(&hs.h[i], g, 0, 0));
  set_conditions<<<(n + 127) / 128, 128, 0, s>>>(hs, pred, n);
  CHECK(cudaGetLastError());
#if CUDART_VERSION >= 13000
  CHECK(cudaStreamGetCaptureInfo(s, &st, nullptr, &g, &deps, nullptr, &nd));
#else
  CHECK(cudaStreamGetCaptureInfo_v3(s, &st, nullptr, &g, &deps, nullptr, &nd));
#endif
  std::vector<cudaGraphNode_t> kdeps(deps, deps + nd);
  std::vector<cudaGraphNode_t> conds(n);
  for (int i = 0; i < n; ++i) {
    cudaGraphNodeParams p = {};
    p.type = cudaGraphNodeTypeConditional;
    p.conditional.handle = hs.h[i];
    p.conditional.type = cudaGraphCondTypeIf;
    p.conditional.size = 1;
#if CUDART_VERSION >= 13000
    CHECK(cudaGraphAddNode(&conds[i], g, kdeps.data(), nullptr, kdeps.size(), &p));
#else
    CHECK(cudaGraphAddNode_v2(&conds[i], g, kdeps.data(), nullptr, kdeps.size(), &p));
#endif
    cudaGraph_t body = p.conditional.phGraph_out[0];
    cudaGraphNode_t m;
    CHECK(cudaGraphAddMemcpyNode1D(&m, body, nullptr, 0, (void*)dst[i], (const void*)src[i], bytes,
                                   cudaMemcpyDefault));
  }
#if CUDART_VERSION >= 13000
  CHECK(cudaStreamUpdateCaptureDependencies(s, conds.data(), nullptr, n, cudaStreamSetCaptureDependencies));
#else
  CHECK(cudaStreamUpdateCaptureDependencies_v2(s, conds.data(), nullptr, n, cudaStreamSetCaptureDependencies));
#endif
  return 0;
}
