//! Launches of `kernels/elementwise.cu`: strided copy/cast, fill, unary, binary and masked ops.
//!
//! Operands are described to the kernels by one `StridedArgs` of `operands.rs` (shape,
//! per-operand strides and offsets, in elements), after merging dimensions that are contiguous in
//! every operand so most launches see one or two dimensions. Dense aligned operands take 16-byte
//! vector kernels, the driver's memset for fills and its copy for same-dtype copies. Op codes are
//! the variant order of `UnaryOp` and `BinaryOp`, mirrored by the `switch` statements of the
//! `.cu` file.
//!
//! This family sits on the ground floor (`operands.rs`, `launch.rs`) and imports no other family;
//! the dense copy other families need for library calls is the ground floor's `copy_raw`.

use cudarc::driver::sys as driver_sys;
use headroom_autograd_core::{BinaryOp, DType, MaskedOp, Result, TensorError, UnaryOp, View};

use crate::device::CudaBackend;
use crate::error::device_error;
use crate::kernels::{float_suffix, KernelName, Module};
use crate::launch::{launch_config, launch_in, Param, NO_ARGS};
use crate::operands::{copy_kernel, dense_addresses, launch_strided, strided_args, StridedArgs};

/// The cast kernels' name for `dtype`, as source (`cast_f32`, ...) or target (`f32`, ...).
fn cast_names(dtype: DType) -> (&'static str, &'static str) {
    match dtype {
        DType::F32 => ("cast_f32", "f32"),
        DType::F64 => ("cast_f64", "f64"),
        DType::F16 => ("cast_f16", "f16"),
        DType::BF16 => ("cast_bf16", "bf16"),
        DType::I64 => ("cast_i64", "i64"),
        DType::I32 => ("cast_i32", "i32"),
        DType::U8 => ("cast_u8", "u8"),
        DType::Bool => ("cast_bool", "bool"),
        DType::F8E4M3 => ("cast_f8e4m3", "f8e4m3"),
        DType::F8E5M2 => ("cast_f8e5m2", "f8e5m2"),
    }
}

fn device_address(view: &View<'_>) -> u64 {
    view.buffer.address()
}

pub(crate) fn unary(backend: &CudaBackend, op: UnaryOp, x: View<'_>, out: View<'_>) -> Result<()> {
    if x.dtype != out.dtype {
        return Err(TensorError::DtypeMismatch {
            op: "unary",
            lhs: x.dtype,
            rhs: out.dtype,
        });
    }
    let suffix = float_suffix("unary", x.dtype)?;
    let args = strided_args("unary", &[&out, &x])?;
    if args.numel == 0 {
        return Ok(());
    }
    let (code, scalar): (i32, f64) = match op {
        UnaryOp::Neg => (0, 0.0),
        UnaryOp::Exp => (1, 0.0),
        UnaryOp::Log => (2, 0.0),
        UnaryOp::Sqrt => (3, 0.0),
        UnaryOp::Rsqrt => (4, 0.0),
        UnaryOp::Tanh => (5, 0.0),
        UnaryOp::Relu => (6, 0.0),
        UnaryOp::Gelu => (7, 0.0),
        UnaryOp::GeluTanh => (8, 0.0),
        UnaryOp::AddScalar(c) => (9, c),
        UnaryOp::MulScalar(c) => (10, c),
        UnaryOp::DivScalar(c) => (11, c),
        UnaryOp::PowScalar(c) => (12, c),
    };
    let (x_ptr, out_ptr) = (device_address(&x), device_address(&out));
    if let Some([out_at, x_at, _]) = dense_addresses(
        &args,
        &[out_ptr, x_ptr],
        x.dtype.size_in_bytes(),
        VECTOR_ALIGNMENT,
    ) {
        let params = [
            Param::I32(code),
            Param::F64(scalar),
            Param::U64(x_at),
            Param::U64(out_at),
            Param::U64(args.numel),
        ];
        return launch_dense(
            backend,
            "unary",
            ("unary_dense", suffix),
            &args,
            x.dtype,
            &params,
        );
    }
    let params = [
        Param::I32(code),
        Param::F64(scalar),
        Param::U64(x_ptr),
        Param::U64(out_ptr),
    ];
    launch(backend, "unary", ("unary", suffix), args, &params)
}

pub(crate) fn binary(
    backend: &CudaBackend,
    op: BinaryOp,
    a: View<'_>,
    b: View<'_>,
    out: View<'_>,
) -> Result<()> {
    for operand in [&b, &out] {
        if operand.dtype != a.dtype {
            return Err(TensorError::DtypeMismatch {
                op: "binary",
                lhs: a.dtype,
                rhs: operand.dtype,
            });
        }
    }
    let suffix = float_suffix("binary", a.dtype)?;
    let args = strided_args("binary", &[&out, &a, &b])?;
    if args.numel == 0 {
        return Ok(());
    }
    let code: i32 = match op {
        BinaryOp::Add => 0,
        BinaryOp::Sub => 1,
        BinaryOp::Mul => 2,
        BinaryOp::Div => 3,
        BinaryOp::Pow => 4,
        BinaryOp::ReluBackward => 5,
        BinaryOp::GeluBackward => 6,
        BinaryOp::GeluTanhBackward => 7,
        BinaryOp::TanhBackward => 8,
        BinaryOp::SqrtBackward => 9,
        BinaryOp::RsqrtBackward => 10,
    };
    let (a_ptr, b_ptr, out_ptr) = (device_address(&a), device_address(&b), device_address(&out));
    if let Some([out_at, a_at, b_at]) = dense_addresses(
        &args,
        &[out_ptr, a_ptr, b_ptr],
        a.dtype.size_in_bytes(),
        VECTOR_ALIGNMENT,
    ) {
        let params = [
            Param::I32(code),
            Param::U64(a_at),
            Param::U64(b_at),
            Param::U64(out_at),
            Param::U64(args.numel),
        ];
        return launch_dense(
            backend,
            "binary",
            ("binary_dense", suffix),
            &args,
            a.dtype,
            &params,
        );
    }
    let params = [
        Param::I32(code),
        Param::U64(a_ptr),
        Param::U64(b_ptr),
        Param::U64(out_ptr),
    ];
    launch(backend, "binary", ("binary", suffix), args, &params)
}

pub(crate) fn masked(
    backend: &CudaBackend,
    op: MaskedOp,
    x: View<'_>,
    mask: View<'_>,
    out: View<'_>,
) -> Result<()> {
    if x.dtype != out.dtype {
        return Err(TensorError::DtypeMismatch {
            op: "masked",
            lhs: x.dtype,
            rhs: out.dtype,
        });
    }
    if !matches!(mask.dtype, DType::Bool | DType::U8) {
        return Err(TensorError::UnsupportedDtype {
            op: "masked",
            dtype: mask.dtype,
        });
    }
    let suffix = float_suffix("masked", x.dtype)?;
    let args = strided_args("masked", &[&out, &x, &mask])?;
    if args.numel == 0 {
        return Ok(());
    }
    let (code, scalar) = match op {
        MaskedOp::Fill(c) => (0i32, c),
        MaskedOp::Scale(c) => (1i32, c),
    };
    let params = [
        Param::I32(code),
        Param::F64(scalar),
        Param::U64(device_address(&x)),
        Param::U64(device_address(&mask)),
        Param::U64(device_address(&out)),
    ];
    launch(backend, "masked", ("masked", suffix), args, &params)
}

pub(crate) fn fill(backend: &CudaBackend, dst: View<'_>, value: f64) -> Result<()> {
    let args = strided_args("fill", &[&dst])?;
    if args.numel == 0 {
        return Ok(());
    }
    let out_ptr = device_address(&dst);
    // The value's bit pattern in the destination dtype.
    let bits: u64 = match dst.dtype {
        DType::F32 => u64::from((value as f32).to_bits()),
        DType::F64 => value.to_bits(),
        DType::F16 => u64::from(half::f16::from_f64(value).to_bits()),
        DType::BF16 => u64::from(half::bf16::from_f64(value).to_bits()),
        DType::I64 => value as i64 as u64,
        DType::I32 => u64::from(value as i32 as u32),
        DType::U8 => u64::from(value as u8),
        DType::Bool => u64::from(value != 0.0),
        DType::F8E4M3 => u64::from(float8::F8E4M3::from_f64(value).to_bits()),
        DType::F8E5M2 => u64::from(float8::F8E5M2::from_f64(value).to_bits()),
    };
    if let Some([at, _, _]) = dense_addresses(&args, &[out_ptr], dst.dtype.size_in_bytes(), 1) {
        if dst.dtype.size_in_bytes() <= 4 {
            return memset(backend, at, bits, dst.dtype.size_in_bytes(), args.numel);
        }
    }
    let (name, value) = match dst.dtype.size_in_bytes() {
        8 => (("fill_b8", ""), Param::U64(bits)),
        4 => (("fill_b4", ""), Param::U32(bits as u32)),
        2 => (("fill_b2", ""), Param::U16(bits as u16)),
        _ => (("fill_b1", ""), Param::U8(bits as u8)),
    };
    launch(backend, "fill", name, args, &[value, Param::U64(out_ptr)])
}

pub(crate) fn copy(backend: &CudaBackend, src: View<'_>, dst: View<'_>) -> Result<()> {
    let args = strided_args("copy", &[&dst, &src])?;
    if args.numel == 0 {
        return Ok(());
    }
    let (src_ptr, dst_ptr) = (device_address(&src), device_address(&dst));
    let name = if src.dtype == dst.dtype {
        let element = dst.dtype.size_in_bytes();
        if let Some([dst_at, src_at, _]) = dense_addresses(&args, &[dst_ptr, src_ptr], element, 1) {
            let bytes = args.numel * element as u64;
            if src_at == dst_at {
                return Ok(());
            }
            if src_at + bytes <= dst_at || dst_at + bytes <= src_at {
                return copy_bytes(backend, src_at, dst_at, bytes);
            }
        }
        copy_kernel(element)
    } else {
        (cast_names(src.dtype).0, cast_names(dst.dtype).1)
    };
    launch(
        backend,
        "copy",
        name,
        args,
        &[Param::U64(src_ptr), Param::U64(dst_ptr)],
    )
}

/// 16-byte alignment: what the vectorised dense kernels need of every operand.
const VECTOR_ALIGNMENT: u64 = 16;

/// Launches a dense (16-byte vectorised) kernel over `args.numel` elements of `dtype`.
fn launch_dense(
    backend: &CudaBackend,
    op: &'static str,
    name: KernelName,
    args: &StridedArgs,
    dtype: DType,
    params: &[Param],
) -> Result<()> {
    let per_thread = (16 / dtype.size_in_bytes().max(1)) as u64;
    launch_in(
        backend,
        Module::Elementwise,
        op,
        name,
        launch_config(args.numel.div_ceil(per_thread)),
        params,
        NO_ARGS,
    )
}

/// `count` elements of `element_bytes` (1, 2 or 4) at `address` set to the low bits of `bits`, by
/// the driver's stream-ordered memset.
fn memset(
    backend: &CudaBackend,
    address: u64,
    bits: u64,
    element_bytes: usize,
    count: u64,
) -> Result<()> {
    backend.bind("fill")?;
    let stream = backend.stream.cu_stream();
    let count = count as usize;
    // SAFETY: `address .. address + count · element_bytes` is the dense destination view, which
    // the core checked lies inside its live buffer; the memset is ordered on the backend's stream.
    let status = unsafe {
        match element_bytes {
            4 => driver_sys::cuMemsetD32Async(address, bits as u32, count, stream),
            2 => driver_sys::cuMemsetD16Async(address, bits as u16, count, stream),
            _ => driver_sys::cuMemsetD8Async(address, bits as u8, count, stream),
        }
    };
    status.result().map_err(|e| device_error("fill", e))
}

/// Copies `bytes` from `src` to `dst` (device addresses) in stream order, by the driver's copy.
fn copy_bytes(backend: &CudaBackend, src: u64, dst: u64, bytes: u64) -> Result<()> {
    backend.bind("copy")?;
    // SAFETY: both ranges are dense views the core checked against their live buffers, and the
    // caller checked that they do not overlap; the copy is ordered on the backend's stream.
    unsafe {
        cudarc::driver::result::memcpy_dtod_async(
            dst,
            src,
            bytes as usize,
            backend.stream.cu_stream(),
        )
    }
    .map_err(|e| device_error("copy", e))
}

/// Launches `name` of the elementwise module with `params`, then `args`, as its parameters.
fn launch(
    backend: &CudaBackend,
    op: &'static str,
    name: KernelName,
    args: StridedArgs,
    params: &[Param],
) -> Result<()> {
    launch_strided(backend, Module::Elementwise, op, name, args, params)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every cast between two dtypes, the 8-bit floats among them, names a kernel of the module.
    #[test]
    fn every_cast_names_a_kernel_of_the_module() {
        let ptx = Module::Elementwise.ptx();
        let all = [
            DType::F32,
            DType::F64,
            DType::F16,
            DType::BF16,
            DType::I64,
            DType::I32,
            DType::U8,
            DType::Bool,
            DType::F8E4M3,
            DType::F8E5M2,
        ];
        for from in all {
            for to in all {
                let entry = format!(".entry {}_{}(", cast_names(from).0, cast_names(to).1);
                assert!(ptx.contains(&entry), "no {entry}");
            }
        }
    }
}
