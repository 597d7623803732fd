/* A stand-in libcuda.so.1 for running real kvikio on a machine without an NVIDIA driver.
 *
 * kvikio dlopens libcuda.so.1 and looks up the entry points below (kvikio/shim/cuda.cpp, 26.10).
 * This driver has no device: every call answers CUDA_ERROR_NOT_INITIALIZED, which kvikio's
 * is_host_memory() reads as "a host pointer", so its real POSIX host path runs. Only the version
 * query and the error texts succeed, so that kvikio's error reports stay readable.
 * Built by tests/storage/test_kvikio_real.py: gcc -shared -fPIC -o libcuda.so.1 libcuda_stub.c
 */
#define CUDA_SUCCESS 0
#define CUDA_ERROR_NOT_INITIALIZED 3

int cuDriverGetVersion(int *version) { *version = 13000; return CUDA_SUCCESS; }
int cuGetErrorName(int err, const char **s) { (void)err; *s = "CUDA_ERROR_NOT_INITIALIZED"; return CUDA_SUCCESS; }
int cuGetErrorString(int err, const char **s) { (void)err; *s = "stand-in driver: no device"; return CUDA_SUCCESS; }

#define NO_DEVICE(name) int name(void) { return CUDA_ERROR_NOT_INITIALIZED; }
NO_DEVICE(cuInit)
NO_DEVICE(cuPointerGetAttribute)
NO_DEVICE(cuPointerGetAttributes)
NO_DEVICE(cuMemHostAlloc)
NO_DEVICE(cuMemFreeHost)
NO_DEVICE(cuMemHostRegister_v2)
NO_DEVICE(cuMemHostUnregister)
NO_DEVICE(cuMemcpyHtoDAsync_v2)
NO_DEVICE(cuMemcpyDtoHAsync_v2)
NO_DEVICE(cuMemcpyAsync)
NO_DEVICE(cuMemcpyBatchAsync_v2)
NO_DEVICE(cuCtxCreate_v4)
NO_DEVICE(cuCtxDestroy_v2)
NO_DEVICE(cuCtxPushCurrent_v2)
NO_DEVICE(cuCtxPopCurrent_v2)
NO_DEVICE(cuCtxGetCurrent)
NO_DEVICE(cuCtxGetDevice)
NO_DEVICE(cuMemGetAddressRange_v2)
NO_DEVICE(cuDeviceGet)
NO_DEVICE(cuDeviceGetCount)
NO_DEVICE(cuDeviceGetAttribute)
NO_DEVICE(cuDevicePrimaryCtxRetain)
NO_DEVICE(cuDevicePrimaryCtxRelease_v2)
NO_DEVICE(cuStreamSynchronize)
NO_DEVICE(cuStreamCreate)
NO_DEVICE(cuStreamDestroy_v2)
NO_DEVICE(cuEventSynchronize)
NO_DEVICE(cuEventCreate)
NO_DEVICE(cuEventDestroy_v2)
NO_DEVICE(cuEventRecord)
NO_DEVICE(cuEventQuery)
NO_DEVICE(cuLaunchHostFunc)
