//! Hopper attention for f16 and bf16 (`kernels/attention_wgmma_sm90a.cu`): the flash kernels'
//! forward, dQ and dK/dV with every product on `wgmma.mma_async`, operands in 128-byte-swizzled
//! shared-memory tiles, one warpgroup a block taking 64 own rows and streaming the other side 64
//! rows at a time. On a device of compute capability 9.0 (the PTX is sm_90a) it takes by default
//! the backwards and the forwards the warp-specialised kernels do not take (the family's `HOPPER_VARIABLE`: `1` sends it every forward and
//! backward, `0` none), for the f16 and bf16 problems `tensor_core.rs` takes (the caller checked
//! `fits`), packed sequences included (their tiles heaviest first, as that path's) and dropout in
//! bf16 (the same replayed draw); its saved state is that path's (one f32 log-sum-exp per query),
//! so either backward follows either forward.
//!
//! This path sits on the attention family's `args.rs` and the ground floor, and imports no other
//! path.

use std::sync::atomic::Ordering;

use cudarc::driver::LaunchConfig;
use headroom_autograd_core::{AttentionBackward, AttentionDims, AttentionForward, DType, Result};

use super::args::{
    address, attn_args, hopper_variant as variant, with_tiles_heaviest_first, AttnArgs, TileShape,
};
use crate::device::CudaBackend;
use crate::kernels::Module;
use crate::launch::{launch_in, Param};
use crate::operands::element_address;
use crate::scratch::Scratch;

/// Queries a block (one warpgroup), keys a streamed tile, bytes of one swizzled 64 × 64 atom.
const ROWS: usize = 64;
const ATOM_BYTES: usize = 8192;

/// Whether the wgmma kernels take `f` (once the entry point's variable asks for them): the device
/// is Hopper, the dtype f16 or bf16 (dropout bf16 only, as the mma.sync kernels).
pub(crate) fn takes(backend: &CudaBackend, f: &AttentionForward<'_>) -> bool {
    (f.q.dtype == DType::BF16 || (f.q.dtype == DType::F16 && f.dropout.is_none()))
        && backend.compute_capability() == (9, 0)
}

/// The three kernels' names (forward, dQ, dK/dV), with dropout when `dropout`.
fn names(dropout: bool) -> [&'static str; 3] {
    if dropout {
        [
            "attention_wgmma_forward_dropout",
            "attention_wgmma_backward_dq_dropout",
            "attention_wgmma_backward_dkdv_dropout",
        ]
    } else {
        [
            "attention_wgmma_forward",
            "attention_wgmma_backward_dq",
            "attention_wgmma_backward_dkdv",
        ]
    }
}

/// Every kernel's tiles: 64 own rows, the other side streamed 64 at a time.
const SHAPE: TileShape = TileShape {
    rows: ROWS,
    streamed: ROWS,
};

/// A launch over the 64-row tiles of `rows` own rows of each of `pairs` pairs, with `tiles`
/// swizzled tiles of shared memory (`padded / 64` atoms each, 1 KiB to align them) and `stats`
/// f32 values after them.
fn config(rows: usize, pairs: usize, padded: usize, tiles: usize, stats: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.div_ceil(ROWS) as u32, pairs as u32, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: (1024 + tiles * (padded / 64) * ATOM_BYTES + stats * 4) as u32,
    }
}

/// Launches `name` of the sm_90a module with `params`, then `args`.
fn launch(
    backend: &CudaBackend,
    op: &'static str,
    name: (&'static str, &'static str),
    config: LaunchConfig,
    params: &[Param],
    args: AttnArgs,
) -> Result<()> {
    launch_in(
        backend,
        Module::AttentionWgmma,
        op,
        name,
        config,
        params,
        Some(args),
    )
}

/// Forward; the caller checked `tensor_core::fits` and [`takes`].
pub(crate) fn forward(
    backend: &CudaBackend,
    f: AttentionForward<'_>,
    dims: AttentionDims,
) -> Result<()> {
    let (suffix, padded) = variant(f.q.dtype, dims.head_dim);
    let args = attn_args(&dims, &f, &[f.q, f.k, f.v, f.out])?;
    let (args, _order) = with_tiles_heaviest_first(backend, args, &f, true, dims.queries, SHAPE)?;
    // Q, and two buffers each of K and V.
    let config = config(dims.queries, dims.batch * dims.heads, padded, 5, 0);
    let params = [
        address(&f.q),
        address(&f.k),
        address(&f.v),
        address(&f.out),
        Param::U64(element_address(&f.lse)),
    ];
    let name = (names(f.dropout.is_some())[0], suffix);
    launch(backend, "attention", name, config, &params, args)?;
    backend.wgmma_forwards.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

/// Backward (a dQ kernel that also writes Δ = dO·O, then a dK/dV kernel); the caller checked
/// `tensor_core::fits` and [`takes`].
pub(crate) fn backward(
    backend: &CudaBackend,
    b: AttentionBackward<'_>,
    dims: AttentionDims,
) -> Result<()> {
    let delta = backward_dq(backend, b, dims)?;
    backward_dkdv(backend, b, dims, &delta)
}

/// The backward's dQ kernel, which also writes Δ = dO·O per query: returns Δ (device scratch,
/// released in stream order once dropped) for [`backward_dkdv`]. Counted as a backward on these
/// kernels.
fn backward_dq<'a>(
    backend: &'a CudaBackend,
    b: AttentionBackward<'_>,
    dims: AttentionDims,
) -> Result<Scratch<'a>> {
    let f = b.forward;
    let (suffix, padded) = variant(f.q.dtype, dims.head_dim);
    let args = attn_args(&dims, &f, &[f.q, f.k, f.v, f.out, b.dout, b.dq, b.dk, b.dv])?;
    // Δ per query, from the caching allocator, returned (in stream order) after the launches.
    let delta = Scratch::new(backend, (dims.batch * dims.heads * dims.queries * 4) as u64)?;
    if dims.queries > 0 {
        // Q and dO, two buffers each of K and V; the block's log-sum-exp and Δ.
        let config = config(dims.queries, dims.batch * dims.heads, padded, 6, 2 * ROWS);
        let params = [
            address(&f.q),
            address(&f.k),
            address(&f.v),
            address(&f.out),
            address(&b.dout),
            Param::U64(element_address(&f.lse)),
            address(&b.dq),
            Param::U64(delta.address()),
        ];
        let (args, _order) =
            with_tiles_heaviest_first(backend, args, &f, true, dims.queries, SHAPE)?;
        let name = (names(f.dropout.is_some())[1], suffix);
        launch(backend, "attention_backward", name, config, &params, args)?;
    }
    backend.wgmma_backwards.fetch_add(1, Ordering::Relaxed);
    Ok(delta)
}

/// The backward's dK/dV kernel, after [`backward_dq`] wrote `delta`.
fn backward_dkdv(
    backend: &CudaBackend,
    b: AttentionBackward<'_>,
    dims: AttentionDims,
    delta: &Scratch<'_>,
) -> Result<()> {
    if dims.keys == 0 {
        return Ok(());
    }
    let f = b.forward;
    let (suffix, padded) = variant(f.q.dtype, dims.head_dim);
    let args = attn_args(&dims, &f, &[f.q, f.k, f.v, f.out, b.dout, b.dq, b.dk, b.dv])?;
    // K and V, two buffers each of Q and dO; both query buffers' statistics.
    let config = config(dims.keys, dims.batch * dims.kv_heads, padded, 6, 4 * ROWS);
    let params = [
        address(&f.q),
        address(&f.k),
        address(&f.v),
        address(&b.dout),
        Param::U64(element_address(&f.lse)),
        Param::U64(delta.address()),
        address(&b.dk),
        address(&b.dv),
    ];
    let (args, _order) = with_tiles_heaviest_first(backend, args, &f, false, dims.keys, SHAPE)?;
    let name = (names(f.dropout.is_some())[2], suffix);
    launch(backend, "attention_backward", name, config, &params, args)
}

impl CudaBackend {
    /// How many attention forwards ran on the Hopper wgmma kernels (on a compute capability 9.0
    /// device, f16/bf16, dropout bf16 only: those the warp-specialised kernel does not take, or
    /// every one with `HEADROOM_ATTENTION_WGMMA=1`).
    pub fn attention_wgmma_forwards(&self) -> u64 {
        self.wgmma_forwards.load(Ordering::Relaxed)
    }

    /// How many attention backwards ran on the Hopper wgmma kernels (as the forwards: those the
    /// warp-specialised kernels do not take, or every one with `HEADROOM_ATTENTION_WGMMA=1`).
    pub fn attention_wgmma_backwards(&self) -> u64 {
        self.wgmma_backwards.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kernel the launches name is an entry of the sm_90a PTX: each dtype and padded head
    /// dim, with dropout for bf16.
    #[test]
    fn every_launched_kernel_is_in_the_ptx() {
        let ptx = Module::AttentionWgmma.ptx();
        assert!(ptx.contains(".target sm_90a"));
        for dtype in [DType::BF16, DType::F16] {
            for head_dim in [40, 64, 96, 128] {
                let (suffix, padded) = variant(dtype, head_dim);
                assert_eq!(padded, if head_dim <= 64 { 64 } else { 128 });
                let dropouts: &[bool] = if dtype == DType::BF16 {
                    &[false, true]
                } else {
                    &[false]
                };
                for &dropout in dropouts {
                    for name in names(dropout) {
                        let entry = format!(".entry {name}_{suffix}(");
                        assert!(ptx.contains(&entry), "{entry}");
                    }
                }
            }
        }
    }
}
