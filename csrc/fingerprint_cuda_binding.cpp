// Torch binding of the CUDA fingerprint kernel (built only with a CUDA torch).
// Only c10/cuda headers: ATen/cuda/CUDAContext.h would pull in cuBLAS and
// cuSPARSE headers, which a minimal CUDA toolkit does not ship.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

extern "C" int rt_fingerprint_cuda_launch(const void* data, int64_t nbytes, uint64_t word_offset,
                                          unsigned int* out, int num_sms, cudaStream_t stream);

namespace {

at::Tensor fingerprint_lanes_cuda(const at::Tensor& data, int64_t word_offset) {
  TORCH_CHECK(data.is_cuda(), "fingerprint_lanes_cuda: data must be a CUDA tensor");
  TORCH_CHECK(data.scalar_type() == at::kByte && data.dim() == 1 && data.is_contiguous(),
              "fingerprint_lanes: data must be a contiguous 1-D uint8 tensor, got ",
              data.scalar_type(), " with shape ", data.sizes());
  TORCH_CHECK(word_offset >= 0, "fingerprint_lanes: word_offset must be >= 0, got ", word_offset);
  TORCH_CHECK(reinterpret_cast<uintptr_t>(data.const_data_ptr()) % 4 == 0,
              "fingerprint_lanes: CUDA data must be 4-byte aligned (copy it first)");
  c10::cuda::CUDAGuard guard(data.device());
  at::Tensor acc = at::zeros({2}, data.options().dtype(at::kInt));
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, data.get_device());
  const int err = rt_fingerprint_cuda_launch(
      data.const_data_ptr(), data.numel(), (uint64_t)word_offset,
      reinterpret_cast<unsigned int*>(acc.data_ptr<int32_t>()), sms,
      c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == 0, "fingerprint_lanes: CUDA launch failed with error ", err);
  // int32 bits -> unsigned value in an int64, as the CPU kernel returns.
  return acc.to(at::kLong).bitwise_and_(0xFFFFFFFFll);
}

}  // namespace

TORCH_LIBRARY_IMPL(resident_trainer, CUDA, m) {
  m.impl("fingerprint_lanes", &fingerprint_lanes_cuda);
}
