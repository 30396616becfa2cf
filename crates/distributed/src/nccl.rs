//! [`NcclComm`]: the [`Communicator`] over NCCL, one rank per process and GPU (feature `nccl`).
//!
//! It goes through cudarc's `nccl` module at its `result` level with `dynamic-loading`: libnccl
//! is opened at run time, when the first communicator is made, so the crate builds and its CPU
//! tests run where NCCL is not installed; a machine without it gets
//! [`DistributedError::Nccl`] from [`NcclComm::new`] and [`nccl_unique_id`], never a panic.
//! cudarc looks for `libnccl.so` (and versioned names) on the loader's path; PyTorch's wheel
//! ships `nvidia/nccl/lib/libnccl.so.2`, which a `libnccl.so` link on `LD_LIBRARY_PATH` serves.
//!
//! Collectives run on the legacy default stream, which waits for ops-cuda's compute stream (a
//! blocking stream) and makes it wait in turn: they are ordered after the kernels that wrote
//! their inputs and before those that read their outputs, and the host never waits for them, as
//! for any kernel. No cudarc type leaves this module.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use cudarc::driver::CudaContext;
use cudarc::nccl::{result, sys};
use headroom_autograd_core::{DType, Device, Tensor};
use parking_lot::Mutex;

use crate::comm::{check_buffers, Chunks, Collective, CommStats, Communicator, ReduceOp};
use crate::error::DistributedError;
use crate::rendezvous::UniqueId;

/// Communicators whose destruction failed, over the whole process (`Drop` cannot return it).
static DROP_ERRORS: AtomicU64 = AtomicU64::new(0);

/// Whether libnccl can be opened on this machine.
pub fn nccl_available() -> bool {
    // SAFETY: opening a shared library by name runs its initialisers; libnccl's have no
    // preconditions.
    unsafe { sys::is_culib_present() }
}

/// The GPUs this process sees (`cuDeviceGetCount`, after `CUDA_VISIBLE_DEVICES`): one rank each
/// on a host. An error where no CUDA driver is installed.
pub fn visible_gpus() -> Result<usize, DistributedError> {
    // SAFETY: opening the driver library by name runs its initialisers, which have no
    // preconditions.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(DistributedError::Nccl(
            "no CUDA driver (libcuda) on this machine".into(),
        ));
    }
    let count = CudaContext::device_count()
        .map_err(|err| DistributedError::Nccl(format!("cuDeviceGetCount: {err:?}")))?;
    Ok(usize::try_from(count).unwrap_or(0))
}

/// A new NCCL unique id (`ncclGetUniqueId`), for rank 0 to publish to the others.
pub fn nccl_unique_id() -> Result<UniqueId, DistributedError> {
    check_available()?;
    let id = result::get_uniqueid().map_err(|err| nccl_error("ncclGetUniqueId", err))?;
    Ok(UniqueId::from_bytes(&id.internal.map(|c| c as u8)))
}

/// One rank of an NCCL communicator, on one GPU.
pub struct NcclComm {
    comm: sys::ncclComm_t,
    context: Arc<CudaContext>,
    ordinal: usize,
    rank: usize,
    world_size: usize,
    /// Four bytes of device memory the barrier all-reduces.
    barrier_word: u64,
    stats: Mutex<CommStats>,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("ordinal", &self.ordinal)
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .finish_non_exhaustive()
    }
}

// SAFETY: an NCCL communicator may be used from any thread when calls on it are serialised;
// `call` makes every call on it under `stats`' lock, with the device's context bound first.
unsafe impl Send for NcclComm {}
// SAFETY: as above: every NCCL call on the communicator is made under `stats`' lock.
unsafe impl Sync for NcclComm {}

impl NcclComm {
    /// Joins the group `id` names as `rank` of `world_size`, on GPU `ordinal` (its primary
    /// context, which ops-cuda's backend of that ordinal shares). Blocks until every rank has
    /// joined (`ncclCommInitRank`).
    pub fn new(
        ordinal: usize,
        rank: usize,
        world_size: usize,
        id: &UniqueId,
    ) -> Result<NcclComm, DistributedError> {
        check_available()?;
        if rank >= world_size {
            return Err(DistributedError::InvalidArgument {
                op: "NcclComm::new",
                reason: format!("rank {rank} in a group of {world_size}"),
            });
        }
        let context = CudaContext::new(ordinal)
            .map_err(|err| DistributedError::Nccl(format!("CUDA device {ordinal}: {err:?}")))?;
        context
            .bind_to_thread()
            .map_err(|err| DistributedError::Nccl(format!("CUDA device {ordinal}: {err:?}")))?;
        let unique = sys::ncclUniqueId {
            internal: id.as_bytes().map(|b| b as core::ffi::c_char),
        };
        let mut comm = std::mem::MaybeUninit::uninit();
        // SAFETY: `comm` is a valid place for the handle; the id is 128 bytes; the ranks and
        // size fit in i32 (checked by the conversions).
        let comm = unsafe {
            result::comm_init_rank(
                comm.as_mut_ptr(),
                to_i32(world_size)?,
                unique,
                to_i32(rank)?,
            )
            .map_err(|err| nccl_error("ncclCommInitRank", err))?;
            comm.assume_init()
        };
        // SAFETY: the context is bound to this thread; 4 bytes, freed in `drop`.
        let barrier_word = match unsafe { cudarc::driver::result::malloc_sync(4) } {
            Ok(word) => word,
            Err(err) => {
                // SAFETY: the handle was just made and is not used again.
                if unsafe { result::comm_destroy(comm) }.is_err() {
                    DROP_ERRORS.fetch_add(1, Ordering::Relaxed);
                }
                return Err(DistributedError::Nccl(format!(
                    "cuMemAlloc of 4 bytes: {err:?}"
                )));
            }
        };
        Ok(NcclComm {
            comm,
            context,
            ordinal,
            rank,
            world_size,
            barrier_word,
            stats: Mutex::new(CommStats::default()),
        })
    }

    /// Communicators whose `ncclCommDestroy` failed in this process.
    pub fn drop_errors() -> u64 {
        DROP_ERRORS.load(Ordering::Relaxed)
    }

    /// The device address of a contiguous tensor of this communicator's GPU.
    fn address(&self, op: &'static str, tensor: &Tensor) -> Result<u64, DistributedError> {
        if tensor.device() != Device::Cuda(self.ordinal) {
            return Err(DistributedError::InvalidArgument {
                op,
                reason: format!(
                    "a tensor on {:?}; this communicator's GPU is cuda:{}",
                    tensor.device(),
                    self.ordinal
                ),
            });
        }
        let offset = tensor.layout().offset() * tensor.dtype().size_in_bytes();
        Ok(tensor.buffer().address() + offset as u64)
    }

    /// Runs one NCCL call with the context bound and the communicator held alone, and counts it.
    fn call(
        &self,
        name: &'static str,
        collective: Collective,
        bytes: usize,
        f: impl FnOnce(sys::ncclComm_t) -> Result<result::NcclStatus, result::NcclError>,
    ) -> Result<(), DistributedError> {
        let mut stats = self.stats.lock();
        self.context
            .bind_to_thread()
            .map_err(|err| DistributedError::Nccl(format!("{name}: {err:?}")))?;
        f(self.comm).map_err(|err| nccl_error(name, err))?;
        stats.record(collective, bytes as u64);
        Ok(())
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        // SAFETY: the handle came from `ncclCommInitRank` and is destroyed once, here.
        if unsafe { result::comm_destroy(self.comm) }.is_err() {
            DROP_ERRORS.fetch_add(1, Ordering::Relaxed);
        }
        let bound = self.context.bind_to_thread().is_ok();
        // SAFETY: the word came from `malloc_sync` in `new` and is freed once, here, after the
        // communicator that used it is gone.
        if !bound || unsafe { cudarc::driver::result::free_sync(self.barrier_word) }.is_err() {
            DROP_ERRORS.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<(), DistributedError> {
        let dtype = check_buffers("all_reduce", &[tensor], None)?;
        let address = self.address("all_reduce", tensor)?;
        let bytes = tensor.numel() * dtype.size_in_bytes();
        self.call("ncclAllReduce", Collective::AllReduce, bytes, |comm| {
            // SAFETY: `address` is the live, contiguous tensor of `numel` elements on this GPU;
            // the legacy default stream of the bound context is ordered with the compute stream.
            unsafe {
                result::all_reduce(
                    address as *const _,
                    address as *mut _,
                    tensor.numel(),
                    nccl_dtype(dtype),
                    nccl_op(op),
                    comm,
                    std::ptr::null_mut(),
                )
            }
        })
    }

    fn reduce_scatter(
        &self,
        input: &Tensor,
        output: &Tensor,
        op: ReduceOp,
    ) -> Result<(), DistributedError> {
        let dtype = check_buffers(
            "reduce_scatter",
            &[input, output],
            Some(Chunks {
                big: input,
                small: output,
                world_size: self.world_size,
                rank: self.rank,
            }),
        )?;
        let (src, dst) = (
            self.address("reduce_scatter", input)?,
            self.address("reduce_scatter", output)?,
        );
        let bytes = input.numel() * dtype.size_in_bytes();
        self.call(
            "ncclReduceScatter",
            Collective::ReduceScatter,
            bytes,
            |comm| {
                // SAFETY: both tensors are live and contiguous on this GPU, `input` of
                // `world_size × output.numel()` elements (checked above).
                unsafe {
                    result::reduce_scatter(
                        src as *const _,
                        dst as *mut _,
                        output.numel(),
                        nccl_dtype(dtype),
                        nccl_op(op),
                        comm,
                        std::ptr::null_mut(),
                    )
                }
            },
        )
    }

    fn all_gather(&self, input: &Tensor, output: &Tensor) -> Result<(), DistributedError> {
        let dtype = check_buffers(
            "all_gather",
            &[input, output],
            Some(Chunks {
                big: output,
                small: input,
                world_size: self.world_size,
                rank: self.rank,
            }),
        )?;
        let (src, dst) = (
            self.address("all_gather", input)?,
            self.address("all_gather", output)?,
        );
        let bytes = output.numel() * dtype.size_in_bytes();
        self.call("ncclAllGather", Collective::AllGather, bytes, |comm| {
            // SAFETY: both tensors are live and contiguous on this GPU, `output` of
            // `world_size × input.numel()` elements (checked above).
            unsafe {
                result::all_gather(
                    src as *const _,
                    dst as *mut _,
                    input.numel(),
                    nccl_dtype(dtype),
                    comm,
                    std::ptr::null_mut(),
                )
            }
        })
    }

    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<(), DistributedError> {
        let dtype = check_buffers("broadcast", &[tensor], None)?;
        if root >= self.world_size {
            return Err(DistributedError::InvalidArgument {
                op: "broadcast",
                reason: format!("root {root} in a group of {} ranks", self.world_size),
            });
        }
        let address = self.address("broadcast", tensor)?;
        let root = to_i32(root)?;
        let bytes = tensor.numel() * dtype.size_in_bytes();
        self.call("ncclBroadcast", Collective::Broadcast, bytes, |comm| {
            // SAFETY: the tensor is live and contiguous on this GPU; in place.
            unsafe {
                result::broadcast(
                    address as *const _,
                    address as *mut _,
                    tensor.numel(),
                    nccl_dtype(dtype),
                    root,
                    comm,
                    std::ptr::null_mut(),
                )
            }
        })
    }

    /// An all-reduce of one f32 element, then a wait for the device: NCCL has no barrier.
    fn barrier(&self) -> Result<(), DistributedError> {
        let (pointer, context) = (self.barrier_word, Arc::clone(&self.context));
        self.call("ncclAllReduce (barrier)", Collective::Barrier, 0, |comm| {
            // SAFETY: `barrier_word` is 4 bytes of this GPU, allocated in `new`, freed in `drop`;
            // its value is never read.
            let status = unsafe {
                result::all_reduce(
                    pointer as *const _,
                    pointer as *mut _,
                    1,
                    sys::ncclDataType_t::ncclFloat32,
                    sys::ncclRedOp_t::ncclSum,
                    comm,
                    std::ptr::null_mut(),
                )
            }?;
            match context.synchronize() {
                Ok(()) => Ok(status),
                Err(_) => Err(result::NcclError(sys::ncclResult_t::ncclUnhandledCudaError)),
            }
        })
    }

    fn stats(&self) -> CommStats {
        *self.stats.lock()
    }
}

fn check_available() -> Result<(), DistributedError> {
    if nccl_available() {
        Ok(())
    } else {
        Err(DistributedError::Nccl(
            "libnccl.so was not found on the loader's path; install NCCL, or link PyTorch's \
             nvidia/nccl/lib/libnccl.so.2 as libnccl.so into a folder on LD_LIBRARY_PATH"
                .into(),
        ))
    }
}

fn nccl_error(call: &'static str, err: result::NcclError) -> DistributedError {
    DistributedError::Nccl(format!("{call} failed: {err:?}"))
}

fn to_i32(value: usize) -> Result<i32, DistributedError> {
    i32::try_from(value).map_err(|_| DistributedError::InvalidArgument {
        op: "NcclComm",
        reason: format!("{value} does not fit NCCL's int"),
    })
}

fn nccl_dtype(dtype: DType) -> sys::ncclDataType_t {
    match dtype {
        DType::F64 => sys::ncclDataType_t::ncclFloat64,
        DType::F16 => sys::ncclDataType_t::ncclFloat16,
        DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
        // `check_buffers` admits float dtypes only.
        _ => sys::ncclDataType_t::ncclFloat32,
    }
}

fn nccl_op(op: ReduceOp) -> sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
    }
}
