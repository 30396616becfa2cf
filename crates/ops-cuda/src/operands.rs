//! Operands as kernels and libraries take them: the strided description of `elementwise.cu` and
//! `index.cu` ([`StridedArgs`]: shape, per-operand strides and offsets, in elements, after
//! merging dimensions that are contiguous in every operand, so most launches see one or two
//! dimensions), the dense fast path's test, a view's first-element address, and the dense copy
//! of a strided operand for library calls that need one ([`copy_raw`]), and the operand check
//! every primitive runs first ([`check`]).
//!
//! This module is ground floor: it sits on `device.rs`, `kernels.rs` and `launch.rs` (the copy
//! launches `elementwise.cu`'s bit-moving kernels), and knows no kernel family.

use cudarc::driver::DeviceRepr;
use headroom_autograd_core::{check_operands, Aliasing, Layout, Result, TensorError, View};

use crate::device::CudaBackend;
use crate::kernels::{KernelName, Module};
use crate::launch::{launch_config, launch_in, Param};

/// Checks a primitive's operands against autograd-core's rules with this backend's allocator as
/// their owner (`check_operands`: each view inside its buffer, memory of this device's allocator,
/// no output reaching an element twice, no output sharing memory with another operand except as
/// the same view of an elementwise primitive). Every primitive calls it first: the kernels index
/// with the views as given and write outputs from many threads at once.
pub(crate) fn check(
    backend: &CudaBackend,
    op: &'static str,
    writes: &[View<'_>],
    reads: &[View<'_>],
    aliasing: Aliasing,
) -> Result<()> {
    check_operands(backend.allocator().id(), op, writes, reads, aliasing)
}

/// The kernels' dimension limit (`MAX_DIMS` in `kernels/strided.cuh`).
const MAX_DIMS: usize = 8;

/// `StridedArgs` of `kernels/strided.cuh` (included by `elementwise.cu` and `index.cu`), field
/// for field.
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
// of the same name in `kernels/strided.cuh` (u32, u32, then u64 fields: no padding).
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
            let mergeable = (0..views.len())
                .all(|k| strides[k].checked_mul(size as u64) == Some(last_strides[k]));
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

/// The operands' first-element addresses (in `args`' order, output first; elements of
/// `element_bytes`) when each is one dense run (stride 1) starting at a multiple of `alignment`:
/// the dense fast path's case.
pub(crate) fn dense_addresses(
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

/// The device address of `view`'s first element (its buffer's address plus the layout's offset):
/// what kernels and libraries that take one pointer per operand are given.
pub(crate) fn element_address(view: &View<'_>) -> u64 {
    view.buffer.address() + (view.layout.offset() * view.dtype.size_in_bytes()) as u64
}

/// The bit-moving copy kernel for elements of `bytes` bytes.
pub(crate) fn copy_kernel(bytes: usize) -> KernelName {
    match bytes {
        8 => ("copy_b8", ""),
        4 => ("copy_b4", ""),
        2 => ("copy_b2", ""),
        _ => ("copy_b1", ""),
    }
}

/// Launches `name` of `module` over the elements `args` describes, with `params`, then `args`, as
/// its parameters.
pub(crate) fn launch_strided(
    backend: &CudaBackend,
    module: Module,
    op: &'static str,
    name: KernelName,
    args: StridedArgs,
    params: &[Param],
) -> Result<()> {
    launch_in(
        backend,
        module,
        op,
        name,
        launch_config(args.numel),
        params,
        Some(args),
    )
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
    launch_strided(
        backend,
        Module::Elementwise,
        "copy",
        name,
        args,
        &[Param::U64(src), Param::U64(dst)],
    )
}
