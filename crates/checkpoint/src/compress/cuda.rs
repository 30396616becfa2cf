//! The 8-bit codec on CUDA tensors: `kernels/compress.cu` (committed PTX, built by
//! `cargo xtask build-kernels`) launched on the tensor's `CudaBackend`, in its stream order.
//!
//! Encoding is one launch (absmax per block and codes in one pass, a warp per block), decoding
//! one launch (four elements a thread). The encoded tensors and the decoded one come from the
//! backend's caching allocator; the source's memory may be freed right after the launch, since
//! the allocator reuses it only for work queued later on the same stream. This module sits on
//! ops-cuda's kernel loading and launching; no cudarc type appears here.

use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use headroom_autograd_core::{DType, Tensor, TensorError};
use headroom_ops_cuda::{CudaBackend, CudaKernel, KernelArg};

use crate::error::CheckpointError;

const MODULE: &str = "headroom_checkpoint::compress";
const PTX: &str = include_str!("../../kernels/ptx/compress.ptx");

/// Threads per CUDA block of both kernels (8 warps).
const THREADS: u32 = 256;
/// The most CUDA blocks a launch takes (a few waves of an H200); the kernels loop over the rest.
const MAX_GRID: u64 = 132 * 16;

/// Kernels loaded so far, per backend (a weak handle: a backend's address is not reused while
/// its entry lives).
static KERNELS: Mutex<Vec<(Weak<CudaBackend>, &'static str, CudaKernel)>> = Mutex::new(Vec::new());

/// The CUDA backend `tensor` lives on.
fn backend_of(tensor: &Tensor) -> Result<Arc<CudaBackend>, CheckpointError> {
    tensor
        .backend()
        .clone()
        .into_any()
        .downcast::<CudaBackend>()
        .map_err(|_| CheckpointError::InvalidArgument {
            op: "compress",
            reason: format!(
                "a {:?} tensor of a backend other than headroom-ops-cuda's cannot be compressed \
                 to 8 bits; use Compression::Bf16",
                tensor.device()
            ),
        })
}

/// Kernel `name` on `backend`, loaded once.
fn kernel(backend: &Arc<CudaBackend>, name: &'static str) -> Result<CudaKernel, CheckpointError> {
    let mut kernels = KERNELS.lock();
    kernels.retain(|(owner, _, _)| owner.strong_count() > 0);
    let found = kernels.iter().find(|(owner, kernel_name, _)| {
        *kernel_name == name && owner.upgrade().is_some_and(|b| Arc::ptr_eq(&b, backend))
    });
    if let Some((_, _, kernel)) = found {
        return Ok(kernel.clone());
    }
    let kernel = backend
        .load_kernel(MODULE, PTX, name)
        .map_err(|err| TensorError::Device {
            op: "compress",
            reason: err.to_string(),
        })?;
    kernels.push((Arc::downgrade(backend), name, kernel.clone()));
    Ok(kernel)
}

/// The instance of a kernel for elements of `dtype`.
fn instance(dtype: DType, names: [&'static str; 4]) -> Result<&'static str, CheckpointError> {
    match dtype {
        DType::F32 => Ok(names[0]),
        DType::F64 => Ok(names[1]),
        DType::BF16 => Ok(names[2]),
        DType::F16 => Ok(names[3]),
        other => Err(CheckpointError::InvalidArgument {
            op: "compress",
            reason: format!("{other:?} tensors are not compressed (floating dtypes only)"),
        }),
    }
}

/// The device address of a contiguous tensor's first element.
fn address(tensor: &Tensor) -> u64 {
    tensor.buffer().address() + (tensor.layout().offset() * tensor.dtype().size_in_bytes()) as u64
}

/// Encodes `x` (contiguous, 1-D) into `codes` (u8, as many) and `absmax` (f32, one per block).
pub(super) fn quantize(
    x: &Tensor,
    block: usize,
    codes: &Tensor,
    absmax: &Tensor,
) -> Result<(), CheckpointError> {
    let backend = backend_of(x)?;
    let name = instance(
        x.dtype(),
        [
            "quantize_int8_f32",
            "quantize_int8_f64",
            "quantize_int8_bf16",
            "quantize_int8_f16",
        ],
    )?;
    let kernel = kernel(&backend, name)?;
    let n_blocks = absmax.numel() as u64;
    let grid = n_blocks
        .div_ceil(u64::from(THREADS / 32))
        .clamp(1, MAX_GRID) as u32;
    let args = [
        KernelArg::U64(address(x)),
        KernelArg::U64(address(codes)),
        KernelArg::U64(address(absmax)),
        KernelArg::U64(x.numel() as u64),
        KernelArg::U32(block as u32),
    ];
    // SAFETY: `quantize_int8_*` takes (const T*, signed char*, float*, unsigned long long,
    // unsigned); `x` holds `n` elements of T from its address, `codes` `n` bytes and `absmax`
    // `n.div_ceil(block)` floats, all live tensors of this backend, ordered on its stream.
    unsafe { backend.launch_kernel(&kernel, grid, THREADS, 0, &args) }?;
    Ok(())
}

/// Decodes `codes` and `absmax` into `out` (contiguous, 1-D, as many elements as codes).
pub(super) fn dequantize(
    codes: &Tensor,
    absmax: &Tensor,
    block: usize,
    out: &Tensor,
) -> Result<(), CheckpointError> {
    let backend = backend_of(codes)?;
    let name = instance(
        out.dtype(),
        [
            "dequantize_int8_f32",
            "dequantize_int8_f64",
            "dequantize_int8_bf16",
            "dequantize_int8_f16",
        ],
    )?;
    let kernel = kernel(&backend, name)?;
    let n = out.numel() as u64;
    let grid = n.div_ceil(4 * u64::from(THREADS)).clamp(1, MAX_GRID * 4) as u32;
    let args = [
        KernelArg::U64(address(codes)),
        KernelArg::U64(address(absmax)),
        KernelArg::U64(address(out)),
        KernelArg::U64(n),
        KernelArg::U32(block.trailing_zeros()),
    ];
    // SAFETY: `dequantize_int8_*` takes (const signed char*, const float*, T*, unsigned long
    // long, unsigned); `codes` holds `n` bytes from a 512-byte-aligned allocation start (offset
    // 0, read as char4), `absmax` one float per block of 2^shift, `out` `n` elements of T in a
    // fresh allocation; all live tensors of this backend, ordered on its stream.
    unsafe { backend.launch_kernel(&kernel, grid, THREADS, 0, &args) }?;
    Ok(())
}
