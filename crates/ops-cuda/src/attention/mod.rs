//! The attention family: fused scaled-dot-product attention on the GPU, forward and backward, by
//! three paths that keep the same saved state (q, k, v, the output and one log-sum-exp per query;
//! backward recomputes the scores).
//!
//! - f32 takes the split-TF32 tensor-core kernels of `kernels/attention_tf32.cu`
//!   (`tensor_core.rs`) when their alignment rule holds (`tensor_core::fits`: head dims multiples
//!   of 4 up to 128, operands 4-element aligned, buffers 16-byte aligned), else, like f64, the
//!   register-tiled kernels of `kernels/attention.cu` (`register_tiled.rs`), which also take every
//!   f32 call with dropout. Setting
//!   `HEADROOM_ATTENTION_F32=register-tiled` ([`F32_KERNEL_VARIABLE`]) sends every f32 call to the
//!   register-tiled kernels (plain f32 FMAs rather than split TF32 products: results differ in
//!   the last bits).
//! - f16 and bf16 on a compute capability 9.0 device take the Hopper kernels by default: the
//!   forwards without dropout or packing whose operands a tensor map describes run on the
//!   warp-specialised kernel of `kernels/attention_ws_sm90a.cu` (`warp_specialized.rs`: TMA
//!   loads, two consumer warpgroups), and so do their backwards (a dQ kernel, then a dK/dV
//!   kernel); the other forwards and backwards run on the `wgmma` kernels of
//!   `kernels/attention_wgmma_sm90a.cu` (`wgmma.rs`; packed sequences, and dropout in bf16), all
//!   with the same saved state as the mma.sync kernels: the fastest of each measured on an H100
//!   (BENCHMARKS.md's Hopper table). `HEADROOM_ATTENTION_WGMMA` ([`HOPPER_VARIABLE`])
//!   picks otherwise: `0` the mma.sync kernels below, `1` wgmma forward and backward, `ws` (or
//!   `ws-overlap`, `ws-pingpong`) one build of the warp-specialised forward, with the
//!   warp-specialised backward, where they apply.
//! - f16 and bf16 take the FlashAttention-2-style `mma.sync` kernels of
//!   `kernels/attention_tc.cu` (`tensor_core.rs`) when their alignment rule holds
//!   (`tensor_core::fits`: head dims multiples of 8 up to 128, operands 8-element aligned, buffers
//!   16-byte aligned), else cuBLAS tensor-core products over chunks of (batch, head) pairs with the
//!   softmax and its gradient in kernels between them (`gemm.rs`).
//!
//! Dropout on the probabilities (`AttentionForward::dropout`) runs inside the fused kernels: the
//! keep bit of each probability is derived from its index, in the forward and again in the
//! backward, never stored. Only some builds have it (each is a whole PTX of unrolled code): the
//! bf16 tensor-core kernels at padded head dims 64 and 128 (f16 has none), and the register-tiled ones (f32
//! at column counts 8 and 16, f64 at 16), which take f32 and f64 with dropout; a smaller head
//! dim runs padded.
//! A 16-bit problem with dropout those kernels do not take (the cuBLAS path's, and f16) is an
//! `InvalidArgument` naming what they need.
//!
//! Operands are `[batch, heads, rows, head_dim]` views with a contiguous head dim, described to
//! the kernels by one `AttnArgs` (`args.rs`: offset and batch/head/row strides per operand), so
//! heads sliced out of a packed projection and outputs laid out `[batch, rows, heads, head_dim]`
//! need no copy. This module is the family's entry point: it checks the dims, returns early when
//! there is nothing to compute, and picks the path.
//!
//! The family sits on the ground floor and imports no other family. Its paths import `args.rs`,
//! never each other or this module.

mod args;
mod gemm;
mod register_tiled;
mod tensor_core;
mod warp_specialized;
mod wgmma;

use std::sync::OnceLock;

use headroom_autograd_core::{
    attention_dims, AttentionBackward, AttentionDims, AttentionForward, DType, Result, TensorError,
    View,
};

use crate::device::CudaBackend;

/// The environment variable that picks the kernels of f16/bf16 attention on a compute
/// capability 9.0 device (see the module docs): unset (or any other value) the default, `0` the
/// mma.sync kernels (`tensor_core.rs`), `1` the wgmma kernels (`wgmma.rs`), `ws` the
/// warp-specialised forward and backward (dQ, then dK/dV) where they apply
/// (`warp_specialized.rs`; `ws-overlap` with its intra-warpgroup overlap, `ws-pingpong` with that
/// and the ping-pong between consumers) and the wgmma kernels for the rest. Read at each call.
const HOPPER_VARIABLE: &str = "HEADROOM_ATTENTION_WGMMA";

/// What [`HOPPER_VARIABLE`] asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HopperKernels {
    /// Unset: the warp-specialised forward and backward (dQ, then dK/dV) where they apply
    /// (BENCHMARKS.md's Hopper table), the wgmma kernels for the rest.
    Default,
    /// `0`: the mma.sync kernels, as on other devices.
    MmaSync,
    /// `1`: the wgmma kernels.
    Wgmma,
    /// `ws`, `ws-overlap` or `ws-pingpong`: the warp-specialised forward's build, and its
    /// backward.
    WarpSpecialized(warp_specialized::Build),
}

fn hopper_kernels() -> HopperKernels {
    match std::env::var(HOPPER_VARIABLE).as_deref() {
        Ok("0") => HopperKernels::MmaSync,
        Ok("1") => HopperKernels::Wgmma,
        Ok("ws") => HopperKernels::WarpSpecialized(warp_specialized::Build::Plain),
        Ok("ws-overlap") => HopperKernels::WarpSpecialized(warp_specialized::Build::Overlap),
        Ok("ws-pingpong") => HopperKernels::WarpSpecialized(warp_specialized::Build::PingPong),
        _ => HopperKernels::Default,
    }
}

/// The warp-specialised forward's build the default takes: the ping-pong at head dims padded to
/// 128 (0.972 against 1.022 ms for the plain build on the full b4 h16 s4096 problem, 0.609 against
/// 0.625 causal), the plain one below (0.395 against 0.401 ms causal at 64, 0.671 against 0.688
/// full; results/2026-12-06-6018004, an H100).
fn default_build(head_dim: usize) -> warp_specialized::Build {
    if head_dim > 64 {
        warp_specialized::Build::PingPong
    } else {
        warp_specialized::Build::Plain
    }
}

/// Attention forward: `out` and the log-sum-exp per query.
pub(crate) fn attention(backend: &CudaBackend, f: AttentionForward<'_>) -> Result<()> {
    let dims = attention_dims(&f, &[])?;
    if dims.batch * dims.heads * dims.queries == 0 || dims.head_dim == 0 {
        return Ok(());
    }
    if matches!(f.q.dtype, DType::F16 | DType::BF16) {
        return if tensor_core::fits(&dims, &[f.q, f.k, f.v, f.out]) && no_f16_dropout(&f) {
            let hopper = hopper_kernels();
            let on_hopper = hopper != HopperKernels::MmaSync && wgmma::takes(backend, &f);
            let build = match hopper {
                HopperKernels::WarpSpecialized(build) => Some(build),
                HopperKernels::Default => Some(default_build(dims.head_dim)),
                HopperKernels::MmaSync | HopperKernels::Wgmma => None,
            };
            match build {
                Some(build) if on_hopper && warp_specialized::takes(&f) => {
                    warp_specialized::forward(backend, f, dims, build)
                }
                _ if on_hopper => wgmma::forward(backend, f, dims),
                _ => tensor_core::forward(backend, f, dims),
            }
        } else {
            no_dropout_in_gemm(&f, &dims)?;
            gemm::forward(backend, f, dims)
        };
    }
    // f32 with dropout: the register-tiled kernels (the split-TF32 ones have no dropout build).
    if f.dropout.is_none() && takes_split_tf32(&dims, &[f.q, f.k, f.v, f.out]) {
        return tensor_core::forward(backend, f, dims);
    }
    register_tiled::forward(backend, f, dims)
}

/// Attention backward: dq, dk and dv from the saved state and the output's gradient.
pub(crate) fn attention_backward(backend: &CudaBackend, b: AttentionBackward<'_>) -> Result<()> {
    let f = b.forward;
    let dims = attention_dims(&f, &[b.dout, b.dq, b.dk, b.dv])?;
    if dims.batch * dims.heads == 0 || dims.head_dim == 0 {
        return Ok(());
    }
    if matches!(f.q.dtype, DType::F16 | DType::BF16) {
        let views = [f.q, f.k, f.v, f.out, b.dout, b.dq, b.dk, b.dv];
        return if tensor_core::fits(&dims, &views) && no_f16_dropout(&f) {
            let hopper = hopper_kernels();
            let on_hopper = hopper != HopperKernels::MmaSync && wgmma::takes(backend, &f);
            let ws_dkdv = matches!(
                hopper,
                HopperKernels::Default | HopperKernels::WarpSpecialized(_)
            );
            if on_hopper && ws_dkdv && warp_specialized::takes_backward(&b) {
                let delta = warp_specialized::backward_dq(backend, b, dims)?;
                warp_specialized::backward_dkdv(backend, b, dims, delta.address())
            } else if on_hopper {
                wgmma::backward(backend, b, dims)
            } else {
                tensor_core::backward(backend, b, dims)
            }
        } else {
            no_dropout_in_gemm(&f, &dims)?;
            gemm::backward(backend, b, dims)
        };
    }
    let views = [f.q, f.k, f.v, f.out, b.dout, b.dq, b.dk, b.dv];
    if f.dropout.is_none() && takes_split_tf32(&dims, &views) && !register_tiled::fused_backward() {
        return tensor_core::backward(backend, b, dims);
    }
    register_tiled::backward(backend, b, dims)
}

/// Whether `f` is not f16 with dropout (which has no tensor-core build: `no_dropout_in_gemm`
/// answers it).
fn no_f16_dropout(f: &AttentionForward<'_>) -> bool {
    f.dropout.is_none() || f.q.dtype != DType::F16
}

/// Dropout in 16-bit attention runs in the bf16 tensor-core kernels alone: the cuBLAS path keeps
/// its probabilities in scratch between library calls, and f16 has no dropout build.
fn no_dropout_in_gemm(f: &AttentionForward<'_>, dims: &AttentionDims) -> Result<()> {
    if f.dropout.is_none() {
        return Ok(());
    }
    Err(TensorError::InvalidArgument {
        op: "attention",
        reason: format!(
            "dropout in 16-bit attention runs in the bf16 tensor-core kernels, which need a head \
             dim that is a multiple of 8 up to 128 (this one is {}) and operands whose offsets \
             and strides are multiples of 8 elements; run this attention in bf16 or f32 (f16 has \
             no dropout build), or without dropout",
            dims.head_dim
        ),
    })
}

/// Set to `register-tiled`: every f32 call takes the register-tiled kernels (see the module docs).
pub(crate) const F32_KERNEL_VARIABLE: &str = "HEADROOM_ATTENTION_F32";

/// Whether f32 `views` go to the split-TF32 kernels: they fit, and the variable does not opt out.
fn takes_split_tf32(dims: &AttentionDims, views: &[View<'_>]) -> bool {
    static REGISTER_TILED: OnceLock<bool> = OnceLock::new();
    let register_tiled = *REGISTER_TILED.get_or_init(|| {
        std::env::var(F32_KERNEL_VARIABLE).is_ok_and(|value| value == "register-tiled")
    });
    views[0].dtype == DType::F32 && !register_tiled && tensor_core::fits(dims, views)
}
