// float8.cuh's kernels built for compute_89 (Ada, Hopper and newer): the same names and results
// as float8.cu's, each value's fp8 code one hardware conversion (`cvt.rn.satfinite`, two values
// an instruction) instead of cuda_fp8.h's emulation. xtask's build-kernels targets a
// `*_sm89.cu` source at compute_89; src/kernels.rs loads this module on devices of compute
// capability 8.9 and above.

#include "float8.cuh"
