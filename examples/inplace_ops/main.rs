//! `x = x + f(x)` three ways — out of place, in place (`add_`) and into a preallocated output
//! (`add_out`, PyTorch's `out=`) — with the bytes each costs, read from the CPU backend's caching
//! allocator, what happens to backward when an in-place write overwrites a tensor autograd
//! saved, and the writes refused because their output overlaps an input or itself. See README.md
//! for the command and the expected output.

use std::sync::Arc;

use anyhow::Result;
use headroom::autograd_core::{no_grad, BackendRef, DType, Tensor, TensorError};
use headroom::ops_cpu::CpuBackend;

const ROWS: usize = 1024;
const COLS: usize = 1024;
const MIB: f64 = (1 << 20) as f64;

/// Memory figures of one step, from the allocator.
struct Step {
    /// Allocated bytes after the step.
    after: i64,
    /// Peak allocated bytes during the step.
    peak: i64,
    /// Bytes newly allocated during the step.
    new_bytes: i64,
}

fn measure(cpu: &CpuBackend, step: impl FnOnce() -> Result<()>) -> Result<Step> {
    cpu.allocator().reset_peak_stats();
    let before = cpu.allocator().memory_stats().allocated_bytes.all;
    step()?;
    let stats = cpu.allocator().memory_stats().allocated_bytes.all;
    Ok(Step {
        after: stats.current,
        peak: stats.peak,
        new_bytes: stats.allocated - before.allocated,
    })
}

fn report(name: &str, step: &Step) {
    println!(
        "{name:<38} after {:>5.1} MiB   peak {:>5.1} MiB   newly allocated {:>5.1} MiB",
        step.after as f64 / MIB,
        step.peak as f64 / MIB,
        step.new_bytes as f64 / MIB
    );
}

fn input(cpu: &BackendRef) -> Result<Tensor> {
    let values: Vec<f32> = (0..ROWS * COLS)
        .map(|i| ((i % 17) as f32 - 8.0) / 8.0)
        .collect();
    Ok(Tensor::from_slice(cpu, &values, &[ROWS, COLS])?)
}

fn main() -> Result<()> {
    let backend = Arc::new(CpuBackend::default());
    let cpu: BackendRef = backend.clone();
    println!("x: {ROWS}x{COLS} f32 = 4.0 MiB, f = tanh, no grad\n");

    // 1. Out of place: f(x) and x + f(x) are new tensors; the old x is released on assignment.
    let reference = {
        let _guard = no_grad();
        let mut x = input(&cpu)?;
        let step = measure(&backend, || {
            x = x.add(&x.tanh()?)?;
            Ok(())
        })?;
        report("out of place   x = x + f(x)", &step);
        x.to_vec::<f32>()?
    };

    // 2. In place: only f(x) is new; x is overwritten.
    {
        let _guard = no_grad();
        let x = input(&cpu)?;
        let step = measure(&backend, || {
            x.add_(&x.tanh()?)?;
            Ok(())
        })?;
        report("in place       x.add_(f(x))", &step);
        assert_eq!(x.to_vec::<f32>()?, reference);
    }

    // 3. out=: the result goes into a buffer allocated once, outside the step.
    {
        let _guard = no_grad();
        let x = input(&cpu)?;
        let out = Tensor::empty(&cpu, &[ROWS, COLS], DType::F32)?;
        let step = measure(&backend, || {
            x.add_out(&x.tanh()?, &out)?;
            Ok(())
        })?;
        report("out=           add_out(x, f(x), out)", &step);
        assert_eq!(out.to_vec::<f32>()?, reference);
    }

    println!("\nwith autograd: w requires grad, h = g(w), then h = h + tanh(h), backward\n");

    // 4. In place on a tensor nobody saved: h = 2w (mul by a scalar saves nothing), so
    //    overwriting h is safe and backward runs.
    {
        let w = input(&cpu)?;
        w.requires_grad_(true)?;
        let h = w.mul_scalar(2.0)?;
        let step = measure(&backend, || {
            h.add_(&h.tanh()?)?;
            Ok(())
        })?;
        report("g = 2w, in place: forward", &step);
        h.sum_all()?.backward()?;
        println!(
            "  backward ok, w.grad[0] = {:.6}",
            w.grad().expect("grad").to_vec::<f32>()?[0]
        );
    }

    // 5. In place on a tensor autograd saved: exp saves its output for backward, so writing
    //    into h makes backward fail with an error naming the op, instead of a wrong gradient.
    {
        let w = input(&cpu)?;
        w.requires_grad_(true)?;
        let h = w.exp()?;
        h.add_(&h.tanh()?)?;
        match h.sum_all()?.backward() {
            Err(error @ TensorError::ModifiedInPlace { .. }) => {
                println!("g = exp(w), in place: backward fails:\n  {error}");
            }
            other => anyhow::bail!("expected a ModifiedInPlace error, got {other:?}"),
        }
        // Out of place, the same computation differentiates fine.
        let h = w.exp()?;
        let h = h.add(&h.tanh()?)?;
        h.sum_all()?.backward()?;
        println!("g = exp(w), out of place: backward ok");
    }

    println!("\noverlap: writes whose output shares memory with an input are refused\n");

    // 6. `x += x.t()` reads elements the same call already overwrote: refused, as in PyTorch,
    //    and so is a write into an expanded view (one element reached by many indices). The same
    //    view in and out (`x += x`) is fine, and so is a contiguous copy of the transpose.
    {
        let _guard = no_grad();
        let x = input(&cpu)?;
        match x.add_(&x.t()?) {
            Err(error @ TensorError::Overlap { .. }) => println!("x.add_(x.t()):\n  {error}"),
            other => anyhow::bail!("expected an Overlap error, got {other:?}"),
        }
        let row = x.narrow(0, 0, 1)?.expand(&[ROWS, COLS])?;
        match row.fill_(0.0) {
            Err(error @ TensorError::Overlap { .. }) => {
                println!("x[0].expand(..).fill_(0):\n  {error}")
            }
            other => anyhow::bail!("expected an Overlap error, got {other:?}"),
        }
        let step = measure(&backend, || {
            x.add_(&x.t()?.contiguous()?)?;
            Ok(())
        })?;
        report("x.add_(x.t().contiguous())", &step);
    }
    Ok(())
}
