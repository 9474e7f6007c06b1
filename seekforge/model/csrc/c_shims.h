// The kernels' C entry points for code torch.compile generates with cpp_wrapper (kernels.c_shims, which declares
// them from the ops' schemas): inductor calls an op listed in its `aot_inductor.custom_ops_to_c_shims` as
// aoti_torch_cpu_<name>(handles..., &out) instead of through the dispatcher by name (aoti_torch_call_dispatcher:
// a schema lookup, boxing the arguments and a new handle for each, on every call; a decode step of `small` makes
// ~35 such calls). The arguments are the op's schema in order: a Tensor as an AtenTensorHandle, a Tensor? as a
// pointer to one (null: None), a float as a double, an int as an int64_t; the result is a new handle in *ret0.
#pragma once
#include <torch/csrc/inductor/aoti_torch/utils.h>

namespace seekforge_shims {

inline const at::Tensor& tensor(AtenTensorHandle handle) {
  return *torch::aot_inductor::tensor_handle_to_tensor_pointer(handle);
}

inline c10::optional<at::Tensor> optional_tensor(AtenTensorHandle* handle) {
  return handle == nullptr ? c10::nullopt : c10::optional<at::Tensor>(tensor(*handle));
}

// run `op` (→ at::Tensor) into *ret0; an exception becomes the error code inductor's caller checks
template <typename Op>
AOTITorchError returning(AtenTensorHandle* ret0, Op&& op) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({ *ret0 = torch::aot_inductor::new_tensor_handle(op()); });
}

}  // namespace seekforge_shims
