//! Fused scaled-dot-product attention, forward and backward, one (batch, head) pair at a time.
//!
//! Pairs are independent and spread over rayon; each loads its queries, keys and values into f64
//! scratch, so sums and exponentials are exact to f64 whatever the storage dtype. Forward writes
//! the output and each query's log-sum-exp; backward recomputes the probabilities from the
//! log-sum-exp (`Δᵢ = Σ dOᵢ·Oᵢ`, `dSᵢⱼ = Pᵢⱼ (dPᵢⱼ − Δᵢ)`), as the GPU kernels do. Scratch is
//! host memory of one pair (`queries × keys` f64), not from the caching allocator.
//!
//! Grouped-query heads are read in place (query head `h` loads key/value head `h / group`);
//! backward runs one task per (batch, key/value head), which walks the group's query heads and
//! sums their dK and dV in f64 before one store. Every query sees one contiguous range of keys
//! (`visible_keys`: all of them, those up to itself when causal, and within its own sequence when
//! packed), so packed sequences cost no work for the pairs they mask.
//!
//! Dropout (`AttentionForward::dropout`) multiplies each probability by its keep factor
//! (`Dropped`: the draw's scale, or 0), the bit derived from its index in the `[batch, heads,
//! queries, keys]` matrix; backward derives the same bits: `dV += (m·P)ᵀ dO`, `dP = m · dO Vᵀ`
//! and `dS = P (dP − Δ)`, with `Δᵢ = dOᵢ·Oᵢ` as before (O is the dropped output).
use std::ops::Range;

use headroom_autograd_core::{
    attention_dims, AttentionBackward, AttentionDims, AttentionForward, DType, DropoutDraw, Result,
    View,
};
use rayon::prelude::*;

use crate::element::{dispatch_float, Float, Real};
use crate::strided::HostPtr;

/// A `[batch, heads, rows, head_dim]` operand: where row `r` of pair `(b, h)` starts.
#[derive(Clone, Copy)]
struct Operand<T> {
    ptr: HostPtr<T>,
    offset: usize,
    strides: [usize; 3],
}

impl<T: Float> Operand<T> {
    fn new(view: &View<'_>) -> Operand<T> {
        let s = view.layout.strides();
        Operand {
            ptr: HostPtr::new(view),
            offset: view.layout.offset(),
            strides: [s[0], s[1], s[2]],
        }
    }

    fn row(&self, b: usize, h: usize, r: usize) -> usize {
        self.offset + b * self.strides[0] + h * self.strides[1] + r * self.strides[2]
    }

    /// Rows `0..rows` of pair `(b, h)` as f64, row-major `[rows, d]`.
    fn load(&self, b: usize, h: usize, rows: usize, d: usize) -> Vec<f64> {
        let mut res = Vec::with_capacity(rows * d);
        for r in 0..rows {
            let base = self.row(b, h, r);
            self.ptr.check_run(base, 1, d);
            // SAFETY: the run was checked above and `c < d`.
            res.extend((0..d).map(|c| unsafe { self.ptr.read_in_run(base, 1, c) }.load().to_f64()));
        }
        res
    }

    /// Writes `values` (`[rows, d]`) as rows of pair `(b, h)`.
    fn store(&self, b: usize, h: usize, d: usize, values: &[f64]) {
        for (r, row) in values.chunks(d.max(1)).enumerate() {
            let base = self.row(b, h, r);
            self.ptr.check_run(base, 1, d);
            for (c, &value) in row.iter().enumerate() {
                // SAFETY: the run was checked above and `c < d`; pair `(b, h)` is written by
                // this task only.
                unsafe {
                    self.ptr
                        .write_in_run(base, 1, c, T::store(<T::C as Real>::from_f64(value)))
                };
            }
        }
    }
}

/// The per-query log-sum-exp: f32, or f64 for f64 inputs.
#[derive(Clone, Copy)]
enum Lse {
    F32(HostPtr<f32>),
    F64(HostPtr<f64>),
}

impl Lse {
    fn new(view: &View<'_>) -> Lse {
        if view.dtype == DType::F64 {
            Lse::F64(HostPtr::new(view))
        } else {
            Lse::F32(HostPtr::new(view))
        }
    }

    fn read(self, at: usize) -> f64 {
        match self {
            Lse::F32(ptr) => f64::from(ptr.read(at)),
            Lse::F64(ptr) => ptr.read(at),
        }
    }

    fn write(self, at: usize, value: f64) {
        match self {
            Lse::F32(ptr) => ptr.write(at, value as f32),
            Lse::F64(ptr) => ptr.write(at, value),
        }
    }
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// The keys each query sees: all, those up to the query when causal, and only its own sequence's
/// when packed (then `queries == keys` and the batch is one row).
fn visible_keys(args: &AttentionForward<'_>, dims: AttentionDims) -> Vec<Range<usize>> {
    let mut ranges: Vec<Range<usize>> = vec![0..dims.keys; dims.queries];
    if let Some(packed) = &args.packed {
        for bounds in packed.host.windows(2) {
            let sequence = bounds[0] as usize..bounds[1] as usize;
            ranges[sequence.clone()].fill(sequence);
        }
    }
    if args.causal {
        for (i, range) in ranges.iter_mut().enumerate() {
            range.end = i + 1;
        }
    }
    ranges
}

/// The factor dropout multiplies probability `(pair, i, j)` by: 1 without dropout, else the
/// draw's scale where it keeps the element and 0 where it drops it.
#[derive(Clone, Copy)]
struct Dropped {
    draw: Option<DropoutDraw>,
    queries: u64,
    keys: u64,
}

impl Dropped {
    fn new(args: &AttentionForward<'_>, dims: AttentionDims) -> Dropped {
        Dropped {
            draw: args.dropout,
            queries: dims.queries as u64,
            keys: dims.keys as u64,
        }
    }

    fn factor(&self, pair: usize, i: usize, j: usize) -> f64 {
        match &self.draw {
            None => 1.0,
            Some(draw) => {
                let index = (pair as u64 * self.queries + i as u64) * self.keys + j as u64;
                if draw.keeps(index) {
                    draw.scale()
                } else {
                    0.0
                }
            }
        }
    }
}

/// Scaled scores of query `i` against the keys of `visible` (into `out[..visible.len()]`), and
/// their log-sum-exp.
fn scores(
    q_i: &[f64],
    k: &[f64],
    d: usize,
    visible: Range<usize>,
    scale: f64,
    out: &mut [f64],
) -> f64 {
    let n_visible = visible.len();
    let mut max = f64::NEG_INFINITY;
    for (s, j) in out[..n_visible].iter_mut().zip(visible) {
        *s = scale * dot(q_i, &k[j * d..(j + 1) * d]);
        max = max.max(*s);
    }
    let sum: f64 = out[..n_visible].iter().map(|s| (s - max).exp()).sum();
    max + sum.ln()
}

/// Fused attention forward.
pub(crate) fn attention(args: AttentionForward<'_>) -> Result<()> {
    let dims = attention_dims(&args, &[])?;
    dispatch_float!(args.q.dtype, "attention", T => forward_typed::<T>(&args, dims));
    Ok(())
}

fn forward_typed<T: Float>(args: &AttentionForward<'_>, dims: AttentionDims) {
    let (q, k, v, out) = (
        Operand::<T>::new(&args.q),
        Operand::<T>::new(&args.k),
        Operand::<T>::new(&args.v),
        Operand::<T>::new(&args.out),
    );
    let lse_out = Lse::new(&args.lse);
    let (sq, sk, d, group) = (dims.queries, dims.keys, dims.head_dim, dims.group());
    let visible = visible_keys(args, dims);
    let dropped = Dropped::new(args, dims);
    (0..dims.batch * dims.heads)
        .into_par_iter()
        .for_each(|pair| {
            let (b, h) = (pair / dims.heads, pair % dims.heads);
            let (qs, ks, vs) = (
                q.load(b, h, sq, d),
                k.load(b, h / group, sk, d),
                v.load(b, h / group, sk, d),
            );
            let mut result = vec![0.0; sq * d];
            let mut s = vec![0.0; sk];
            for (i, keys) in visible.iter().enumerate() {
                let q_i = &qs[i * d..(i + 1) * d];
                let lse = scores(q_i, &ks, d, keys.clone(), args.scale, &mut s);
                let row = &mut result[i * d..(i + 1) * d];
                for (&sj, j) in s.iter().zip(keys.clone()) {
                    let p = (sj - lse).exp() * dropped.factor(pair, i, j);
                    for (o, &vj) in row.iter_mut().zip(&vs[j * d..(j + 1) * d]) {
                        *o += p * vj;
                    }
                }
                lse_out.write(pair * sq + i, lse);
            }
            out.store(b, h, d, &result);
        });
}

/// Fused attention backward.
pub(crate) fn attention_backward(args: AttentionBackward<'_>) -> Result<()> {
    let dims = attention_dims(&args.forward, &[args.dout, args.dq, args.dk, args.dv])?;
    dispatch_float!(args.forward.q.dtype, "attention_backward", T => backward_typed::<T>(&args, dims));
    Ok(())
}

fn backward_typed<T: Float>(args: &AttentionBackward<'_>, dims: AttentionDims) {
    let f = &args.forward;
    let [q, k, v, out, dout, dq, dk, dv] =
        [f.q, f.k, f.v, f.out, args.dout, args.dq, args.dk, args.dv].map(|v| Operand::<T>::new(&v));
    let lse_in = Lse::new(&f.lse);
    let (sq, sk, d, group) = (dims.queries, dims.keys, dims.head_dim, dims.group());
    let visible = visible_keys(f, dims);
    let dropped = Dropped::new(f, dims);
    // One task per (batch, key/value head): its dK and dV sum over the group's query heads.
    (0..dims.batch * dims.kv_heads)
        .into_par_iter()
        .for_each(|kv_pair| {
            let (b, kv_head) = (kv_pair / dims.kv_heads, kv_pair % dims.kv_heads);
            let (ks, vs) = (k.load(b, kv_head, sk, d), v.load(b, kv_head, sk, d));
            let (mut dks, mut dvs) = (vec![0.0; sk * d], vec![0.0; sk * d]);
            for h in kv_head * group..(kv_head + 1) * group {
                let pair = b * dims.heads + h;
                let qs = q.load(b, h, sq, d);
                let (os, dos) = (out.load(b, h, sq, d), dout.load(b, h, sq, d));
                let mut dqs = vec![0.0; sq * d];
                for (i, keys) in visible.iter().enumerate() {
                    let lse = lse_in.read(pair * sq + i);
                    let (q_i, do_i) = (&qs[i * d..(i + 1) * d], &dos[i * d..(i + 1) * d]);
                    let delta = dot(do_i, &os[i * d..(i + 1) * d]);
                    for j in keys.clone() {
                        let (k_j, v_j) = (&ks[j * d..(j + 1) * d], &vs[j * d..(j + 1) * d]);
                        let p = (f.scale * dot(q_i, k_j) - lse).exp();
                        let factor = dropped.factor(pair, i, j);
                        let ds = p * (factor * dot(do_i, v_j) - delta) * f.scale;
                        for c in 0..d {
                            dvs[j * d + c] += factor * p * do_i[c];
                            dks[j * d + c] += ds * q_i[c];
                            dqs[i * d + c] += ds * k_j[c];
                        }
                    }
                }
                dq.store(b, h, d, &dqs);
            }
            dk.store(b, kv_head, d, &dks);
            dv.store(b, kv_head, d, &dvs);
        });
}
