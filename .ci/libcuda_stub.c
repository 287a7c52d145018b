/* A stand-in for the NVIDIA driver's libcuda.so.1, for CI only: never installed
 * for users, never put on a library path outside the CI stage that imports the
 * GPU wheel (.ci/gpu-stage compiles it into a temporary folder).
 *
 * Why: mxnet-cu112's libmxnet.so links against libcuda.so.1, which only the
 * NVIDIA driver provides (no wheel does), and CI machines have no GPU and no
 * driver. With this library the GPU wheel imports and runs on CPU contexts, so
 * CI builds and tests the native operators against that wheel's libmxnet.so.
 *
 * Where it comes from: it plays the role of the link stubs the CUDA toolkit
 * ships (lib64/stubs/libcuda.so) for building on machines without a driver,
 * written here instead because the toolkit cannot be installed from a package
 * registry. It defines the 10 driver functions libmxnet.so 1.9.1 imports
 * (`nm -D --undefined-only libmxnet.so | grep ' cu'`), plus the ones the CUDA
 * runtime (libcudart) calls first when a program asks for devices: each
 * answers CUDA_ERROR_NO_DEVICE, so MXNet reports 0 GPUs.
 *
 * Build: gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o libcuda.so.1 libcuda_stub.c
 */
#include <stddef.h>

#define CUDA_ERROR_NO_DEVICE 100

#define NO_DEVICE(name) int name(void) { return CUDA_ERROR_NO_DEVICE; }

/* Imported by libmxnet.so. */
NO_DEVICE(cuDeviceGet)
NO_DEVICE(cuDevicePrimaryCtxRetain)
NO_DEVICE(cuGraphKernelNodeGetParams)
NO_DEVICE(cuGraphNodeGetType)
NO_DEVICE(cuLaunchKernel)
NO_DEVICE(cuModuleGetFunction)
NO_DEVICE(cuModuleLoadData)
NO_DEVICE(cuModuleLoadDataEx)
NO_DEVICE(cuModuleUnload)

/* Also imported by libmxnet.so; it answers like the others, and still hands
 * back a string, since a caller may print it without checking. */
int cuGetErrorString(int error, const char **text) {
    (void)error;
    if (text != NULL)
        *text = "no CUDA-capable device is detected (libcuda.so.1 is CI's driver stub)";
    return CUDA_ERROR_NO_DEVICE;
}

/* What the CUDA runtime calls when a program first asks for devices. */
NO_DEVICE(cuInit)
NO_DEVICE(cuDriverGetVersion)
NO_DEVICE(cuDeviceGetCount)
NO_DEVICE(cuGetProcAddress)
