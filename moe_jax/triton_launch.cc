// moe_triton_launch (XLA FFI, CUDA): launches one Triton kernel, compiled to a cubin by triton.compile (the binary
// moe_torch's launches run), on XLA's stream. The kernels are registered once from Python
// (moe_triton_register: name, cubin, warps, shared memory -> a small integer id); a call carries the id, the grid
// and its parameter list as attributes, so nothing is parsed or hashed per launch. Each kernel's module is loaded
// into a device's context at its first launch there (the context XLA has current, else the stream's), with the
// dynamic shared memory limit raised as triton's own launcher does. A call launches the same work for the same
// attributes (the memsets it asks for and one kernel), so XLA may trace it into a command buffer (a CUDA graph);
// the module load alone steps out of the capture's rules. The CUDA driver is opened with dlopen and its entry
// points taken from cuGetProcAddress: no CUDA toolkit is needed to build this file (cuda.h is triton's copy).
#include <dlfcn.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "cuda.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxDevices = 64;
constexpr int64_t kMaxKernels = 1 << 16;
constexpr size_t kMaxParameters = 128;
constexpr int kDriverVersion = 12000;  // the entry points as CUDA 12.0 defined them
constexpr int kSharedWithoutOptIn = 49152;

// How a call's `parameters` attribute describes each kernel parameter: pairs (kind, value).
enum ParameterKind : int64_t {
  kArgument = 0,      // the device pointer of operand `value`
  kResult = 1,        // the device pointer of result `value`
  kZeroedResult = 2,  // the same, the result's bytes set to zero first
  kInt32 = 3,         // `value` as a 32-bit integer
  kInt64 = 4,         // `value` as a 64-bit integer
  kNullPointer = 5,   // a null pointer (a scratch slot the kernel does not use)
};

struct Driver {
  CUresult (*get_error_name)(CUresult, const char**) = nullptr;
  CUresult (*stream_get_ctx)(CUstream, CUcontext*) = nullptr;
  CUresult (*ctx_get_current)(CUcontext*) = nullptr;
  CUresult (*ctx_push_current)(CUcontext) = nullptr;
  CUresult (*ctx_pop_current)(CUcontext*) = nullptr;
  CUresult (*ctx_get_device)(CUdevice*) = nullptr;
  CUresult (*device_get_attribute)(int*, CUdevice_attribute, CUdevice) = nullptr;
  CUresult (*module_load_data)(CUmodule*, const void*) = nullptr;
  CUresult (*module_get_function)(CUfunction*, CUmodule, const char*) = nullptr;
  CUresult (*func_get_attribute)(int*, CUfunction_attribute, CUfunction) = nullptr;
  CUresult (*func_set_attribute)(CUfunction, CUfunction_attribute, int) = nullptr;
  CUresult (*func_set_cache_config)(CUfunction, CUfunc_cache) = nullptr;
  CUresult (*memset_d8_async)(CUdeviceptr, unsigned char, size_t, CUstream) = nullptr;
  CUresult (*exchange_capture_mode)(CUstreamCaptureMode*) = nullptr;
  CUresult (*stream_is_capturing)(CUstream, CUstreamCaptureStatus*) = nullptr;
  CUresult (*launch_kernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                            void**, void**) = nullptr;
  std::string error;  // why the driver cannot be used (empty: it can)
};

// Where each entry point is stored, by its name in the driver.
template <typename Function>
std::pair<const char*, void**> Entry(const char* symbol, Function* slot) {
  return {symbol, reinterpret_cast<void**>(slot)};
}

const Driver& OpenDriver() {
  static const Driver driver = [] {
    Driver d;
    void* library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (library == nullptr) {
      const char* why = dlerror();
      d.error = std::string("cannot open libcuda.so.1: ") + (why ? why : "unknown reason");
      return d;
    }
    auto get_proc_address = reinterpret_cast<CUresult (*)(const char*, void**, int, cuuint64_t,
                                                          CUdriverProcAddressQueryResult*)>(
        dlsym(library, "cuGetProcAddress_v2"));
    if (get_proc_address == nullptr) {
      d.error = "libcuda.so.1 has no cuGetProcAddress_v2 (a CUDA 12 driver or newer is needed)";
      return d;
    }
    const std::pair<const char*, void**> entries[] = {
        Entry("cuGetErrorName", &d.get_error_name),
        Entry("cuStreamGetCtx", &d.stream_get_ctx),
        Entry("cuCtxGetCurrent", &d.ctx_get_current),
        Entry("cuCtxPushCurrent", &d.ctx_push_current),
        Entry("cuCtxPopCurrent", &d.ctx_pop_current),
        Entry("cuCtxGetDevice", &d.ctx_get_device),
        Entry("cuDeviceGetAttribute", &d.device_get_attribute),
        Entry("cuModuleLoadData", &d.module_load_data),
        Entry("cuModuleGetFunction", &d.module_get_function),
        Entry("cuFuncGetAttribute", &d.func_get_attribute),
        Entry("cuFuncSetAttribute", &d.func_set_attribute),
        Entry("cuFuncSetCacheConfig", &d.func_set_cache_config),
        Entry("cuMemsetD8Async", &d.memset_d8_async),
        Entry("cuThreadExchangeStreamCaptureMode", &d.exchange_capture_mode),
        Entry("cuStreamIsCapturing", &d.stream_is_capturing),
        Entry("cuLaunchKernel", &d.launch_kernel),
    };
    for (const auto& [symbol, slot] : entries) {
      CUdriverProcAddressQueryResult status;
      if (get_proc_address(symbol, slot, kDriverVersion, CU_GET_PROC_ADDRESS_DEFAULT, &status) != CUDA_SUCCESS ||
          *slot == nullptr) {
        d.error = std::string("the CUDA driver has no ") + symbol;
        return d;
      }
    }
    return d;
  }();
  return driver;
}

struct Kernel {
  std::string name;
  std::string cubin;
  unsigned threads = 0;
  unsigned shared = 0;
  std::atomic<CUfunction> functions[kMaxDevices] = {};
};

std::atomic<Kernel*> kernels[kMaxKernels] = {};
std::atomic<int64_t> kernel_count{0};
std::atomic<int64_t> captured_launches{0};  // launches recorded into a CUDA graph (XLA's command buffers)
std::mutex registry_mutex;  // registrations and module loads

std::string Describe(const Driver& driver, CUresult result, const char* what, const Kernel& kernel) {
  const char* name = nullptr;
  if (driver.get_error_name == nullptr || driver.get_error_name(result, &name) != CUDA_SUCCESS) name = nullptr;
  return std::string(what) + " failed for Triton kernel " + kernel.name + ": " +
         (name ? name : "CUDA error " + std::to_string(static_cast<int>(result)));
}

// The kernel's function on device `device`, its module loaded into the device's context at the first call there.
CUfunction Function(const Driver& driver, Kernel& kernel, int32_t device, CUstream stream, std::string* error) {
  CUfunction function = kernel.functions[device].load(std::memory_order_acquire);
  if (function != nullptr) return function;
  std::lock_guard<std::mutex> lock(registry_mutex);
  function = kernel.functions[device].load(std::memory_order_acquire);
  if (function != nullptr) return function;
  auto fail = [&](const char* what, CUresult result) -> CUfunction {
    *error = Describe(driver, result, what, kernel);
    return nullptr;
  };
  // XLA runs a call with its device's context current (cuStreamGetCtx is not usable under stream capture)
  CUcontext context = nullptr;
  CUresult result = driver.ctx_get_current(&context);
  if (result != CUDA_SUCCESS) return fail("cuCtxGetCurrent", result);
  if (context == nullptr && (result = driver.stream_get_ctx(stream, &context)) != CUDA_SUCCESS)
    return fail("cuStreamGetCtx", result);
  if ((result = driver.ctx_push_current(context)) != CUDA_SUCCESS) return fail("cuCtxPushCurrent", result);
  struct PopOnExit {
    const Driver& driver;
    ~PopOnExit() {
      CUcontext popped;
      driver.ctx_pop_current(&popped);
    }
  } pop_on_exit{driver};
  // XLA may trace this call into a command buffer (a CUDA graph), its thread capturing in thread-local mode, which
  // forbids loading a module: relaxed mode for the load, the thread's own mode back after it.
  CUstreamCaptureMode capture_mode = CU_STREAM_CAPTURE_MODE_RELAXED;
  if ((result = driver.exchange_capture_mode(&capture_mode)) != CUDA_SUCCESS)
    return fail("cuThreadExchangeStreamCaptureMode", result);
  struct RestoreCaptureMode {
    const Driver& driver;
    CUstreamCaptureMode mode;
    ~RestoreCaptureMode() { driver.exchange_capture_mode(&mode); }
  } restore_capture_mode{driver, capture_mode};
  CUmodule module = nullptr;
  if ((result = driver.module_load_data(&module, kernel.cubin.data())) != CUDA_SUCCESS)
    return fail("cuModuleLoadData", result);
  if ((result = driver.module_get_function(&function, module, kernel.name.c_str())) != CUDA_SUCCESS)
    return fail("cuModuleGetFunction", result);
  CUdevice cu_device = 0;
  int shared_opt_in = 0, shared_static = 0;
  if ((result = driver.ctx_get_device(&cu_device)) != CUDA_SUCCESS) return fail("cuCtxGetDevice", result);
  result = driver.device_get_attribute(&shared_opt_in, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                                       cu_device);
  if (result != CUDA_SUCCESS) return fail("cuDeviceGetAttribute", result);
  if (kernel.shared > kSharedWithoutOptIn && shared_opt_in > kSharedWithoutOptIn) {
    if ((result = driver.func_set_cache_config(function, CU_FUNC_CACHE_PREFER_SHARED)) != CUDA_SUCCESS)
      return fail("cuFuncSetCacheConfig", result);
    result = driver.func_get_attribute(&shared_static, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, function);
    if (result != CUDA_SUCCESS) return fail("cuFuncGetAttribute", result);
    result = driver.func_set_attribute(function, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                       shared_opt_in - shared_static);
    if (result != CUDA_SUCCESS) return fail("cuFuncSetAttribute", result);
  }
  kernel.functions[device].store(function, std::memory_order_release);
  return function;
}

ffi::Error Invalid(const std::string& message) { return ffi::Error(ffi::ErrorCode::kInvalidArgument, message); }

// kCountCaptures: the graphed target's handler, which counts its launches recorded into a graph (the direct one
// pays no capture query per launch).
template <bool kCountCaptures>
ffi::Error Launch(CUstream stream, int32_t device, ffi::RemainingArgs args, ffi::RemainingRets rets, int64_t id,
                  int64_t grid, ffi::Span<const int64_t> parameters) {
  const Driver& driver = OpenDriver();
  if (!driver.error.empty()) return ffi::Error(ffi::ErrorCode::kFailedPrecondition, driver.error);
  if (id < 0 || id >= kernel_count.load(std::memory_order_acquire))
    return Invalid("moe_triton_launch: attribute kernel: expected an id from moe_triton_register, got " +
                   std::to_string(id));
  Kernel& kernel = *kernels[id].load(std::memory_order_acquire);
  if (device < 0 || device >= kMaxDevices)
    return Invalid("moe_triton_launch: device ordinal " + std::to_string(device) + " is past the " +
                   std::to_string(kMaxDevices) + " this launcher keeps functions for");
  if (parameters.size() % 2 != 0 || parameters.size() / 2 > kMaxParameters)
    return Invalid("moe_triton_launch: attribute parameters: expected (kind, value) pairs, at most " +
                   std::to_string(kMaxParameters) + ", got " + std::to_string(parameters.size()) + " numbers");
  uint64_t slots[kMaxParameters];
  void* pointers[kMaxParameters];
  const size_t count = parameters.size() / 2;
  for (size_t i = 0; i < count; ++i) {
    const int64_t kind = parameters[2 * i], value = parameters[2 * i + 1];
    slots[i] = 0;
    pointers[i] = &slots[i];
    switch (kind) {
      case kArgument: {
        auto buffer = args.get<ffi::AnyBuffer>(value);
        if (buffer.has_error()) return Invalid("moe_triton_launch: operand " + std::to_string(value) + " missing");
        slots[i] = reinterpret_cast<uint64_t>(buffer->untyped_data());
        break;
      }
      case kResult:
      case kZeroedResult: {
        auto buffer = rets.get<ffi::AnyBuffer>(value);
        if (buffer.has_error()) return Invalid("moe_triton_launch: result " + std::to_string(value) + " missing");
        slots[i] = reinterpret_cast<uint64_t>((*buffer)->untyped_data());
        if (kind == kZeroedResult && (*buffer)->size_bytes() > 0) {
          CUresult result = driver.memset_d8_async(slots[i], 0, (*buffer)->size_bytes(), stream);
          if (result != CUDA_SUCCESS) return ffi::Error::Internal(Describe(driver, result, "cuMemsetD8Async", kernel));
        }
        break;
      }
      case kInt32: {
        const int32_t narrow = static_cast<int32_t>(value);
        std::memcpy(&slots[i], &narrow, sizeof(narrow));
        break;
      }
      case kInt64:
        std::memcpy(&slots[i], &value, sizeof(value));
        break;
      case kNullPointer:
        break;
      default:
        return Invalid("moe_triton_launch: attribute parameters: unknown kind " + std::to_string(kind));
    }
  }
  if (grid <= 0) return ffi::Error::Success();
  std::string error;
  CUfunction function = Function(driver, kernel, device, stream, &error);
  if (function == nullptr) return ffi::Error::Internal(error);
  CUresult result = driver.launch_kernel(function, static_cast<unsigned>(grid), 1, 1, kernel.threads, 1, 1,
                                         kernel.shared, stream, pointers, nullptr);
  if (result != CUDA_SUCCESS) return ffi::Error::Internal(Describe(driver, result, "cuLaunchKernel", kernel));
  if constexpr (kCountCaptures) {
    CUstreamCaptureStatus capture = CU_STREAM_CAPTURE_STATUS_NONE;
    if (driver.stream_is_capturing(stream, &capture) == CUDA_SUCCESS && capture == CU_STREAM_CAPTURE_STATUS_ACTIVE)
      captured_launches.fetch_add(1, std::memory_order_relaxed);
  }
  return ffi::Error::Success();
}

}  // namespace

// The id of a kernel from then on, or -1 with `error` (`error_size` bytes) filled.
extern "C" int64_t moe_triton_register(const char* name, const char* cubin, size_t cubin_size, int32_t num_warps,
                                       int32_t shared, char* error, size_t error_size) {
  auto fail = [&](const std::string& message) {
    std::snprintf(error, error_size, "%s", message.c_str());
    return int64_t{-1};
  };
  if (num_warps <= 0 || num_warps > 32) return fail("num_warps: expected 1 to 32, got " + std::to_string(num_warps));
  if (shared < 0) return fail("shared: expected a byte count >= 0, got " + std::to_string(shared));
  auto kernel = std::make_unique<Kernel>();
  kernel->name = name;
  kernel->cubin.assign(cubin, cubin_size);
  kernel->threads = 32u * static_cast<unsigned>(num_warps);
  kernel->shared = static_cast<unsigned>(shared);
  std::lock_guard<std::mutex> lock(registry_mutex);
  const int64_t id = kernel_count.load(std::memory_order_relaxed);
  if (id >= kMaxKernels) return fail("more than " + std::to_string(kMaxKernels) + " kernels registered");
  kernels[id].store(kernel.release(), std::memory_order_release);
  kernel_count.store(id + 1, std::memory_order_release);
  return id;
}

// How many of moe_triton_launch_graphed's launches went into a CUDA graph being captured (XLA tracing a command
// buffer) rather than to the GPU.
extern "C" int64_t moe_triton_captured_launches() { return captured_launches.load(std::memory_order_relaxed); }

// Why the CUDA driver cannot be used here (an empty string: it can).
extern "C" const char* moe_triton_driver_error() { return OpenDriver().error.c_str(); }

#define MOE_TRITON_LAUNCH_BINDING                \
  ffi::Ffi::Bind()                               \
      .Ctx<ffi::PlatformStream<CUstream>>()      \
      .Ctx<ffi::DeviceOrdinal>()                 \
      .RemainingArgs()                           \
      .RemainingRets()                           \
      .Attr<int64_t>("kernel")                   \
      .Attr<int64_t>("grid")                     \
      .Attr<ffi::Span<const int64_t>>("parameters")

XLA_FFI_DEFINE_HANDLER_SYMBOL(moe_triton_launch, Launch<false>, MOE_TRITON_LAUNCH_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(moe_triton_launch_graphed, Launch<true>, MOE_TRITON_LAUNCH_BINDING);
