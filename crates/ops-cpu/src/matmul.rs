//! Batched GEMM through the `gemm` crate, on strided operands.
//!
//! Each matrix of the batch is one `gemm::gemm` call with the operands' own row and column
//! strides, so transposed and expanded operands are never copied. A large single product uses
//! gemm's rayon parallelism; many small ones (attention heads) are spread over rayon instead.
//! f32, f64 and f16 go to gemm directly; bf16 is widened to f32 scratch and narrowed back, and
//! f16/bf16 inputs with an f32 `out` are widened and multiplied into it in f32. The fp8 product
//! widens its codes to f32 scratch (exactly), multiplies them in f32 and scales each element
//! into `out`. Before any call, the extent every matrix touches is checked against its buffer.

use half::bf16;
use headroom_autograd_core::{
    float8_matmul_dims, matmul_dims, DType, Float8Matmul, Layout, Result, TensorError, View,
};
use rayon::prelude::*;

use crate::element::{dispatch_any, Scalar};
use crate::strided::{for_each_run_serial, HostPtr};

/// Products with at least this many multiply-adds use gemm's own threads.
const PARALLEL_GEMM_WORK: usize = 1 << 18;

/// One operand: memory and where its matrices are.
#[derive(Clone, Copy)]
struct Operand<'a, T> {
    ptr: HostPtr<T>,
    layout: &'a Layout,
}

/// `out (+)= a @ b` over equal batch dims.
pub(crate) fn matmul(a: View<'_>, b: View<'_>, out: View<'_>, accumulate: bool) -> Result<()> {
    matmul_dims(&a, &b, &out)?;
    if out.dtype != a.dtype {
        // f16/bf16 inputs with an f32 `out` (the dims rule allows no other mix).
        return matmul_widened(a, b, out, accumulate);
    }
    match a.dtype {
        DType::F32 => batched::<f32>(op(&a), op(&b), op(&out), accumulate, 1.0, 0.0),
        DType::F64 => batched::<f64>(op(&a), op(&b), op(&out), accumulate, 1.0, 0.0),
        DType::F16 => batched::<gemm::f16>(
            op(&a),
            op(&b),
            op(&out),
            accumulate,
            gemm::f16::ONE,
            gemm::f16::ZERO,
        ),
        DType::BF16 => matmul_bf16(a, b, out, accumulate),
        dtype => Err(TensorError::UnsupportedDtype {
            op: "matmul",
            dtype,
        }),
    }
}

fn op<'a, T: Copy>(view: &View<'a>) -> Operand<'a, T> {
    Operand {
        ptr: HostPtr::new(view),
        layout: view.layout,
    }
}

/// f16/bf16 inputs into an f32 `out`: both widened to f32 scratch, multiplied into `out` in f32.
fn matmul_widened(a: View<'_>, b: View<'_>, out: View<'_>, accumulate: bool) -> Result<()> {
    multiply_widened(&a, &b, op(&out), accumulate)
}

/// `out (+)= a @ b` with `a` and `b` (f16 or bf16) widened to dense f32 scratch first.
fn multiply_widened(
    a: &View<'_>,
    b: &View<'_>,
    out: Operand<'_, f32>,
    accumulate: bool,
) -> Result<()> {
    let (mut lhs, mut rhs) = (read_as_f32(a), read_as_f32(b));
    let (la, lb) = (
        Layout::contiguous(a.layout.shape()),
        Layout::contiguous(b.layout.shape()),
    );
    let dense = |values: &mut Vec<f32>, layout| Operand {
        ptr: HostPtr::from_slice(values),
        layout,
    };
    let (lhs, rhs) = (dense(&mut lhs, &la), dense(&mut rhs, &lb));
    batched::<f32>(lhs, rhs, out, accumulate, 1.0, 0.0)
}

/// bf16: widen to f32 scratch, multiply, narrow into `out`.
fn matmul_bf16(a: View<'_>, b: View<'_>, out: View<'_>, accumulate: bool) -> Result<()> {
    let mut dst = if accumulate {
        read_as_f32(&out)
    } else {
        vec![0.0; out.layout.numel()]
    };
    let lo = Layout::contiguous(out.layout.shape());
    let dst_operand = Operand {
        ptr: HostPtr::from_slice(&mut dst),
        layout: &lo,
    };
    multiply_widened(&a, &b, dst_operand, accumulate)?;
    let to = HostPtr::<bf16>::new(&out);
    let mut next = 0;
    for_each_run_serial(
        out.layout.shape(),
        [out.layout.strides()],
        [out.layout.offset()],
        |o, s, len| {
            for i in 0..len {
                to.write(o[0] + i * s[0], bf16::from_f32(dst[next]));
                next += 1;
            }
        },
    );
    Ok(())
}

/// `view`'s elements (any dtype) read as f32, row-major: exact for the 8-bit floats.
fn read_as_f32(view: &View<'_>) -> Vec<f32> {
    let mut res = Vec::with_capacity(view.layout.numel());
    let (shape, strides, offset) = (
        view.layout.shape(),
        [view.layout.strides()],
        [view.layout.offset()],
    );
    dispatch_any!(view.dtype, T => {
        let from = HostPtr::<T>::new(view);
        for_each_run_serial(shape, strides, offset, |o, s, len| {
            res.extend((0..len).map(|i| Scalar::to_f64(from.read(o[0] + i * s[0])) as f32));
        });
    });
    res
}

/// The fp8 product ([`Float8Matmul`]): codes widened to f32 scratch, multiplied with f32
/// accumulation, each element times its row's and column's inverse scales (their f32 product),
/// rounded once into `out`.
pub(crate) fn matmul_float8(args: Float8Matmul<'_>) -> Result<()> {
    let (m, k, n) = float8_matmul_dims(&args)?;
    let (mut lhs, mut rhs) = (read_as_f32(&args.a), read_as_f32(&args.b));
    let (la, lb, lo) = (
        Layout::contiguous(&[m, k]),
        Layout::contiguous(&[k, n]),
        Layout::contiguous(&[m, n]),
    );
    let mut product = vec![0.0f32; m * n];
    let dense = |values: &mut Vec<f32>, layout| Operand {
        ptr: HostPtr::from_slice(values),
        layout,
    };
    batched::<f32>(
        dense(&mut lhs, &la),
        dense(&mut rhs, &lb),
        dense(&mut product, &lo),
        false,
        1.0,
        0.0,
    )?;
    let (row_scales, column_scales) = (
        read_as_f32(&args.a_inverse_scale),
        read_as_f32(&args.b_inverse_scale),
    );
    let bias = args.bias.as_ref().map(read_as_f32);
    let scaled = |index: usize| {
        let (i, j) = (index / n, index % n);
        let value = product[index] * (row_scales[i] * column_scales[j]);
        bias.as_ref().map_or(value, |bias| value + bias[j])
    };
    let base = args.out.layout.offset();
    match args.out.dtype {
        DType::F32 => {
            let to = HostPtr::<f32>::new(&args.out);
            (0..m * n).for_each(|index| to.write(base + index, scaled(index)));
        }
        DType::BF16 => {
            let to = HostPtr::<bf16>::new(&args.out);
            (0..m * n).for_each(|index| {
                to.write(base + index, Scalar::from_f64(f64::from(scaled(index))));
            });
        }
        _ => {
            let to = HostPtr::<half::f16>::new(&args.out);
            (0..m * n).for_each(|index| {
                to.write(base + index, Scalar::from_f64(f64::from(scaled(index))));
            });
        }
    }
    Ok(())
}

/// Largest element index a `rows x cols` matrix at `base` with these strides touches.
fn last_index(
    base: usize,
    rows: usize,
    cols: usize,
    row_stride: usize,
    col_stride: usize,
) -> usize {
    base + (rows - 1) * row_stride + (cols - 1) * col_stride
}

fn batched<T: Copy + Send + Sync + 'static>(
    a: Operand<'_, T>,
    b: Operand<'_, T>,
    out: Operand<'_, T>,
    accumulate: bool,
    one: T,
    zero: T,
) -> Result<()> {
    let nd = out.layout.ndim();
    let (m, n, k) = (
        out.layout.shape()[nd - 2],
        out.layout.shape()[nd - 1],
        a.layout.shape()[nd - 1],
    );
    let batch_shape = &out.layout.shape()[..nd - 2];
    let mut bases: Vec<[usize; 3]> = Vec::new();
    for_each_run_serial(
        batch_shape,
        [
            &out.layout.strides()[..nd - 2],
            &a.layout.strides()[..nd - 2],
            &b.layout.strides()[..nd - 2],
        ],
        [out.layout.offset(), a.layout.offset(), b.layout.offset()],
        |o, s, len| {
            bases.extend((0..len).map(|i| [o[0] + i * s[0], o[1] + i * s[1], o[2] + i * s[2]]))
        },
    );
    if m == 0 || n == 0 || bases.is_empty() {
        return Ok(());
    }
    let strides = |layout: &Layout| (layout.strides()[nd - 2], layout.strides()[nd - 1]);
    let ((o_rs, o_cs), (a_rs, a_cs), (b_rs, b_cs)) =
        (strides(out.layout), strides(a.layout), strides(b.layout));
    for base in &bases {
        let mut ok = last_index(base[0], m, n, o_rs, o_cs) < out.ptr.len();
        if k > 0 {
            ok &= last_index(base[1], m, k, a_rs, a_cs) < a.ptr.len()
                && last_index(base[2], k, n, b_rs, b_cs) < b.ptr.len();
        }
        if !ok {
            return Err(TensorError::InvalidArgument {
                op: "matmul",
                reason: "an operand's layout leaves its buffer".into(),
            });
        }
    }
    let big = m.saturating_mul(n).saturating_mul(k) >= PARALLEL_GEMM_WORK;
    let parallelism = if big && rayon::current_num_threads() > 1 {
        gemm::Parallelism::Rayon(rayon::current_num_threads())
    } else {
        gemm::Parallelism::None
    };
    let zero_fill = k == 0 && !accumulate;
    let product = |base: &[usize; 3]| {
        if zero_fill {
            for r in 0..m {
                for c in 0..n {
                    out.ptr.write(base[0] + r * o_rs + c * o_cs, zero);
                }
            }
            return;
        }
        // SAFETY: every element each matrix touches was checked to lie inside its live buffer
        // above; the backend's entry check refused an `out` that reaches an element twice or
        // shares memory with `a` or `b`, and claimed all three buffers for this call, so distinct
        // batches write disjoint parts of `out` and nothing else touches it meanwhile.
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                out.ptr.raw(base[0]),
                o_cs as isize,
                o_rs as isize,
                accumulate,
                a.ptr.raw(base[1]),
                a_cs as isize,
                a_rs as isize,
                b.ptr.raw(base[2]),
                b_cs as isize,
                b_rs as isize,
                one,
                one,
                false,
                false,
                false,
                parallelism,
            );
        }
    };
    if !big && bases.len() > 1 && rayon::current_num_threads() > 1 {
        bases.par_iter().for_each(product);
    } else {
        bases.iter().for_each(product);
    }
    Ok(())
}
