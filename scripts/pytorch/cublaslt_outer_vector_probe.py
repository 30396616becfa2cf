"""Which fp8 products cuBLASLt offers an algorithm for with outer-vector (rowwise) scales on this
GPU: `cublasLtMatmulAlgoGetHeuristic` for the layout `crates/ops-cuda/src/linear.rs`'s
`matmul_float8` asks for (A read transposed, B not, column-major D), over output types, operand
pairs, fast accumulation and sizes, beside the same problems with scalar (tensorwise) scales.

Issue 37: parity's `float8_matmul_matches_the_cpu` found cuBLASLt declining the rowwise product
on the H200 while it ran the tensorwise one; this says where it declines. torch provides the
device memory for the scale pointers; the library is the first `libcublasLt.so*` found among
torch's bundled NVIDIA libraries and the system's.

Prints one JSON line per problem: lib, version, out, a, b, fast, scales, dims, status,
algorithms.

Usage (on the GPU machine): python3 scripts/pytorch/cublaslt_outer_vector_probe.py
"""
import ctypes
import glob
import itertools
import json
import os

import torch

CUDA_R_32F, CUDA_R_16BF, CUDA_R_8F_E4M3, CUDA_R_8F_E5M2 = 0, 14, 28, 29
COMPUTE_32F = 68
TRANSA, TRANSB, A_SCALE_POINTER, B_SCALE_POINTER = 3, 4, 17, 18
FAST_ACCUM, A_SCALE_MODE, B_SCALE_MODE = 25, 31, 32
PREF_MAX_WORKSPACE_BYTES = 1
SCALE_SCALAR, SCALE_OUTER_VEC = 0, 3
HEURISTIC_RESULT_BYTES = 96  # algo (64) + workspaceSize + state + wavesCount + reserved[4]


def library():
    roots = [os.path.join(os.path.dirname(torch.__file__), "..", "nvidia")]
    found = []
    for root in roots:
        found += glob.glob(os.path.join(root, "**", "libcublasLt.so*"), recursive=True)
    found += glob.glob("/usr/local/cuda*/lib64/libcublasLt.so*")
    for path in found + ["libcublasLt.so.13", "libcublasLt.so"]:
        try:
            return path, ctypes.CDLL(path)
        except OSError:
            continue
    raise SystemExit("no libcublasLt found")


def main():
    path, lt = library()
    lt.cublasLtGetVersion.restype = ctypes.c_size_t
    version = lt.cublasLtGetVersion()
    handle = ctypes.c_void_p()
    assert lt.cublasLtCreate(ctypes.byref(handle)) == 0
    device = torch.device("cuda")
    scales = torch.ones(8192, device=device, dtype=torch.float32)
    pointer = ctypes.c_void_p(scales.data_ptr())

    def set_desc(desc, attribute, value):
        return lt.cublasLtMatmulDescSetAttribute(desc, attribute, ctypes.byref(value),
                                                 ctypes.sizeof(value))

    types = {"f32": CUDA_R_32F, "bf16": CUDA_R_16BF, "e4m3": CUDA_R_8F_E4M3, "e5m2": CUDA_R_8F_E5M2}
    problems = itertools.product(
        ["f32", "bf16"], [("e4m3", "e4m3"), ("e5m2", "e4m3"), ("e4m3", "e5m2")], [0, 1],
        ["scalar", "outer"], [(48, 64, 32), (1024, 1024, 1024), (5120, 8192, 1280)])
    for out, (a, b), fast, form, (m, n, k) in problems:
        desc = ctypes.c_void_p()
        assert lt.cublasLtMatmulDescCreate(ctypes.byref(desc), COMPUTE_32F, CUDA_R_32F) == 0
        statuses = [set_desc(desc, TRANSA, ctypes.c_int32(1)),
                    set_desc(desc, TRANSB, ctypes.c_int32(0)),
                    set_desc(desc, FAST_ACCUM, ctypes.c_int8(fast))]
        if form == "outer":
            statuses += [set_desc(desc, A_SCALE_MODE, ctypes.c_uint32(SCALE_OUTER_VEC)),
                         set_desc(desc, B_SCALE_MODE, ctypes.c_uint32(SCALE_OUTER_VEC))]
        statuses += [set_desc(desc, A_SCALE_POINTER, pointer),
                     set_desc(desc, B_SCALE_POINTER, pointer)]
        layouts = []
        for data_type, rows, cols, ld in [(types[a], k, m, k), (types[b], k, n, k),
                                          (types[out], m, n, m)]:
            layout = ctypes.c_void_p()
            statuses.append(lt.cublasLtMatrixLayoutCreate(
                ctypes.byref(layout), data_type, ctypes.c_uint64(rows), ctypes.c_uint64(cols),
                ctypes.c_int64(ld)))
            layouts.append(layout)
        preference = ctypes.c_void_p()
        statuses.append(lt.cublasLtMatmulPreferenceCreate(ctypes.byref(preference)))
        workspace = ctypes.c_uint64(32 << 20)
        statuses.append(lt.cublasLtMatmulPreferenceSetAttribute(
            preference, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(workspace),
            ctypes.sizeof(workspace)))
        results = ctypes.create_string_buffer(HEURISTIC_RESULT_BYTES * 8)
        returned = ctypes.c_int(0)
        status = lt.cublasLtMatmulAlgoGetHeuristic(
            handle, desc, layouts[0], layouts[1], layouts[2], layouts[2], preference, 8,
            results, ctypes.byref(returned))
        print(json.dumps({
            "lib": path, "version": version, "out": out, "a": a, "b": b, "fast": fast,
            "scales": form, "dims": [m, n, k], "setup_status": statuses, "status": status,
            "algorithms": returned.value,
            "device": torch.cuda.get_device_name(),
        }), flush=True)
        lt.cublasLtMatmulPreferenceDestroy(preference)
        for layout in layouts:
            lt.cublasLtMatrixLayoutDestroy(layout)
        lt.cublasLtMatmulDescDestroy(desc)


if __name__ == "__main__":
    main()
