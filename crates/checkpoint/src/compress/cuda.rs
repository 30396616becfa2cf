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
/// `kernels/ptx/compress.ptx.gz`, committed gzipped as every crate's PTX.
const PTX: &[u8] = include_bytes!("../../kernels/ptx/compress.ptx.gz");

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
        .load_kernel(MODULE, headroom_ops_cuda::ptx_text(PTX), name)
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
    // SAFETY: `x` holds `numel` elements of its dtype from its address, `codes` as many bytes
    // and `absmax` `numel.div_ceil(block)` floats (the caller's allocation), all live tensors of
    // this backend, ordered on its stream.
    unsafe {
        quantize_int8_device(
            &backend,
            x.dtype(),
            address(x),
            x.numel(),
            block,
            address(codes),
            address(absmax),
        )
    }
}

/// Decodes `codes` and `absmax` into `out` (contiguous, 1-D, as many elements as codes).
pub(super) fn dequantize(
    codes: &Tensor,
    absmax: &Tensor,
    block: usize,
    out: &Tensor,
) -> Result<(), CheckpointError> {
    let backend = backend_of(codes)?;
    // SAFETY: `codes` holds `numel` bytes from the start of its allocation (the encoder's fresh
    // tensor), `absmax` one float per block, `out` `numel` elements of its dtype in a fresh
    // allocation; all live tensors of this backend, ordered on its stream.
    unsafe {
        dequantize_int8_device(
            &backend,
            out.dtype(),
            address(codes),
            address(absmax),
            out.numel(),
            block,
            address(out),
        )
    }
}

/// Encodes the `n` elements of `dtype` at device address `x` into `n` signed bytes at `codes`
/// and one f32 absmax per `block` at `absmax`, in one launch on `backend`'s stream: the codec
/// of [`quantize_int8_blockwise`](super::quantize_int8_blockwise), bit for bit, for a caller
/// whose memory is its own (a framework's tensors).
///
/// # Safety
/// `x` must address `n` live elements of `dtype`, `codes` `n` writable bytes and `absmax`
/// `n.div_ceil(block)` writable f32s, all on `backend`'s device and not overlapping, until the
/// launch completes; whatever writes `x` must be ordered before the launch on `backend`'s compute
/// stream, and whatever reads the outputs after it.
pub unsafe fn quantize_int8_device(
    backend: &Arc<CudaBackend>,
    dtype: DType,
    x: u64,
    n: usize,
    block: usize,
    codes: u64,
    absmax: u64,
) -> Result<(), CheckpointError> {
    super::codec::check_block("quantize_int8_device", block)?;
    let name = instance(
        dtype,
        [
            "quantize_int8_f32",
            "quantize_int8_f64",
            "quantize_int8_bf16",
            "quantize_int8_f16",
        ],
    )?;
    let kernel = kernel(backend, name)?;
    let n_blocks = n.div_ceil(block) as u64;
    let grid = n_blocks
        .div_ceil(u64::from(THREADS / 32))
        .clamp(1, MAX_GRID) as u32;
    let args = [
        KernelArg::U64(x),
        KernelArg::U64(codes),
        KernelArg::U64(absmax),
        KernelArg::U64(n as u64),
        KernelArg::U32(block as u32),
    ];
    // SAFETY: `quantize_int8_*` takes (const T*, signed char*, float*, unsigned long long,
    // unsigned); the caller guarantees `x` holds `n` elements of T, `codes` `n` bytes and
    // `absmax` `n.div_ceil(block)` floats, live and ordered on this backend's stream.
    unsafe { backend.launch_kernel(&kernel, grid, THREADS, 0, &args) }?;
    Ok(())
}

/// Decodes what [`quantize_int8_device`] wrote into the `n` elements of `dtype` at `out`, in
/// one launch on `backend`'s stream.
///
/// # Safety
/// `codes` must address `n` live bytes (4-byte aligned: the kernel reads four at a time; checked),
/// `absmax` `n.div_ceil(block)` f32s and `out` `n` writable elements of `dtype` (16-byte
/// aligned; checked), all on
/// `backend`'s device, `out` overlapping neither, until the launch completes; their writers
/// ordered before it on `backend`'s stream, and `out`'s readers after it.
pub unsafe fn dequantize_int8_device(
    backend: &Arc<CudaBackend>,
    dtype: DType,
    codes: u64,
    absmax: u64,
    n: usize,
    block: usize,
    out: u64,
) -> Result<(), CheckpointError> {
    super::codec::check_block("dequantize_int8_device", block)?;
    if !codes.is_multiple_of(4) || !out.is_multiple_of(16) {
        return Err(CheckpointError::InvalidArgument {
            op: "dequantize_int8_device",
            reason: format!(
                "codes at {codes:#x}, out at {out:#x}: the kernel reads codes four at a time and \
                 writes 16 bytes at a time; give allocations' starts"
            ),
        });
    }
    let name = instance(
        dtype,
        [
            "dequantize_int8_f32",
            "dequantize_int8_f64",
            "dequantize_int8_bf16",
            "dequantize_int8_f16",
        ],
    )?;
    let kernel = kernel(backend, name)?;
    let grid = (n as u64)
        .div_ceil(4 * u64::from(THREADS))
        .clamp(1, MAX_GRID * 4) as u32;
    let args = [
        KernelArg::U64(codes),
        KernelArg::U64(absmax),
        KernelArg::U64(out),
        KernelArg::U64(n as u64),
        KernelArg::U32(block.trailing_zeros()),
    ];
    // SAFETY: `dequantize_int8_*` takes (const signed char*, const float*, T*, unsigned long
    // long, unsigned); the caller guarantees `codes` holds `n` bytes and `out` `n` elements
    // from aligned addresses (checked), `absmax` one float per block of 2^shift (a power of two, checked), `out` `n`
    // elements of T, live and ordered on this backend's stream.
    unsafe { backend.launch_kernel(&kernel, grid, THREADS, 0, &args) }?;
    Ok(())
}
