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
//! Grouped-query heads cost no copy here either: the products run per (batch, key/value head)
//! "unit", whose query side is the group's query heads stacked (`group · sq` rows, which is how a
//! dense `[batch, heads, sq, d]` copy lies anyway), so `dV = Pᵀ·dO` and `dK = dSᵀ·Q` sum over the
//! group inside one product. Packed sequences run one sub-problem per sequence (row slices of the
//! operands, the log-sum-exp through a dense scratch), so the work is each sequence's own.
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

/// Query rows of one unit: the group's query heads, stacked.
fn unit_rows(dims: &AttentionDims) -> usize {
    dims.group() * dims.queries
}

/// `[group · queries, keys]` f32 products `rows · keysᵀ` of `n` units (scores from q and k, dP
/// from dO and v) into `out` (rows `ld` apart).
///
/// # Safety
/// `keys` holds `n` dense `[sk, d]` matrices, `rows` `n` dense `[group · sq, d]` ones and `out`
/// room for `n` `[group · sq, ld]` f32 matrices, all live memory of `backend`.
unsafe fn row_key_products(
    backend: &CudaBackend,
    dims: &AttentionDims,
    dtype: DType,
    (keys, rows, out): (u64, u64, u64),
    ld: usize,
    n: usize,
) -> Result<()> {
    let (sq, sk, d) = (unit_rows(dims), dims.keys, dims.head_dim);
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

/// Units ((batch, key/value head) pairs) per chunk.
fn chunk_units(dims: &AttentionDims) -> usize {
    let per_unit = (unit_rows(dims) * padded_keys(dims) * 4).max(1);
    (CHUNK_BYTES / per_unit).clamp(1, (dims.batch * dims.kv_heads).max(1))
}

/// Launch shape for one warp per row.
fn warp_rows(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.div_ceil(8).clamp(1, 1 << 16) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Forward: per packed sequence when packed (see the module docs), else in one go.
pub(crate) fn forward(
    backend: &CudaBackend,
    f: AttentionForward<'_>,
    dims: AttentionDims,
) -> Result<()> {
    let Some(packed) = f.packed else {
        return forward_units(backend, f, dims, element_address(&f.lse));
    };
    for (first, len) in sequences(packed.host) {
        let [q, k, v, out] = [f.q, f.k, f.v, f.out].map(|view| row_slice(&view, first, len));
        let layouts = [q?, k?, v?, out?];
        let sequence = sequence_forward(&f, &layouts);
        let lse = Scratch::new(backend, (dims.heads * len * 4) as u64)?;
        forward_units(backend, sequence, sequence_dims(dims, len), lse.address())?;
        let (dense, slice) = lse_layouts(&f, dims, first, len)?;
        copy_raw(
            backend,
            lse.address(),
            &dense,
            f.lse.buffer.address(),
            &slice,
            4,
        )?;
    }
    Ok(())
}

/// The non-empty sequences of `cu_seqlens`: first row and length.
fn sequences(cu_seqlens: &[i32]) -> impl Iterator<Item = (usize, usize)> + '_ {
    cu_seqlens
        .windows(2)
        .map(|bounds| (bounds[0] as usize, (bounds[1] - bounds[0]) as usize))
        .filter(|&(_, len)| len > 0)
}

/// `f` over one packed sequence, unpacked: q, k, v and out laid out as `layouts` (their rows of
/// that sequence, from [`row_slice`]), every option as `f`'s.
fn sequence_forward<'s>(
    f: &AttentionForward<'s>,
    layouts: &'s [Layout; 4],
) -> AttentionForward<'s> {
    let [q, k, v, out] = layouts;
    AttentionForward {
        q: View { layout: q, ..f.q },
        k: View { layout: k, ..f.k },
        v: View { layout: v, ..f.v },
        out: View {
            layout: out,
            ..f.out
        },
        packed: None,
        ..*f
    }
}

/// `view` (`[batch, heads, rows, head_dim]`) restricted to rows `first..first + len`.
fn row_slice(view: &View<'_>, first: usize, len: usize) -> Result<Layout> {
    let (shape, strides) = (view.layout.shape(), view.layout.strides());
    Layout::from_parts(
        &[shape[0], shape[1], len, shape[3]],
        strides,
        view.layout.offset() + first * strides[2],
    )
}

/// The dims of one packed sequence of `len` tokens.
fn sequence_dims(dims: AttentionDims, len: usize) -> AttentionDims {
    AttentionDims {
        queries: len,
        keys: len,
        ..dims
    }
}

/// The dense `[heads, len]` layout of one sequence's log-sum-exp scratch, and the layout of its
/// place in the `[1, heads, tokens]` log-sum-exp.
fn lse_layouts(
    f: &AttentionForward<'_>,
    dims: AttentionDims,
    first: usize,
    len: usize,
) -> Result<(Layout, Layout)> {
    let slice = Layout::from_parts(
        &[dims.heads, len],
        &[dims.queries, 1],
        f.lse.layout.offset() + first,
    )?;
    Ok((Layout::contiguous(&[dims.heads, len]), slice))
}

/// Forward of dense problems (not packed), the log-sum-exp written at `lse` (dense f32 `[batch,
/// heads, queries]`).
fn forward_units(
    backend: &CudaBackend,
    f: AttentionForward<'_>,
    dims: AttentionDims,
    lse: u64,
) -> Result<()> {
    let t = f.q.dtype;
    let es = t.size_in_bytes();
    // Units of `sq` rows each (the group's query heads, stacked); `sq_head` is one head's.
    let (units, sq, sk, d) = (
        dims.batch * dims.kv_heads,
        unit_rows(&dims),
        dims.keys,
        dims.head_dim,
    );
    let sq_head = dims.queries;
    let (q, k, v) = (
        dense(backend, &f.q)?,
        dense(backend, &f.k)?,
        dense(backend, &f.v)?,
    );
    let out = Scratch::new(backend, (units * sq * d * es) as u64)?;
    let (chunk, ld) = (chunk_units(&dims), padded_keys(&dims));
    let scores = Scratch::new(backend, (chunk * sq * ld * 4) as u64)?;
    let probs = Scratch::new(backend, (chunk * sq * ld * es) as u64)?;
    for first in (0..units).step_by(chunk) {
        let n = chunk.min(units - first);
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
            Param::U32(to_u32(sq_head)?),
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

/// Backward: per packed sequence when packed, else in one go.
pub(crate) fn backward(
    backend: &CudaBackend,
    b: AttentionBackward<'_>,
    dims: AttentionDims,
) -> Result<()> {
    let f = b.forward;
    let Some(packed) = f.packed else {
        return backward_units(backend, b, dims, element_address(&f.lse));
    };
    for (first, len) in sequences(packed.host) {
        let views = [f.q, f.k, f.v, f.out, b.dout, b.dq, b.dk, b.dv];
        let [q, k, v, out, dout, dq, dk, dv] = views.map(|view| row_slice(&view, first, len));
        let layouts = [q?, k?, v?, out?];
        let [dout, dq, dk, dv] = [dout?, dq?, dk?, dv?];
        let sequence = AttentionBackward {
            forward: sequence_forward(&f, &layouts),
            dout: View {
                layout: &dout,
                ..b.dout
            },
            dq: View {
                layout: &dq,
                ..b.dq
            },
            dk: View {
                layout: &dk,
                ..b.dk
            },
            dv: View {
                layout: &dv,
                ..b.dv
            },
        };
        let lse = Scratch::new(backend, (dims.heads * len * 4) as u64)?;
        let (dense, slice) = lse_layouts(&f, dims, first, len)?;
        copy_raw(
            backend,
            f.lse.buffer.address(),
            &slice,
            lse.address(),
            &dense,
            4,
        )?;
        backward_units(backend, sequence, sequence_dims(dims, len), lse.address())?;
    }
    Ok(())
}

/// Backward of dense problems (not packed), the log-sum-exp read at `lse` (dense f32 `[batch,
/// heads, queries]`).
fn backward_units(
    backend: &CudaBackend,
    b: AttentionBackward<'_>,
    dims: AttentionDims,
    lse: u64,
) -> Result<()> {
    let f = b.forward;
    let t = f.q.dtype;
    let es = t.size_in_bytes();
    // Units of `sq` rows each (the group's query heads, stacked); `sq_head` is one head's.
    let (units, sq, sk, d) = (
        dims.batch * dims.kv_heads,
        unit_rows(&dims),
        dims.keys,
        dims.head_dim,
    );
    let (pairs, sq_head) = (dims.batch * dims.heads, dims.queries);
    // Δ = dO·O per query, read from the strided views.
    let delta = Scratch::new(backend, (pairs * sq_head * 4) as u64)?;
    let args = attn_args(&dims, &f, &[f.q, f.k, f.v, f.out, b.dout])?;
    launch_in(
        backend,
        Module::Attention,
        "attention_backward",
        ("attention_delta", suffix(t)),
        warp_rows(pairs * sq_head),
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
    let dq = Scratch::new(backend, (units * sq * d * es) as u64)?;
    let dk = Scratch::new(backend, (units * sk * d * es) as u64)?;
    let dv = Scratch::new(backend, (units * sk * d * es) as u64)?;
    let (chunk, ld) = (chunk_units(&dims), padded_keys(&dims));
    let matrix = chunk * sq * ld;
    let (scores, dscores) = (
        Scratch::new(backend, (matrix * 4) as u64)?,
        Scratch::new(backend, (matrix * 4) as u64)?,
    );
    let (probs, dprobs) = (
        Scratch::new(backend, (matrix * es) as u64)?,
        Scratch::new(backend, (matrix * es) as u64)?,
    );
    let scale = f.scale as f32;
    for first in (0..units).step_by(chunk) {
        let n = chunk.min(units - first);
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
            Param::U32(to_u32(sq_head)?),
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
