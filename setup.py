"""Build of the `anchorcache.ext._C` torch extension.

The CPU operators build whenever torch can be imported. Without torch (the proxy alone:
`pip install '.[proxy]'`, whose build environment has no torch) the package builds without
the extension, which only the workers load; ANCHORCACHE_BUILD_EXT=1 makes that an error
instead, =0 skips the extension even where torch is present. The CUDA sources in ext/cuda/
are added when torch is a CUDA build and a CUDA toolkit is found (no GPU needed to compile);
set ANCHORCACHE_BUILD_CUDA=0 to skip them, =1 to make their absence an error.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys

from setuptools import find_packages, setup

ROOTS = {"anchorcache": "anchorcache", "anchorcache.proxy": "proxy",
         "anchorcache.ext": "ext", "anchorcache.state": "state", "anchorcache.ops": "ops"}


DEFAULT_CUDA_HOME = "/usr/local/cuda-13.0"
# sm_80 (A100), sm_90 (H100/H200) plus PTX for newer parts; without an explicit list torch's
# arch detection fails when no GPU is present.
DEFAULT_CUDA_ARCHS = "8.0;9.0+PTX"


def packages() -> list[str]:
    found = []
    for name, folder in ROOTS.items():
        found.append(name)
        found += [f"{name}.{sub}" for sub in find_packages(folder)]
    return found


# Built inside ext/csrc/torch_ops.cpp (one translation unit for the torch-facing sources:
# torch's headers are parsed once, not four times), so not compiled on their own
UNITY_SOURCES = {"schema.cpp", "kv_plan.cpp", "kv_ops.cpp", "cpu_ops.cpp"}


def extensions():
    cpp = sorted(p for p in glob.glob("ext/csrc/*.cpp")
                 if os.path.basename(p) not in UNITY_SOURCES)
    build_ext = os.environ.get("ANCHORCACHE_BUILD_EXT", "auto")
    if build_ext not in ("auto", "0", "1"):
        raise RuntimeError(f"ANCHORCACHE_BUILD_EXT must be auto, 0 or 1, not {build_ext!r}")
    if not cpp or build_ext == "0":
        return [], {}
    if importlib.util.find_spec("torch") is None:
        if build_ext == "1":
            raise RuntimeError("ANCHORCACHE_BUILD_EXT=1 but torch cannot be imported: install "
                               "torch first, then `pip install --no-build-isolation`")
        print("anchorcache: torch is not installed here, so the C++ extension is not built: "
              "the proxy is complete; for the workers, install torch, then "
              "`pip install --no-build-isolation '.[worker]'`", file=sys.stderr)
        return [], {}
    # Where no CUDA runtime can be asked (no GPU), torch only finds a toolkit via CUDA_HOME;
    # default to the toolkit of these machines when it exists. Set before importing torch's
    # extension helpers, which read it at import.
    if "CUDA_HOME" not in os.environ and os.path.isdir(DEFAULT_CUDA_HOME):
        os.environ["CUDA_HOME"] = DEFAULT_CUDA_HOME
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

    want = os.environ.get("ANCHORCACHE_BUILD_CUDA", "auto")
    cu = sorted(glob.glob("ext/cuda/*.cu"))
    have_cuda = bool(cu) and torch.version.cuda is not None and CUDA_HOME is not None
    if want == "1" and not have_cuda:
        raise RuntimeError("ANCHORCACHE_BUILD_CUDA=1 but no CUDA torch build or CUDA toolkit found")
    use_cuda = have_cuda and want != "0"
    # -g0 undoes the -g of Python's own CFLAGS (setuptools puts them first): debug info for
    # torch's templates cost most of the compile time and made the .so 20 MB
    cxx = ["-O3", "-g0", "-std=c++20"]  # torch >= 2.10 headers need C++20
    link = []
    if sys.platform.startswith("linux"):
        # at::parallel_for is an inline `#pragma omp parallel`: without -fopenmp the CPU copy
        # kernels run on one thread. libgomp.so.1 resolves to the copy torch already loaded.
        cxx.append("-fopenmp")
        link.append("-fopenmp")
    if use_cuda:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCHS)
        ext = CUDAExtension(
            "anchorcache.ext._C", cpp + cu,
            define_macros=[("ANCHORCACHE_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "-std=c++20"]},
            extra_link_args=link,
        )
    else:
        ext = CppExtension(
            "anchorcache.ext._C", cpp,
            extra_compile_args={"cxx": cxx},
            extra_link_args=link,
        )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = extensions()
setup(
    packages=packages(),
    package_dir=ROOTS,
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
