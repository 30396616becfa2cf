//! Launching kernels: this crate's own ([`launch_in`], with [`Param`]s and an optional argument
//! struct), and other crates' (load a PTX module, launch its functions).
//!
//! Every kernel family launches through `launch_in`: it binds the context, looks the function up
//! in the kernel cache (`kernels.rs`), opts it in to more than 48 KiB of dynamic shared memory
//! when the launch asks for it (once per kernel and size), and queues it on the backend's stream.
//! [`launch_config`] is the grid-stride shape most elementwise-like kernels share.
//!
//! Crates with CUDA kernels of their own (the optimizers' fused and 8-bit updates) commit PTX
//! built by `cargo xtask build-kernels` and run it here, on the backend's context and stream,
//! with memory from its caching allocator. Arguments are plain values and device addresses, so
//! no cudarc type crosses the crate boundary.
//!
//! This module is ground floor: it sits on `device.rs` and `kernels.rs`, and knows no kernel
//! family or operand layout (argument structs are opaque `DeviceRepr` values to it).

use cudarc::driver::sys::CUfunction_attribute_enum;
use cudarc::driver::{result, CudaFunction, DeviceRepr, LaunchConfig, PushKernelArg};
use headroom_autograd_core::{Result, TensorError};
use headroom_caching_allocator::{Allocation, StreamId};

use crate::device::CudaBackend;
use crate::error::{device_error, CudaError};
use crate::kernels::{KernelName, Module};

/// Threads per block of the grid-stride launches ([`launch_config`]).
const THREADS: u32 = 256;
/// Enough blocks to fill an H100/H200 several times over; the kernels loop over the rest.
const MAX_BLOCKS: u64 = 132 * 32;

/// The grid-stride launch shape over `numel` elements: 256 threads a block, blocks enough to
/// cover them up to a few waves of the device.
pub(crate) fn launch_config(numel: u64) -> LaunchConfig {
    let blocks = numel.div_ceil(u64::from(THREADS)).clamp(1, MAX_BLOCKS) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A grid of `x × y × z` blocks, checked against CUDA's limits (2³¹ − 1 blocks along x, 65 535
/// along y and z): a launch beyond them is a typed error naming `op`, never a truncated grid.
pub(crate) fn checked_grid(op: &'static str, x: u64, y: u64, z: u64) -> Result<(u32, u32, u32)> {
    const MAX_X: u64 = (1 << 31) - 1;
    const MAX_YZ: u64 = 65_535;
    if x > MAX_X || y > MAX_YZ || z > MAX_YZ {
        return Err(TensorError::InvalidArgument {
            op,
            reason: format!(
                "a launch of {x} × {y} × {z} blocks is beyond CUDA's grid limits \
                 (2^31 − 1 × 65 535 × 65 535); split the tensor into smaller pieces"
            ),
        });
    }
    Ok((x as u32, y as u32, z as u32))
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
    // `args` when given (`StridedArgs`, `RowArgs`, `AttnArgs`), whose layout matches the `.cu`
    // definition; every offset the kernel computes lies inside the views' storage extents, which
    // the core checked against the buffers.
    unsafe { builder.launch(config) }
        .map(|_| ())
        .map_err(|e| device_error(op, e))
}

/// A loaded kernel of another crate's PTX module.
#[derive(Debug, Clone)]
pub struct CudaKernel {
    name: String,
    function: CudaFunction,
}

/// One kernel argument: a scalar or a device address (`U64`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KernelArg {
    /// `unsigned long long`, also device pointers.
    U64(u64),
    /// `long long`.
    I64(i64),
    /// `int`.
    I32(i32),
    /// `unsigned int`.
    U32(u32),
    /// `float`.
    F32(f32),
    /// `double`.
    F64(f64),
}

impl CudaBackend {
    /// Function `name` of the PTX module `module` (a `'static` name and text, loaded once per
    /// backend).
    pub fn load_kernel(
        &self,
        module: &'static str,
        ptx: &'static str,
        name: &str,
    ) -> std::result::Result<CudaKernel, CudaError> {
        self.context
            .bind_to_thread()
            .map_err(|e| CudaError::Kernel {
                kernel: name.to_owned(),
                reason: e.to_string(),
            })?;
        let function = self
            .kernels
            .external_function(&self.context, module, ptx, name)?;
        Ok(CudaKernel {
            name: name.to_owned(),
            function,
        })
    }

    /// Launches `kernel` on the backend's stream with `grid` × `block` threads, `shared_bytes`
    /// of dynamic shared memory and `args`.
    ///
    /// # Safety
    /// `args` must match the kernel's parameters in number, order and type, and every device
    /// address must point to live memory of this backend that the kernel may access as it does.
    pub unsafe fn launch_kernel(
        &self,
        kernel: &CudaKernel,
        grid: u32,
        block: u32,
        shared_bytes: u32,
        args: &[KernelArg],
    ) -> Result<()> {
        self.bind("launch_kernel")?;
        let config = LaunchConfig {
            grid_dim: (grid.max(1), 1, 1),
            block_dim: (block, 1, 1),
            shared_mem_bytes: shared_bytes,
        };
        let mut builder = self.stream.launch_builder(&kernel.function);
        for arg in args {
            match arg {
                KernelArg::U64(v) => builder.arg(v),
                KernelArg::I64(v) => builder.arg(v),
                KernelArg::I32(v) => builder.arg(v),
                KernelArg::U32(v) => builder.arg(v),
                KernelArg::F32(v) => builder.arg(v),
                KernelArg::F64(v) => builder.arg(v),
            };
        }
        // SAFETY: the caller guarantees that `args` match the kernel and address live memory.
        unsafe { builder.launch(config) }
            .map(|_| ())
            .map_err(|e| TensorError::Device {
                op: "launch_kernel",
                reason: format!("{}: {e}", kernel.name),
            })
    }

    /// Copies `bytes` into a new allocation of the backend's allocator (freed by the caller with
    /// `allocator().free`).
    pub fn upload(&self, bytes: &[u8]) -> Result<Allocation> {
        let allocation = self
            .allocator()
            .allocate(bytes.len() as u64, StreamId::DEFAULT)?;
        if !bytes.is_empty() {
            self.capture
                .refuse("upload", "copies host values into the step")?;
            self.bind("upload")?;
            // SAFETY: the allocation is live, at least `bytes.len()` long and not yet shared;
            // the synchronous copy is ordered after queued kernels on the legacy default stream.
            unsafe { result::memcpy_htod_sync(allocation.address(), bytes) }
                .map_err(|e| device_error("upload", e))?;
        }
        Ok(allocation)
    }

    /// Copies `bytes` to device address `address` in stream order (after the kernels queued so
    /// far, before those queued later) without waiting for the device; `bytes` may be dropped at
    /// once. This is how per-step launch tables reach the device without a host
    /// synchronisation; a few KiB take no copy engine (`small_copies.rs`), so they never wait
    /// behind another stream's large copy.
    ///
    /// # Safety
    /// `address .. address + bytes.len()` must be live memory of this backend until the copy has
    /// run (memory freed to the backend's allocator after this call qualifies: its reuse is
    /// stream-ordered too).
    pub unsafe fn write_async(&self, address: u64, bytes: &[u8]) -> Result<()> {
        if bytes.is_empty() {
            return Ok(());
        }
        self.capture.refuse(
            "write_async",
            "copies host values into the step (bytes the same at every replay go through \
             `write_for_replays`)",
        )?;
        // SAFETY: the caller guarantees the destination range until the copy has run.
        unsafe { self.write_in_order("write_async", address, bytes) }
    }

    /// Copies `out.len()` bytes at device address `address` to the host, after the queued work.
    ///
    /// # Safety
    /// `address .. address + out.len()` must be live memory of this backend.
    pub unsafe fn download(&self, address: u64, out: &mut [u8]) -> Result<()> {
        self.capture
            .refuse("download", "reads device values on the host")?;
        // SAFETY: the caller guarantees the range is live device memory; the read runs after the
        // queued kernels.
        unsafe { self.read_back("download", address, out) }
    }
}
