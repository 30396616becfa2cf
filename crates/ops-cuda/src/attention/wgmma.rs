//! The Hopper attention forward for f16 and bf16 (`kernels/attention_wgmma_sm90a.cu`): S = Q·Kᵀ
//! and O += P·V on `wgmma.mma_async`, Q, K and V in 128-byte-swizzled shared-memory tiles, one
//! warpgroup a block taking 64 queries and streaming keys 64 at a time. Opt-in while it is being
//! measured against the mma.sync kernels (`HEADROOM_ATTENTION_WGMMA=1`, [`WGMMA_VARIABLE`]), on a
//! device of compute capability 9.0 (the PTX is sm_90a), for what `tensor_core.rs` takes (the
//! caller checked `fits`) without packed sequences or dropout; its saved state is that path's, so
//! the mma.sync backward follows it.
//!
//! This path sits on the attention family's `args.rs` and the ground floor, and imports no other
//! path.

use std::sync::atomic::Ordering;

use cudarc::driver::LaunchConfig;
use headroom_autograd_core::{AttentionDims, AttentionForward, DType, Result};

use super::args::{address, attn_args};
use crate::device::CudaBackend;
use crate::kernels::Module;
use crate::launch::{launch_in, Param};
use crate::operands::element_address;

/// Set to `1`, the environment variable that sends f16/bf16 attention forwards to the wgmma
/// kernels on a compute capability 9.0 device.
pub(crate) const WGMMA_VARIABLE: &str = "HEADROOM_ATTENTION_WGMMA";

/// Queries a block (one warpgroup), keys a streamed tile, bytes of one swizzled 64 × 64 atom.
const ROWS: usize = 64;
const ATOM_BYTES: usize = 8192;

/// Whether `f` runs on the wgmma kernels: the variable says so, the device is Hopper, the dtype
/// 16-bit, and no packed sequences or dropout ask for what they lack.
pub(crate) fn takes(backend: &CudaBackend, f: &AttentionForward<'_>) -> bool {
    matches!(f.q.dtype, DType::BF16 | DType::F16)
        && f.packed.is_none()
        && f.dropout.is_none()
        && std::env::var(WGMMA_VARIABLE).is_ok_and(|value| value == "1")
        && backend
            .context
            .compute_capability()
            .is_ok_and(|cc| cc == (9, 0))
}

/// Forward; the caller checked `tensor_core::fits` and [`takes`].
pub(crate) fn forward(
    backend: &CudaBackend,
    f: AttentionForward<'_>,
    dims: AttentionDims,
) -> Result<()> {
    let padded = if dims.head_dim <= 64 { 64 } else { 128 };
    let suffix = match (f.q.dtype, padded) {
        (DType::BF16, 64) => "bf16_64",
        (DType::BF16, _) => "bf16_128",
        (_, 64) => "f16_64",
        _ => "f16_128",
    };
    let args = attn_args(&dims, &f, &[f.q, f.k, f.v, f.out])?;
    // Q, and two buffers each of K and V, each padded / 64 atoms; 1 KiB to align them.
    let shared = 1024 + 5 * (padded / 64) * ATOM_BYTES;
    let config = LaunchConfig {
        grid_dim: (
            dims.queries.div_ceil(ROWS) as u32,
            (dims.batch * dims.heads) as u32,
            1,
        ),
        block_dim: (128, 1, 1),
        shared_mem_bytes: shared as u32,
    };
    let params = [
        address(&f.q),
        address(&f.k),
        address(&f.v),
        address(&f.out),
        Param::U64(element_address(&f.lse)),
    ];
    let name = ("attention_wgmma_forward", suffix);
    launch_in(
        backend,
        Module::AttentionWgmma,
        "attention",
        name,
        config,
        &params,
        Some(args),
    )?;
    backend.wgmma_forwards.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

impl CudaBackend {
    /// How many attention forwards ran on the Hopper wgmma kernels (`HEADROOM_ATTENTION_WGMMA=1`
    /// on a compute capability 9.0 device, f16/bf16, no packed sequences, no dropout).
    pub fn attention_wgmma_forwards(&self) -> u64 {
        self.wgmma_forwards.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kernel the launches name is an entry of the sm_90a PTX.
    #[test]
    fn every_launched_kernel_is_in_the_ptx() {
        let ptx = Module::AttentionWgmma.ptx();
        assert!(ptx.contains(".target sm_90a"));
        for suffix in ["bf16_64", "bf16_128", "f16_64", "f16_128"] {
            let entry = format!(".entry attention_wgmma_forward_{suffix}(");
            assert!(ptx.contains(&entry), "{entry}");
        }
    }
}
