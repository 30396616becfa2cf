//! Offload: saved tensors go to pinned host memory during the forward and come back, prefetched,
//! ahead of the backward that needs them.
//!
//! [`offload`] runs a region (any closure from tensors to tensors) once, as one *group*;
//! [`OffloadBlocks`] is an nn [`BlockRunner`] that runs each block of a model as a group and
//! offloads the selected ones. While a group runs, a saved-tensor pack hook decides per save:
//!
//! - **Kept on the device**: a tensor whose storage is smaller than
//!   [`OffloadOptions::min_bytes`] (layer norm's `mean`/`rstd`, attention's log-sum-exp: the
//!   copies would cost more in overhead than they free), a non-float tensor (masks, indices), and
//!   a parameter — a leaf that requires grad ([`SaveSite::parameter`]; a linear saves its
//!   weight): its memory outlives the step, so copying it would free nothing. Every save of a
//!   block that is not selected is kept too.
//! - **Offloaded**, otherwise: the tensor's whole storage is copied once (the views of one
//!   storage, such as attention's q, k and v of one packed projection, share the copy) into a
//!   range of the pool's pinned memory, device → host on a side stream. The copy waits on the
//!   device for the compute stream's work queued so far (which produced the tensor); the host
//!   never waits. The device memory stays lent to the copy until the group
//!   [`OffloadOptions::release_after_blocks`] groups later has run its forward; then the compute
//!   stream waits for the copy on the device (ops-cuda's `InFlight`) and the memory is given back,
//!   reusable at once in stream order. A copy the host finds complete before that (an event
//!   query, not a wait) gives its memory back at once.
//!
//! In backward, the first unpack of a group's tensors starts the host → device copies of the
//! group itself (last saved first, in the order backward needs them) and of the
//! [`OffloadOptions::prefetch_blocks`] groups before it, so their copies overlap this group's
//! backward. An unpack makes the compute stream wait for its own storage's copy only (a stream
//! wait, not a host wait). A storage whose copy to the host was still in flight when backward
//! reached it is used where it is, with no copy back. Restored storages are freed after their
//! last use, as saved tensors are without offload. A tensor written in place after its save still
//! fails its unpack with autograd's version error (the version check is the saved tensor's own,
//! done before the hook runs).
//!
//! The pinned memory comes from an [`OffloadPool`]: chunks from the backend's pinned caching
//! allocator, handed out in save order and handed out again from the start once every range is
//! free (between training steps), so the first step allocates them and later steps reuse them
//! byte for byte. One pool belongs to one CUDA device; clones of an [`OffloadOptions`] share it.
//!
//! What to offload is a bandwidth question: a copy engine moves roughly 50 GB/s each way, so a
//! group's copies take longer than its forward when it saves more than 50 MB per millisecond of
//! forward (ViT-L/16 at batch 32 saves about 0.41 GB a block in 3.7 ms). Offload the first
//! blocks: their copies to the host have the whole rest of the forward to run, and backward
//! needs them last, after the other blocks' backward has freed memory for their prefetch.
//!
//! Offload needs a CUDA device: a save on another device, or a crate built without the `cuda`
//! feature, is [`CheckpointError::OffloadNeedsCuda`] (nothing is silently kept). This module sits
//! on autograd-core's saved-tensor hooks and nn's block seam; the device work (`offload/cuda.rs`)
//! sits on ops-cuda's pinned buffers, streams and in-flight copies.

#[cfg(feature = "cuda")]
use std::sync::Arc;

#[cfg(feature = "cuda")]
use headroom_autograd_core::SaveSite;
use headroom_autograd_core::{is_grad_enabled, Device, Tensor, TensorError};
use headroom_nn::{BlockForward, BlockRunner};

use crate::blocks::{nn_to_tensor, BlockSelection};
use crate::error::CheckpointError;

#[cfg(feature = "cuda")]
mod cuda;

/// How [`offload`] and [`OffloadBlocks`] treat saved tensors.
#[derive(Debug, Clone)]
pub struct OffloadOptions {
    /// Storages smaller than this stay on the device.
    pub min_bytes: u64,
    /// In backward, how many groups (blocks, or [`offload`] regions) before the one being
    /// differentiated have their copies back to the device started: 0 copies a group back only
    /// when backward reaches it.
    pub prefetch_blocks: usize,
    /// How many later groups' forwards a group's copies to the host may overlap before the
    /// compute stream waits for them and their device memory is given back: 0 gives it back at
    /// the end of the group's own forward (the compute stream waits for the whole copy there).
    pub release_after_blocks: usize,
    /// The pinned memory and the copy streams.
    pub pool: OffloadPool,
}

impl Default for OffloadOptions {
    /// Storages of 1 MiB and more; prefetch two groups ahead; copies to the host may overlap two
    /// later groups; a new pool.
    fn default() -> Self {
        OffloadOptions {
            min_bytes: 1 << 20,
            prefetch_blocks: 2,
            release_after_blocks: 2,
            pool: OffloadPool::new(),
        }
    }
}

/// Pinned host memory for offloaded tensors, the two copy streams (to the host, to the device),
/// and what went through them. Cloning it shares the pool.
#[derive(Clone, Default)]
pub struct OffloadPool {
    #[cfg(feature = "cuda")]
    shared: Arc<cuda::Pool>,
}

impl std::fmt::Debug for OffloadPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OffloadPool")
            .field("stats", &self.stats())
            .finish()
    }
}

impl OffloadPool {
    /// An empty pool: it takes its device from the first tensor it offloads.
    pub fn new() -> OffloadPool {
        OffloadPool::default()
    }

    /// What the pool holds and what it has copied so far.
    pub fn stats(&self) -> OffloadStats {
        #[cfg(feature = "cuda")]
        {
            self.shared.stats()
        }
        #[cfg(not(feature = "cuda"))]
        {
            OffloadStats::default()
        }
    }
}

/// An [`OffloadPool`]'s figures: exact bytes and counts since it was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OffloadStats {
    /// Pinned bytes the pool holds (its chunks, as the pinned allocator reserved them).
    pub pinned_bytes: u64,
    /// Pinned chunks allocated (each a pinned allocation; after the first step, none).
    pub pinned_allocations: u64,
    /// Pinned bytes handed out to storages now alive.
    pub pinned_in_use: u64,
    /// Saves offloaded (their storage copied, or shared with another save's copy).
    pub offloaded_saves: u64,
    /// Saves kept on the device (small, non-float, parameters, or in a block not selected).
    pub kept_saves: u64,
    /// Bytes copied to the host.
    pub bytes_to_host: u64,
    /// Bytes copied back to the device.
    pub bytes_to_device: u64,
    /// Bytes whose copy to the host was still in flight when backward needed them, used on the
    /// device with no copy back.
    pub bytes_used_in_place: u64,
    /// Device bytes lent to copies to the host now (not yet given back).
    pub bytes_in_flight: u64,
    /// Storages given back after the compute stream was made to wait for their copy (the copy
    /// was not seen complete by then).
    pub ordered_releases: u64,
    /// Storages given back because the host saw their copy complete.
    pub completed_releases: u64,
}

/// Runs `region` on `inputs` once, offloading what its ops save for backward to pinned host
/// memory (see the module docs for which saves, and how they come back).
///
/// The region is one group of the options' pool: its device memory is given back once
/// [`OffloadOptions::release_after_blocks`] more regions (or blocks) of the same pool have run,
/// or as soon as a later save finds its copies complete. A region offloaded on its own frees
/// memory before backward only with `release_after_blocks: 0` (the compute stream then waits for
/// its copies at the region's end); otherwise its storages stay on the device and backward uses
/// them there.
///
/// An error, never a silent fallback, when the tensors are not on a CUDA device or the crate was
/// built without its `cuda` feature:
///
/// ```
/// use headroom_autograd_core::{DType, Tensor};
/// use headroom_checkpoint::{offload, CheckpointError, OffloadOptions};
///
/// let cpu = headroom_ops_cpu::CpuBackend::new_ref();
/// let x = Tensor::ones(&cpu, &[4, 4], DType::F32)?;
/// x.requires_grad_(true)?;
/// let res = offload(|xs| Ok(vec![xs[0].exp()?]), &[x], &OffloadOptions::default());
/// assert!(matches!(res, Err(CheckpointError::OffloadNeedsCuda { .. })));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn offload(
    region: impl FnOnce(&[Tensor]) -> Result<Vec<Tensor>, TensorError>,
    inputs: &[Tensor],
    options: &OffloadOptions,
) -> Result<Vec<Tensor>, CheckpointError> {
    if !is_grad_enabled() {
        return region(inputs).map_err(CheckpointError::from_engine);
    }
    check_devices(inputs)?;
    run_group(options, true, || region(inputs))
}

/// Runs a model's blocks, offloading the saved tensors of the selected ones (an nn
/// [`BlockRunner`]). Every block runs as a group of the options' pool, so the blocks that are not
/// selected start the prefetch of the offloaded ones below them in backward.
#[derive(Debug, Clone)]
pub struct OffloadBlocks {
    /// The blocks to offload.
    pub selection: BlockSelection,
    /// How.
    pub options: OffloadOptions,
}

impl OffloadBlocks {
    /// The `selection`, with the default options.
    pub fn new(selection: BlockSelection) -> OffloadBlocks {
        OffloadBlocks {
            selection,
            options: OffloadOptions::default(),
        }
    }
}

impl BlockRunner for OffloadBlocks {
    fn run(
        &self,
        index: usize,
        block: BlockForward,
        input: &Tensor,
    ) -> headroom_nn::Result<Tensor> {
        if !is_grad_enabled() {
            return block(input);
        }
        let selected = self.selection.contains(index);
        if selected {
            check_devices(std::slice::from_ref(input)).map_err(CheckpointError::into_nn_error)?;
        } else if !cfg!(feature = "cuda") {
            return block(input);
        }
        let outputs = run_group(&self.options, selected, || {
            Ok(vec![block(input).map_err(nn_to_tensor)?])
        })
        .map_err(CheckpointError::into_nn_error)?;
        Ok(outputs.into_iter().next().expect("one output"))
    }
}

/// `Ok` when every tensor is on a CUDA device and the crate can copy from it.
fn check_devices(tensors: &[Tensor]) -> Result<(), CheckpointError> {
    if !cfg!(feature = "cuda") {
        return Err(CheckpointError::OffloadNeedsCuda {
            reason: "headroom-checkpoint was built without its `cuda` feature".into(),
        });
    }
    match tensors
        .iter()
        .find(|t| !matches!(t.device(), Device::Cuda(_)))
    {
        Some(tensor) => Err(needs_cuda(tensor.device())),
        None => Ok(()),
    }
}

fn needs_cuda(device: Device) -> CheckpointError {
    CheckpointError::OffloadNeedsCuda {
        reason: format!("a tensor to offload is on {device:?}"),
    }
}

/// Whether a save is offloaded (the rules of the module docs), given its storage's bytes.
#[cfg(feature = "cuda")]
fn offloads(site: &SaveSite, storage_bytes: usize, options: &OffloadOptions) -> bool {
    site.dtype.is_float()
        && !site.is_parameter
        && storage_bytes as u64 >= options.min_bytes
        && storage_bytes.is_multiple_of(site.dtype.size_in_bytes())
}

/// Runs `run` as one group of the pool: offloading its saves if `offload`, keeping them (and
/// starting the prefetch of the groups before it in backward) otherwise.
fn run_group(
    options: &OffloadOptions,
    offload: bool,
    run: impl FnOnce() -> Result<Vec<Tensor>, TensorError>,
) -> Result<Vec<Tensor>, CheckpointError> {
    #[cfg(feature = "cuda")]
    {
        cuda::run_group(options, offload, run)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (options, run);
        debug_assert!(offload, "blocks that are not selected run directly");
        Err(CheckpointError::OffloadNeedsCuda {
            reason: "headroom-checkpoint was built without its `cuda` feature".into(),
        })
    }
}
