//! `headroom._native`'s activation codec: headroom-checkpoint's 8-bit blockwise quantisation
//! (`Compression::Int8Blockwise`: one f32 absmax per block, one signed byte per element) on the
//! memory of torch's tensors, which `headroom.torch.saved_activations` hands over by address.
//! On a CUDA device it is one launch each way on torch's default stream (checked); on the CPU
//! the host codec over the tensors' memory, in parallel runs of blocks. Both give the same bits
//! (headroom-checkpoint's tests), and the Python side checks every tensor (dtype, device, size,
//! contiguity) before its address comes here.

use half::{bf16, f16};
use headroom_autograd_core::DType;
use headroom_checkpoint::{
    dequantize_int8_blockwise, dequantize_int8_device, quantize_int8_blockwise,
    quantize_int8_device, CheckpointError, CodecElement, INT8_BLOCK_RANGE,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::device::{backend, float_dtype, on_default_stream};

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(quantize_int8, m)?)?;
    m.add_function(wrap_pyfunction!(dequantize_int8, m)?)?;
    Ok(())
}

fn codec_error(error: CheckpointError) -> PyErr {
    PyValueError::new_err(error.to_string())
}

/// The element type torch names `dtype`.
fn element(dtype: &str) -> PyResult<DType> {
    float_dtype(dtype, "compressed to 8 bits")
}

const STREAM_RULE: &str = "headroom.torch.saved_activations encodes on torch's default stream; \
                           run the forward outside `with torch.cuda.stream(...)`, or use \
                           compress=\"bf16\" there";

/// Rejects a block size the codec does not take, before any slice is sized by it.
fn check_block(block: usize) -> PyResult<usize> {
    if block.is_power_of_two() && INT8_BLOCK_RANGE.contains(&block) {
        return Ok(block);
    }
    Err(PyValueError::new_err(format!(
        "block={block}: give a power of two from {} to {}",
        INT8_BLOCK_RANGE.start(),
        INT8_BLOCK_RANGE.end()
    )))
}

/// Rejects null addresses of a non-empty tensor.
fn check_addresses(n: usize, addresses: &[(&str, u64)]) -> PyResult<()> {
    if n == 0 {
        return Ok(());
    }
    match addresses.iter().find(|(_, address)| *address == 0) {
        Some((name, _)) => Err(PyValueError::new_err(format!(
            "`{name}` is a null address for {n} elements"
        ))),
        None => Ok(()),
    }
}

/// Encodes the `n` elements of `dtype` at `x` into `n` signed bytes at `codes` and one f32
/// absmax per `block` at `absmax`: on CUDA device `device` (`stream`: torch's current stream's
/// handle), or on the CPU when `device` is `None`.
#[allow(clippy::too_many_arguments)]
#[pyfunction]
#[pyo3(signature = (device, stream, dtype, x, n, block, codes, absmax))]
fn quantize_int8(
    device: Option<usize>,
    stream: u64,
    dtype: &str,
    x: u64,
    n: usize,
    block: usize,
    codes: u64,
    absmax: u64,
) -> PyResult<()> {
    let dtype = element(dtype)?;
    check_addresses(n, &[("x", x), ("codes", codes), ("absmax", absmax)])?;
    let blocks = n.div_ceil(check_block(block)?);
    match device {
        Some(ordinal) => {
            on_default_stream(stream, STREAM_RULE)?;
            let backend = backend(ordinal)?;
            // SAFETY: `headroom.torch` passes the data pointers of live contiguous CUDA tensors
            // of this device that it keeps alive past the launch in stream order: `x` of `n`
            // elements of `dtype`, `codes` of `n` int8 and `absmax` of `n.div_ceil(block)` f32,
            // freshly allocated (no overlap); torch's default stream is the launch's (checked).
            unsafe { quantize_int8_device(&backend, dtype, x, n, block, codes, absmax) }
                .map_err(codec_error)
        }
        None => {
            if n == 0 {
                return Ok(());
            }
            fn run<T: CodecElement>(
                x: u64,
                n: usize,
                block: usize,
                codes: u64,
                absmax: (u64, usize),
            ) -> Result<(), CheckpointError> {
                // SAFETY: `headroom.torch` passes the data pointers of live contiguous CPU tensors
                // it holds during the call: `x` of `n` elements of T, `codes` of `n` int8 and
                // `absmax` of `n.div_ceil(block)` f32 (torch aligns every allocation for its
                // dtype), the outputs freshly allocated, so nothing else reads or writes them.
                let (x, codes, absmax) = unsafe {
                    (
                        std::slice::from_raw_parts(x as *const T, n),
                        std::slice::from_raw_parts_mut(codes as *mut i8, n),
                        std::slice::from_raw_parts_mut(absmax.0 as *mut f32, absmax.1),
                    )
                };
                quantize_int8_blockwise(x, block, codes, absmax)
            }
            let absmax = (absmax, blocks);
            match dtype {
                DType::F32 => run::<f32>(x, n, block, codes, absmax),
                DType::F64 => run::<f64>(x, n, block, codes, absmax),
                DType::BF16 => run::<bf16>(x, n, block, codes, absmax),
                _ => run::<f16>(x, n, block, codes, absmax),
            }
            .map_err(codec_error)
        }
    }
}

/// Decodes what [`quantize_int8`] wrote into the `n` elements of `dtype` at `out`.
#[allow(clippy::too_many_arguments)]
#[pyfunction]
#[pyo3(signature = (device, stream, dtype, codes, absmax, n, block, out))]
fn dequantize_int8(
    device: Option<usize>,
    stream: u64,
    dtype: &str,
    codes: u64,
    absmax: u64,
    n: usize,
    block: usize,
    out: u64,
) -> PyResult<()> {
    let dtype = element(dtype)?;
    check_addresses(n, &[("codes", codes), ("absmax", absmax), ("out", out)])?;
    let blocks = n.div_ceil(check_block(block)?);
    match device {
        Some(ordinal) => {
            on_default_stream(stream, STREAM_RULE)?;
            let backend = backend(ordinal)?;
            // SAFETY: `headroom.torch` passes the codes and absmax it allocated when encoding
            // (`n` int8 and `n.div_ceil(block)` f32, live) and a fresh `out` of `n` elements of
            // `dtype`, all CUDA tensors of this device kept alive past the launch in stream
            // order, on torch's default stream (checked); the alignment is checked by the callee.
            unsafe { dequantize_int8_device(&backend, dtype, codes, absmax, n, block, out) }
                .map_err(codec_error)
        }
        None => {
            if n == 0 {
                return Ok(());
            }
            fn run<T: CodecElement>(
                codes: u64,
                absmax: (u64, usize),
                block: usize,
                out: u64,
                n: usize,
            ) -> Result<(), CheckpointError> {
                // SAFETY: as in `quantize_int8`: live contiguous CPU tensors held by the caller
                // during the call, `out` freshly allocated for `n` elements of T, so no other
                // slice reaches it.
                let (codes, absmax, out) = unsafe {
                    (
                        std::slice::from_raw_parts(codes as *const i8, n),
                        std::slice::from_raw_parts(absmax.0 as *const f32, absmax.1),
                        std::slice::from_raw_parts_mut(out as *mut T, n),
                    )
                };
                dequantize_int8_blockwise(codes, absmax, block, out)
            }
            let absmax = (absmax, blocks);
            match dtype {
                DType::F32 => run::<f32>(codes, absmax, block, out, n),
                DType::F64 => run::<f64>(codes, absmax, block, out, n),
                DType::BF16 => run::<bf16>(codes, absmax, block, out, n),
                _ => run::<f16>(codes, absmax, block, out, n),
            }
            .map_err(codec_error)
        }
    }
}
