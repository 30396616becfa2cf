//! Launches of `kernels/elementwise.cu`: strided copy/cast, fill, unary, binary and masked ops.
//!
//! Operands are described to the kernels by one `StridedArgs` (shape, per-operand strides and
//! offsets, in elements), after merging dimensions that are contiguous in every operand so most
//! launches see one or two dimensions. Op codes are the variant order of `UnaryOp` and
//! `BinaryOp`, mirrored by the `switch` statements of the `.cu` file.

use cudarc::driver::sys::{self as driver_sys, CUfunction_attribute_enum};
use cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use headroom_autograd_core::{
    BinaryOp, DType, Layout, MaskedOp, Result, TensorError, UnaryOp, View,
};

use crate::backend::{device_error, CudaBackend};
use crate::kernels::{KernelName, Module};

/// The kernels' dimension limit (`MAX_DIMS` in the `.cu` file).
const MAX_DIMS: usize = 8;
const THREADS: u32 = 256;
/// Enough blocks to fill an H100/H200 several times over; the kernels loop over the rest.
const MAX_BLOCKS: u64 = 132 * 32;

/// `StridedArgs` of `elementwise.cu`, field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct StridedArgs {
    ndim: u32,
    n_operands: u32,
    pub(crate) numel: u64,
    shape: [u64; MAX_DIMS],
    strides: [[u64; MAX_DIMS]; 3],
    offsets: [u64; 3],
}

// SAFETY: `StridedArgs` is `repr(C)`, plain integers only, and matches the layout of the struct
// of the same name in `kernels/elementwise.cu` (u32, u32, then u64 fields: no padding).
unsafe impl DeviceRepr for StridedArgs {}

/// Describes `views` (one shape, the first being the output) to the kernels, merging dimensions
/// that are contiguous in all of them.
pub(crate) fn strided_args(op: &'static str, views: &[&View<'_>]) -> Result<StridedArgs> {
    let layouts: Vec<&Layout> = views.iter().map(|view| view.layout).collect();
    strided_layout_args(op, &layouts)
}

/// [`strided_args`] for bare layouts (the first being the output's).
pub(crate) fn strided_layout_args(op: &'static str, views: &[&Layout]) -> Result<StridedArgs> {
    let shape = views[0].shape();
    for view in &views[1..] {
        if view.shape() != shape {
            return Err(TensorError::ShapeMismatch {
                op,
                lhs: shape.to_vec(),
                rhs: view.shape().to_vec(),
            });
        }
    }
    // Drop size-1 dims, then merge a dim into the next when every operand steps over it as if
    // the two were one.
    let mut dims: Vec<(u64, [u64; 3])> = Vec::with_capacity(shape.len());
    for (d, &size) in shape.iter().enumerate() {
        if size == 1 {
            continue;
        }
        let mut strides = [0u64; 3];
        for (k, view) in views.iter().enumerate() {
            strides[k] = view.strides()[d] as u64;
        }
        if let Some((last_size, last_strides)) = dims.last_mut() {
            let mergeable = (0..views.len()).all(|k| last_strides[k] == strides[k] * size as u64);
            if mergeable {
                *last_size *= size as u64;
                *last_strides = strides;
                continue;
            }
        }
        dims.push((size as u64, strides));
    }
    if dims.len() > MAX_DIMS {
        return Err(TensorError::InvalidArgument {
            op,
            reason: format!(
                "{} non-mergeable dimensions; the CUDA kernels take {MAX_DIMS}",
                dims.len()
            ),
        });
    }
    let mut args = StridedArgs {
        ndim: dims.len() as u32,
        n_operands: views.len() as u32,
        numel: shape.iter().product::<usize>() as u64,
        shape: [1; MAX_DIMS],
        strides: [[0; MAX_DIMS]; 3],
        offsets: [0; 3],
    };
    for (d, (size, strides)) in dims.iter().enumerate() {
        args.shape[d] = *size;
        for (operand, &stride) in args.strides.iter_mut().zip(strides) {
            operand[d] = stride;
        }
    }
    for (k, view) in views.iter().enumerate() {
        args.offsets[k] = view.offset() as u64;
    }
    Ok(args)
}

pub(crate) fn launch_config(numel: u64) -> LaunchConfig {
    let blocks = numel.div_ceil(u64::from(THREADS)).clamp(1, MAX_BLOCKS) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

pub(crate) fn float_suffix(op: &'static str, dtype: DType) -> Result<&'static str> {
    Ok(match dtype {
        DType::F32 => "f32",
        DType::F64 => "f64",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        other => return Err(TensorError::UnsupportedDtype { op, dtype: other }),
    })
}

fn any_suffix(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "f32",
        DType::F64 => "f64",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        DType::I64 => "i64",
        DType::I32 => "i32",
        DType::U8 => "u8",
        DType::Bool => "bool",
    }
}

/// The family of cast kernels from `dtype` (`cast_f32`, ...), completed by the target's suffix.
fn cast_family(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "cast_f32",
        DType::F64 => "cast_f64",
        DType::F16 => "cast_f16",
        DType::BF16 => "cast_bf16",
        DType::I64 => "cast_i64",
        DType::I32 => "cast_i32",
        DType::U8 => "cast_u8",
        DType::Bool => "cast_bool",
    }
}

/// The bit-moving copy kernel for elements of `bytes` bytes.
fn copy_kernel(bytes: usize) -> KernelName {
    match bytes {
        8 => ("copy_b8", ""),
        4 => ("copy_b4", ""),
        2 => ("copy_b2", ""),
        _ => ("copy_b1", ""),
    }
}

fn device_address(view: &View<'_>) -> u64 {
    view.buffer.address()
}

/// The device address of `view`'s first element (its buffer's address plus the layout's offset):
/// what kernels and libraries that take one pointer per operand are given.
pub(crate) fn element_address(view: &View<'_>) -> u64 {
    view.buffer.address() + (view.layout.offset() * view.dtype.size_in_bytes()) as u64
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
        (cast_family(src.dtype), any_suffix(dst.dtype))
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

/// The operands' first-element addresses (in `args`' order, output first; elements of
/// `element_bytes`) when each is one dense run (stride 1) starting at a multiple of `alignment`:
/// the dense fast path's case.
fn dense_addresses(
    args: &StridedArgs,
    bases: &[u64],
    element_bytes: usize,
    alignment: u64,
) -> Option<[u64; 3]> {
    if args.ndim != 1 {
        return None;
    }
    let element = element_bytes as u64;
    let mut addresses = [0u64; 3];
    for (k, &base) in bases.iter().enumerate() {
        let address = base + args.offsets[k] * element;
        if args.strides[k][0] != 1 || !address.is_multiple_of(alignment) {
            return None;
        }
        addresses[k] = address;
    }
    Some(addresses)
}

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

/// A scalar kernel parameter (device addresses are `U64`).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Param {
    I32(i32),
    I64(i64),
    F32(f32),
    F64(f64),
    U64(u64),
    U32(u32),
    U16(u16),
    U8(u8),
}

/// Launches `name` of the elementwise module with `params`, then `args`, as its parameters.
fn launch(
    backend: &CudaBackend,
    op: &'static str,
    name: KernelName,
    args: StridedArgs,
    params: &[Param],
) -> Result<()> {
    launch_in(
        backend,
        Module::Elementwise,
        op,
        name,
        launch_config(args.numel),
        params,
        Some(args),
    )
}

/// Dynamic shared memory a kernel gets without opting in (48 KiB).
const DEFAULT_SHARED_BYTES: u32 = 48 << 10;

/// No trailing struct argument, for [`launch_in`].
pub(crate) const NO_ARGS: Option<u64> = None;

/// Launches `name` of `module` with `config`, `params` and then `args` (if any) as parameters.
pub(crate) fn launch_in<A: DeviceRepr>(
    backend: &CudaBackend,
    module: Module,
    op: &'static str,
    name: KernelName,
    config: LaunchConfig,
    params: &[Param],
    args: Option<A>,
) -> Result<()> {
    backend.bind(op)?;
    let function = backend
        .kernels
        .function(&backend.context, module, name)
        .map_err(|e| device_error(op, e))?;
    if config.shared_mem_bytes > DEFAULT_SHARED_BYTES
        && backend
            .kernels
            .needs_shared_opt_in(name, config.shared_mem_bytes)
    {
        // Kernels asking for more than the default dynamic shared memory must opt in (once per
        // kernel and size, not on every launch).
        function
            .set_attribute(
                CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                config.shared_mem_bytes as i32,
            )
            .map_err(|e| device_error(op, e))?;
        backend
            .kernels
            .note_shared_opt_in(name, config.shared_mem_bytes);
    }
    let mut builder = backend.stream.launch_builder(&function);
    for param in params {
        match param {
            Param::I32(v) => builder.arg(v),
            Param::I64(v) => builder.arg(v),
            Param::F32(v) => builder.arg(v),
            Param::F64(v) => builder.arg(v),
            Param::U64(v) => builder.arg(v),
            Param::U32(v) => builder.arg(v),
            Param::U16(v) => builder.arg(v),
            Param::U8(v) => builder.arg(v),
        };
    }
    if let Some(args) = &args {
        builder.arg(args);
    }
    // SAFETY: the kernel's parameters are, in order, exactly `params` (scalars and
    // device addresses of live buffers whose views were checked to have this shape) followed by
    // `StridedArgs`, whose layout matches the `.cu` definition; every offset the kernel computes
    // lies inside the views' storage extents, which the core checked against the buffers.
    unsafe { builder.launch(config) }
        .map(|_| ())
        .map_err(|e| device_error(op, e))
}

/// Copies the elements of `src_layout` at device address `src` (element size `element_bytes`)
/// into the dense layout `dst_layout` at `dst`: for operands a library call needs contiguous.
pub(crate) fn copy_raw(
    backend: &CudaBackend,
    src: u64,
    src_layout: &Layout,
    dst: u64,
    dst_layout: &Layout,
    element_bytes: usize,
) -> Result<()> {
    let args = strided_layout_args("copy", &[dst_layout, src_layout])?;
    if args.numel == 0 {
        return Ok(());
    }
    let name = copy_kernel(element_bytes);
    launch(
        backend,
        "copy",
        name,
        args,
        &[Param::U64(src), Param::U64(dst)],
    )
}
