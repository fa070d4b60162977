/* A stand-in libcuda.so.1 for machines without an NVIDIA driver.
 *
 * SGLang's PyPI kernel wheel (sgl_kernel) is CUDA-only and links one driver symbol,
 * cuPointerGetAttribute; without a libcuda.so.1 it fails to import, even when SGLang
 * then runs on the CPU (SGLANG_USE_CPU_ENGINE=1). Every entry point reports
 * CUDA_ERROR_NO_DEVICE (100), so nothing can mistake this for a GPU.
 * Built by `anchorcache worker --backend sglang` (ext/sglang/cpu.py) or `make stub-libcuda`. */
int cuInit(unsigned int flags) { (void)flags; return 100; }
int cuDriverGetVersion(int *version) { if (version) *version = 0; return 100; }
int cuDeviceGetCount(int *count) { if (count) *count = 0; return 100; }
int cuPointerGetAttribute(void *data, int attribute, unsigned long long ptr) {
    (void)data; (void)attribute; (void)ptr; return 100;
}
