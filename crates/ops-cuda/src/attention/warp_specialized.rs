//! Hopper attention, warp-specialised (`kernels/attention_ws_sm90a.cu`): the forward, and the
//! backward's dQ (which writes Δ) and dK/dV. A block has three warpgroups:
//! one producer thread loads the tiles with the tensor memory accelerator into two stages behind
//! mbarriers, and two consumer warpgroups compute with wgmma. Forward: 128 queries a block, 64 a
//! consumer, S by m64n128 products and O with P from registers, keys and values 128 a tile.
//! dK/dV: 128 keys a block, 64 a consumer, the group's queries and their dO 64 a tile. The tensor
//! maps it loads through (one per operand: head dim, rows, heads, batch, in boxes of 64 × 128 or
//! 64 × 64 with the 128-byte swizzle) are built here from the views, so strided views are read in
//! place as on the other paths.
//!
//! FlashAttention-3's intra-warpgroup overlap is a second forward build (`ws-overlap`): a tile's
//! scores are issued with the last tile's P·V, and their softmax runs while that product does; a
//! third adds its ping-pong (`ws-pingpong`): the consumers take turns to issue their products.
//!
//! The forward (the ping-pong build at head dims padded to 128, the plain one below) and the
//! backward are the default on a compute capability 9.0 device; a chosen forward build runs with
//! `HEADROOM_ATTENTION_WGMMA=ws`, `ws-overlap` or `ws-pingpong`, with the same backward. Either for
//! what it takes ([`takes`], [`takes_backward`]): f16 or bf16 on a compute capability 9.0 device
//! (as `wgmma.rs`), no dropout and no packed sequences, every operand read through a tensor map
//! with its base 16-byte aligned and its strides multiples of 16 bytes. The rest of those calls
//! take `wgmma.rs`'s kernels, whose saved state these share.
//!
//! This path sits on the attention family's `args.rs` and the ground floor, and imports no other
//! path.

use std::sync::atomic::Ordering;

use cudarc::driver::{sys, DeviceRepr, LaunchConfig};
use headroom_autograd_core::{
    AttentionBackward, AttentionDims, AttentionForward, DType, Result, View,
};

use super::args::{attn_args, hopper_variant, AttnArgs};
use crate::device::CudaBackend;
use crate::error::device_error;
use crate::kernels::Module;
use crate::launch::{launch_in, Param};
use crate::operands::element_address;
use crate::scratch::Scratch;

/// Queries a block, keys a streamed tile, bytes of one 64-column half of a 128-row tile.
const ROWS: usize = 128;
const HALF_BYTES: usize = 16384;

/// A tensor map: `CUtensorMap`'s 128 opaque bytes, 64-byte aligned.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct TensorMap([u64; 16]);

/// `WsParams` of `attention_ws_sm90a.cu`, field for field: Q's, K's and V's tensor maps and the
/// attention's arguments.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct WsParams {
    q: TensorMap,
    k: TensorMap,
    v: TensorMap,
    args: AttnArgs,
}

/// `WsBackwardParams` of `attention_ws_sm90a.cu`, field for field: Q's, K's, V's and dO's tensor
/// maps (64-row boxes) and the attention's arguments.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct WsBackwardParams {
    q: TensorMap,
    k: TensorMap,
    v: TensorMap,
    dout: TensorMap,
    args: AttnArgs,
}

const _: () = assert!(std::mem::size_of::<AttnArgs>() == 352);
const _: () = assert!(std::mem::size_of::<WsParams>() == 768);
const _: () = assert!(std::mem::size_of::<WsBackwardParams>() == 896);

// SAFETY: `repr(C)` with the kernel's alignment, plain integers (the tensor maps' opaque words and
// `AttnArgs`), laid out exactly like `WsParams` in `kernels/attention_ws_sm90a.cu`; passed by value
// as the kernel's `__grid_constant__` parameter.
unsafe impl DeviceRepr for WsParams {}

// SAFETY: as `WsParams`, laid out exactly like `WsBackwardParams` in the same source.
unsafe impl DeviceRepr for WsBackwardParams {}

/// Whether the forward `f` runs here (once the entry point's variable asks for it and `wgmma.rs`
/// takes the call: a compute capability 9.0 device, f16 or bf16): no dropout, no packed
/// sequences, and every operand a tensor map can describe.
pub(crate) fn takes(f: &AttentionForward<'_>) -> bool {
    f.dropout.is_none() && f.packed.is_none() && [f.q, f.k, f.v].iter().all(tensor_map_fits)
}

/// Whether a tensor map can describe `view` (`[batch, heads, rows, head_dim]`, the head dim
/// contiguous): its first element 16-byte aligned, its batch, head and row strides multiples of
/// 16 bytes below 2^40, every extent below 2^31.
fn tensor_map_fits(view: &View<'_>) -> bool {
    let element = view.dtype.size_in_bytes() as u64;
    element_address(view).is_multiple_of(16)
        && view.layout.shape().iter().all(|&extent| extent < 1 << 31)
        && strides_in_bytes(view)
            .iter()
            .all(|&stride| stride.is_multiple_of(16) && stride < 1 << 40 && stride >= element)
}

/// The tensor map's strides of `view` in bytes: rows, heads, batch. A dim of extent 1 takes the
/// stride of a dense layout over the dims inside it (its own stride is never followed, and may
/// be anything).
fn strides_in_bytes(view: &View<'_>) -> [u64; 3] {
    let element = view.dtype.size_in_bytes() as u64;
    let shape = view.layout.shape();
    let strides = view.layout.strides();
    let mut out = [0u64; 3];
    let mut dense = shape[3] as u64 * element;
    // Dims 2 (rows), 1 (heads), 0 (batch).
    for (slot, dim) in [2usize, 1, 0].into_iter().enumerate() {
        out[slot] = if shape[dim] == 1 {
            dense.next_multiple_of(16)
        } else {
            strides[dim] as u64 * element
        };
        dense = out[slot] * shape[dim] as u64;
    }
    out
}

/// `view`'s tensor map: dims (head dim, rows, heads, batch), boxes of 64 × `rows` × 1 × 1, the
/// 128-byte swizzle, zeros past every edge.
fn tensor_map(view: &View<'_>, rows: u32) -> Result<TensorMap> {
    let shape = view.layout.shape();
    let data_type = match view.dtype {
        DType::BF16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        _ => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
    };
    let dims = [shape[3], shape[2], shape[1], shape[0]].map(|extent| extent as u64);
    let strides = strides_in_bytes(view);
    let boxes = [64u32, rows, 1, 1];
    let element_strides = [1u32; 4];
    let mut map = sys::CUtensorMap { opaque: [0; 16] };
    // SAFETY: every pointer is to a live local array of the length the rank (4) asks (3 strides);
    // the global address is the view's first element, live device memory (the call only encodes
    // it); `map` is written in place.
    unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map,
            data_type,
            4,
            element_address(view) as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            element_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    }
    .result()
    .map_err(|e| device_error("attention", e))?;
    Ok(TensorMap(map.opaque))
}

/// The builds of the warp-specialised forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Build {
    /// A tile's products and softmax one after another in each consumer.
    Plain,
    /// FlashAttention-3's intra-warpgroup overlap: a tile's scores issued with the last tile's
    /// P·V, their softmax while it runs.
    Overlap,
    /// The overlap, and the consumers taking turns to issue their products (FlashAttention-3's
    /// ping-pong), so one's softmax runs during the other's products.
    PingPong,
}

impl Build {
    #[cfg(test)]
    const ALL: [Build; 3] = [Build::Plain, Build::Overlap, Build::PingPong];

    fn family(self) -> &'static str {
        match self {
            Build::Plain => "attention_ws_forward",
            Build::Overlap => "attention_ws_overlap_forward",
            Build::PingPong => "attention_ws_pingpong_forward",
        }
    }
}

/// The kernel's name for `dtype`, `head_dim` (at most 128) and `build`, and its padded head dim.
fn variant(dtype: DType, head_dim: usize, build: Build) -> ((&'static str, &'static str), usize) {
    let (suffix, padded) = hopper_variant(dtype, head_dim);
    ((build.family(), suffix), padded)
}

/// Forward on `build`'s kernel; the caller checked `tensor_core::fits`, `wgmma::takes` and
/// [`takes`].
pub(crate) fn forward(
    backend: &CudaBackend,
    f: AttentionForward<'_>,
    dims: AttentionDims,
    build: Build,
) -> Result<()> {
    let (name, padded) = variant(f.q.dtype, dims.head_dim, build);
    let params = WsParams {
        q: tensor_map(&f.q, ROWS as u32)?,
        k: tensor_map(&f.k, ROWS as u32)?,
        v: tensor_map(&f.v, ROWS as u32)?,
        args: attn_args(&dims, &f, &[f.q, f.k, f.v, f.out])?,
    };
    // Q and two stages each of K and V, 1 KiB of alignment slack, 128 bytes of mbarriers.
    let tile = padded / 64 * HALF_BYTES;
    let config = block_config(dims.queries, dims.batch * dims.heads, 1024 + 5 * tile + 128);
    let pointers = [
        super::args::address(&f.out),
        Param::U64(element_address(&f.lse)),
    ];
    launch_in(
        backend,
        Module::AttentionWs,
        "attention",
        name,
        config,
        &pointers,
        Some(params),
    )?;
    backend.ws_forwards.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

/// The launch of a warp-specialised kernel: a block of three warpgroups per `ROWS` of `rows`
/// (queries for the forward, keys for dK/dV) and per (batch, head) pair of `pairs`, with
/// `shared_bytes` of dynamic shared memory.
fn block_config(rows: usize, pairs: usize, shared_bytes: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.div_ceil(ROWS) as u32, pairs as u32, 1),
        block_dim: (384, 1, 1),
        shared_mem_bytes: shared_bytes as u32,
    }
}

/// Whether the backward `b` takes this path's dK/dV kernel (its forward's conditions, and dO a
/// tensor map can describe).
pub(crate) fn takes_backward(b: &AttentionBackward<'_>) -> bool {
    takes(&b.forward) && tensor_map_fits(&b.dout)
}

/// The backward's dK/dV on the warp-specialised kernel (128 keys a block, queries and dO
/// streamed 64 a tile by the tensor memory accelerator), after [`backward_dq`] wrote Δ (at
/// device address `delta`); the caller checked [`takes_backward`].
pub(crate) fn backward_dkdv(
    backend: &CudaBackend,
    b: AttentionBackward<'_>,
    dims: AttentionDims,
    delta: u64,
) -> Result<()> {
    if dims.keys == 0 {
        return Ok(());
    }
    let f = b.forward;
    let (suffix, padded) = hopper_variant(f.q.dtype, dims.head_dim);
    let atom_rows = (ROWS / 2) as u32;
    let params = WsBackwardParams {
        q: tensor_map(&f.q, atom_rows)?,
        k: tensor_map(&f.k, atom_rows)?,
        v: tensor_map(&f.v, atom_rows)?,
        dout: tensor_map(&b.dout, atom_rows)?,
        args: attn_args(&dims, &f, &[f.q, f.k, f.v, f.out, b.dout, b.dq, b.dk, b.dv])?,
    };
    // Eight 64-row tiles (each consumer's keys and values, two stages each of queries and dO),
    // 1 KiB of alignment slack, 128 bytes of mbarriers, two stages of 64 log-sum-exps and 64 Δ.
    let tile = padded / 64 * HALF_BYTES / 2;
    let config = block_config(
        dims.keys,
        dims.batch * dims.kv_heads,
        1024 + 8 * tile + 128 + 1024,
    );
    let pointers = [
        Param::U64(element_address(&f.lse)),
        Param::U64(delta),
        super::args::address(&b.dk),
        super::args::address(&b.dv),
    ];
    launch_in(
        backend,
        Module::AttentionWs,
        "attention_backward",
        ("attention_ws_backward_dkdv", suffix),
        config,
        &pointers,
        Some(params),
    )?;
    backend.ws_backwards.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

/// The backward's dQ on the warp-specialised kernel (128 queries a block, keys and values
/// streamed 64 a tile by the tensor memory accelerator), which also writes Δ = dO·O per query:
/// returns Δ (device scratch, released in stream order once dropped) for [`backward_dkdv`].
/// The caller checked [`takes_backward`]; [`backward_dkdv`] counts the backward.
pub(crate) fn backward_dq<'a>(
    backend: &'a CudaBackend,
    b: AttentionBackward<'_>,
    dims: AttentionDims,
) -> Result<Scratch<'a>> {
    let f = b.forward;
    let delta = Scratch::new(backend, (dims.batch * dims.heads * dims.queries * 4) as u64)?;
    if dims.queries > 0 {
        let (suffix, padded) = hopper_variant(f.q.dtype, dims.head_dim);
        let atom_rows = (ROWS / 2) as u32;
        let params = WsBackwardParams {
            q: tensor_map(&f.q, atom_rows)?,
            k: tensor_map(&f.k, atom_rows)?,
            v: tensor_map(&f.v, atom_rows)?,
            dout: tensor_map(&b.dout, atom_rows)?,
            args: attn_args(&dims, &f, &[f.q, f.k, f.v, f.out, b.dout, b.dq, b.dk, b.dv])?,
        };
        // Eight 64-row tiles (each consumer's queries and dO, two stages each of keys and
        // values), 1 KiB of alignment slack, 128 bytes of mbarriers.
        let tile = padded / 64 * HALF_BYTES / 2;
        let config = block_config(dims.queries, dims.batch * dims.heads, 1024 + 8 * tile + 128);
        let pointers = [
            super::args::address(&f.out),
            super::args::address(&b.dout),
            Param::U64(element_address(&f.lse)),
            super::args::address(&b.dq),
            Param::U64(delta.address()),
        ];
        launch_in(
            backend,
            Module::AttentionWs,
            "attention_backward",
            ("attention_ws_backward_dq", suffix),
            config,
            &pointers,
            Some(params),
        )?;
    }
    Ok(delta)
}

impl CudaBackend {
    /// How many attention backwards ran on the warp-specialised Hopper kernels, dQ then dK/dV
    /// (by default on a compute capability 9.0 device, on what they take).
    pub fn attention_ws_backwards(&self) -> u64 {
        self.ws_backwards.load(Ordering::Relaxed)
    }

    /// How many attention forwards ran on the warp-specialised Hopper kernel (by default on a
    /// compute capability 9.0 device, on what it takes: f16/bf16, no dropout, no packing).
    pub fn attention_ws_forwards(&self) -> u64 {
        self.ws_forwards.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kernel the launches name is an entry of the sm_90a PTX, with its one parameter
    /// 64-byte aligned and 768 bytes long.
    #[test]
    fn every_launched_kernel_is_in_the_ptx() {
        let ptx = Module::AttentionWs.ptx();
        assert!(ptx.contains(".target sm_90a"));
        for dtype in [DType::BF16, DType::F16] {
            for (head_dim, build) in [40, 64, 96, 128]
                .into_iter()
                .flat_map(|dim| Build::ALL.map(|build| (dim, build)))
            {
                let ((family, suffix), padded) = variant(dtype, head_dim, build);
                assert_eq!(padded, if head_dim <= 64 { 64 } else { 128 });
                let entry = format!(".entry {family}_{suffix}(");
                let at = ptx.find(&entry).unwrap_or_else(|| panic!("{entry}"));
                let signature = &ptx[at..at + ptx[at..].find(')').unwrap()];
                assert!(signature.contains(".align 64 .b8"), "{signature}");
                assert!(signature.contains("[768]"), "{signature}");
            }
            for head_dim in [64, 128] {
                let (suffix, _) = hopper_variant(dtype, head_dim);
                for family in ["attention_ws_backward_dkdv", "attention_ws_backward_dq"] {
                    let entry = format!(".entry {family}_{suffix}(");
                    let at = ptx.find(&entry).unwrap_or_else(|| panic!("{entry}"));
                    let signature = &ptx[at..at + ptx[at..].find(')').unwrap()];
                    assert!(signature.contains(".align 64 .b8"), "{signature}");
                    assert!(signature.contains("[896]"), "{signature}");
                }
            }
        }
    }
}
