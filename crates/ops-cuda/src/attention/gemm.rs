//! Attention for f16 and bf16 on tensor cores: the products go through cuBLAS (16-bit operands,
//! f32 accumulation), chunks of (batch, head) pairs at a time, with the softmax and its gradient
//! in `kernels/attention.cu` between them.
//!
//! The saved state is the fused kernels': q, k, v, the output and one log-sum-exp per query —
//! backward recomputes the scores. The `[queries, keys]` matrices exist only as scratch for one
//! chunk (scores and their gradient in f32, probabilities in the storage dtype as the next
//! product's operand), sized so the f32 matrix of a chunk stays under 64 MiB. Strided operands
//! (heads sliced out of a packed projection) are first copied dense, so every product is one
//! strided-batched call per chunk.
//!
//! cuBLAS sees row-major matrices as their column-major transposes: with `q` `[sq, d]` (rows of
//! `d`), the score matrix `s = q kᵀ` (`[sq, sk]`) is the column-major `kᵀ·q` product, and so on.
//!
//! This path sits on the attention family's `args.rs` and the ground floor (the batched GEMM of
//! `blas.rs`, the dense copies of `operands.rs`), and imports no other path; the family's entry
//! point (`mod.rs`) sends here the f16 and bf16 problems the tensor-core kernels do not take.

use cudarc::driver::LaunchConfig;
use headroom_autograd_core::{
    AttentionBackward, AttentionDims, AttentionForward, DType, Layout, Result, View,
};

use super::args::{attn_args, to_u32};
use crate::blas::GemmOperand;
use crate::device::CudaBackend;
use crate::kernels::Module;
use crate::launch::{launch_config, launch_in, Param, NO_ARGS};
use crate::operands::{copy_raw, element_address};
use crate::scratch::Scratch;

/// Bytes of one chunk's f32 `[queries, keys]` scratch matrix at most.
const CHUNK_BYTES: usize = 64 << 20;

/// Row length of the `[queries, keys]` scratch matrices: keys rounded up to 8, so their rows are
/// 16-byte aligned and cuBLAS picks its vectorised kernels.
fn padded_keys(dims: &AttentionDims) -> usize {
    dims.keys.div_ceil(8).max(1) * 8
}

/// A dense `[pairs, rows, head_dim]` copy of a `[batch, heads, rows, head_dim]` view.
fn dense<'a>(backend: &'a CudaBackend, view: &View<'_>) -> Result<Scratch<'a>> {
    let element = view.dtype.size_in_bytes();
    let layout = Layout::contiguous(view.layout.shape());
    let scratch = Scratch::new(backend, (layout.numel() * element) as u64)?;
    copy_raw(
        backend,
        view.buffer.address(),
        view.layout,
        scratch.address(),
        &layout,
        element,
    )?;
    Ok(scratch)
}

/// Copies a dense `[pairs, rows, head_dim]` result into its (strided) output view.
fn scatter_out(backend: &CudaBackend, from: &Scratch<'_>, view: &View<'_>) -> Result<()> {
    copy_raw(
        backend,
        from.address(),
        &Layout::contiguous(view.layout.shape()),
        view.buffer.address(),
        view.layout,
        view.dtype.size_in_bytes(),
    )
}

/// A dense operand: `[pairs, rows, cols]` at `address`, each matrix `rows × cols` row-major,
/// i.e. column-major with leading dimension `cols`.
fn operand(address: u64, dtype: DType, cols: usize, rows: usize, transposed: bool) -> GemmOperand {
    GemmOperand {
        address,
        dtype,
        ld: cols,
        batch_stride: rows * cols,
        transposed,
    }
}

fn suffix(dtype: DType) -> &'static str {
    if dtype == DType::F16 {
        "f16"
    } else {
        "bf16"
    }
}

/// `[queries, keys]` f32 products `rows · keysᵀ` of `n` pairs (scores from q and k, dP from dO
/// and v) into `out` (rows `ld` apart).
///
/// # Safety
/// `keys` holds `n` dense `[sk, d]` matrices, `rows` `n` dense `[sq, d]` ones and `out` room for
/// `n` `[sq, ld]` f32 matrices, all live memory of `backend`.
unsafe fn row_key_products(
    backend: &CudaBackend,
    dims: &AttentionDims,
    dtype: DType,
    (keys, rows, out): (u64, u64, u64),
    ld: usize,
    n: usize,
) -> Result<()> {
    let (sq, sk, d) = (dims.queries, dims.keys, dims.head_dim);
    let state = backend.blas_state()?;
    // SAFETY: forwarded from the caller.
    unsafe {
        state.gemm_batched(
            (sk, sq, d),
            1.0,
            operand(keys, dtype, d, sk, true),
            operand(rows, dtype, d, sq, false),
            0.0,
            operand(out, DType::F32, ld, sq, false),
            n,
        )
    }
}

/// Pairs per chunk.
fn chunk_pairs(dims: &AttentionDims) -> usize {
    let per_pair = (dims.queries * padded_keys(dims) * 4).max(1);
    (CHUNK_BYTES / per_pair).clamp(1, (dims.batch * dims.heads).max(1))
}

/// Launch shape for one warp per row.
fn warp_rows(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.div_ceil(8).clamp(1, 1 << 16) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

pub(crate) fn forward(
    backend: &CudaBackend,
    f: AttentionForward<'_>,
    dims: AttentionDims,
) -> Result<()> {
    let t = f.q.dtype;
    let es = t.size_in_bytes();
    let (pairs, sq, sk, d) = (
        dims.batch * dims.heads,
        dims.queries,
        dims.keys,
        dims.head_dim,
    );
    let (q, k, v) = (
        dense(backend, &f.q)?,
        dense(backend, &f.k)?,
        dense(backend, &f.v)?,
    );
    let out = Scratch::new(backend, (pairs * sq * d * es) as u64)?;
    let (chunk, ld) = (chunk_pairs(&dims), padded_keys(&dims));
    let scores = Scratch::new(backend, (chunk * sq * ld * 4) as u64)?;
    let probs = Scratch::new(backend, (chunk * sq * ld * es) as u64)?;
    let lse = element_address(&f.lse);
    for first in (0..pairs).step_by(chunk) {
        let n = chunk.min(pairs - first);
        let (q0, k0) = (
            q.address() + (first * sq * d * es) as u64,
            k.address() + (first * sk * d * es) as u64,
        );
        let v0 = v.address() + (first * sk * d * es) as u64;
        let out0 = out.address() + (first * sq * d * es) as u64;
        // SAFETY: every operand is a dense scratch matrix of this backend holding `n` entries of
        // the sizes given (q, k, v, out copies; the chunk's score and probability matrices).
        unsafe { row_key_products(backend, &dims, t, (k0, q0, scores.address()), ld, n)? };
        let params = [
            Param::U64(scores.address()),
            Param::U64(probs.address()),
            Param::U64(lse),
            Param::U64((n * sq) as u64),
            Param::U32(to_u32(sq)?),
            Param::U32(to_u32(sk)?),
            Param::U32(to_u32(ld)?),
            Param::F32(f.scale as f32),
            Param::U32(u32::from(f.causal)),
            Param::U64((first * sq) as u64),
        ];
        launch_in(
            backend,
            Module::Attention,
            "attention",
            ("attention_softmax", suffix(t)),
            warp_rows(n * sq),
            &params,
            NO_ARGS,
        )?;
        // SAFETY: as above.
        unsafe {
            backend.blas_state()?.gemm_batched(
                (d, sq, sk),
                1.0,
                operand(v0, t, d, sk, false),
                operand(probs.address(), t, ld, sq, false),
                0.0,
                operand(out0, t, d, sq, false),
                n,
            )?;
        }
    }
    scatter_out(backend, &out, &f.out)
}

pub(crate) fn backward(
    backend: &CudaBackend,
    b: AttentionBackward<'_>,
    dims: AttentionDims,
) -> Result<()> {
    let f = b.forward;
    let t = f.q.dtype;
    let es = t.size_in_bytes();
    let (pairs, sq, sk, d) = (
        dims.batch * dims.heads,
        dims.queries,
        dims.keys,
        dims.head_dim,
    );
    // Δ = dO·O per query, read from the strided views.
    let delta = Scratch::new(backend, (pairs * sq * 4) as u64)?;
    let args = attn_args(&dims, &f, &[f.q, f.k, f.v, f.out, b.dout])?;
    launch_in(
        backend,
        Module::Attention,
        "attention_backward",
        ("attention_delta", suffix(t)),
        warp_rows(pairs * sq),
        &[
            Param::U64(f.out.buffer.address()),
            Param::U64(b.dout.buffer.address()),
            Param::U64(delta.address()),
        ],
        Some(args),
    )?;
    let (q, k, v) = (
        dense(backend, &f.q)?,
        dense(backend, &f.k)?,
        dense(backend, &f.v)?,
    );
    let dout = dense(backend, &b.dout)?;
    let dq = Scratch::new(backend, (pairs * sq * d * es) as u64)?;
    let dk = Scratch::new(backend, (pairs * sk * d * es) as u64)?;
    let dv = Scratch::new(backend, (pairs * sk * d * es) as u64)?;
    let (chunk, ld) = (chunk_pairs(&dims), padded_keys(&dims));
    let matrix = chunk * sq * ld;
    let (scores, dscores) = (
        Scratch::new(backend, (matrix * 4) as u64)?,
        Scratch::new(backend, (matrix * 4) as u64)?,
    );
    let (probs, dprobs) = (
        Scratch::new(backend, (matrix * es) as u64)?,
        Scratch::new(backend, (matrix * es) as u64)?,
    );
    let lse = element_address(&f.lse);
    let scale = f.scale as f32;
    for first in (0..pairs).step_by(chunk) {
        let n = chunk.min(pairs - first);
        let at = |s: &Scratch<'_>, rows: usize| s.address() + (first * rows * d * es) as u64;
        let (q0, k0, v0, do0) = (at(&q, sq), at(&k, sk), at(&v, sk), at(&dout, sq));
        let (dq0, dk0, dv0) = (at(&dq, sq), at(&dk, sk), at(&dv, sk));
        // SAFETY: every operand is a dense scratch matrix of this backend holding `n` entries of
        // the sizes given.
        unsafe {
            // Scores s = q kᵀ and dP = dO vᵀ, in f32.
            row_key_products(backend, &dims, t, (k0, q0, scores.address()), ld, n)?;
            row_key_products(backend, &dims, t, (v0, do0, dscores.address()), ld, n)?;
        }
        let params = [
            Param::U64(scores.address()),
            Param::U64(dscores.address()),
            Param::U64(lse),
            Param::U64(delta.address()),
            Param::U64(probs.address()),
            Param::U64(dprobs.address()),
            Param::U64((n * sq) as u64),
            Param::U32(to_u32(sq)?),
            Param::U32(to_u32(sk)?),
            Param::U32(to_u32(ld)?),
            Param::F32(scale),
            Param::U32(u32::from(f.causal)),
            Param::U64((first * sq) as u64),
        ];
        launch_in(
            backend,
            Module::Attention,
            "attention_backward",
            ("attention_probs_backward", suffix(t)),
            launch_config((n * sq * sk) as u64),
            &params,
            NO_ARGS,
        )?;
        // SAFETY: as above.
        unsafe {
            // dV = Pᵀ dO, dQ = scale · dS k, dK = scale · dSᵀ q.
            backend.blas_state()?.gemm_batched(
                (d, sk, sq),
                1.0,
                operand(do0, t, d, sq, false),
                operand(probs.address(), t, ld, sq, true),
                0.0,
                operand(dv0, t, d, sk, false),
                n,
            )?;
            backend.blas_state()?.gemm_batched(
                (d, sq, sk),
                scale,
                operand(k0, t, d, sk, false),
                operand(dprobs.address(), t, ld, sq, false),
                0.0,
                operand(dq0, t, d, sq, false),
                n,
            )?;
            backend.blas_state()?.gemm_batched(
                (d, sk, sq),
                scale,
                operand(q0, t, d, sq, false),
                operand(dprobs.address(), t, ld, sq, true),
                0.0,
                operand(dk0, t, d, sk, false),
                n,
            )?;
        }
    }
    scatter_out(backend, &dq, &b.dq)?;
    scatter_out(backend, &dk, &b.dk)?;
    scatter_out(backend, &dv, &b.dv)
}
