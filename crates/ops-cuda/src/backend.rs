//! `impl Backend for CudaBackend`: autograd-core's trait on one CUDA device, each primitive
//! handed to the kernel family that computes it.
//!
//! Memory comes from the device's caching allocator (on the pool of the stream
//! `CudaBackend::allocate_on_stream` names, else the compute stream's); host transfers of the
//! trait are synchronous (asynchronous copies through pinned memory are in `pinned.rs`, on the
//! streams of `stream.rs`). Driver failures become `TensorError::Device` naming the op.
//!
//! Every primitive first runs the ground floor's operand check (`operands::check`: views inside
//! their buffers, memory of this device's allocator, autograd-core's overlap rules), since the
//! kernels index with the views as given and write from many threads, then runs inside
//! `CudaBackend::timed`, which brackets it with timing events while an op profile runs
//! (`profile.rs`).
//!
//! This module is the top floor: it imports the families and the ground floor, and nothing
//! imports it. The backend's state is `device.rs`; each family's own methods on `CudaBackend`
//! live in its file.

use std::sync::Arc;

use cudarc::driver::result;
use headroom_autograd_core::{
    Aliasing, AttentionBackward, AttentionForward, Backend, BinaryOp, Buffer, CrossEntropyBackward,
    CrossEntropyForward, CrossEntropyTile, CrossEntropyTileBackward, Device, DropoutDraw,
    Float8Matmul, Float8Quantize, LayerNormBackward, LayerNormForward, LinearEpilogue,
    LinearForward, LinearWeightGrad, MaskedOp, ReduceOp, Result, SoftmaxBackward, UnaryOp, View,
};
use headroom_autograd_core::{
    RandomDraw, ReduceWithIndex, RmsNormBackward, RmsNormForward, RotaryArgs, SwiGluBackward,
    SwiGluForward,
};
use headroom_caching_allocator::{Allocation, AllocatorView, StreamId};

use crate::attention;
use crate::device::CudaBackend;
use crate::elementwise;
use crate::error::device_error;
use crate::float8;
use crate::index;
use crate::linear;
use crate::llama;
use crate::matmul;
use crate::operands::check;
use crate::profile::describe;
use crate::rows;
use crate::small_copies::{SmallCopies, SMALL_WRITE_BYTES};

impl CudaBackend {
    /// Runs `primitive`, bracketed by timing events labelled `label()` while an op profile runs
    /// (`profile.rs`).
    fn timed<T>(
        &self,
        label: impl FnOnce() -> String,
        primitive: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        if !self.profiler.is_active() {
            return primitive();
        }
        self.bind("op_profile")?;
        self.profiler
            .timed(self.stream.cu_stream(), label, primitive)
    }
}

/// The `Backend` methods of fused primitives: each checks and claims the operands its argument
/// struct names (`operands()`: writes and reads, disjoint), then runs the family's function,
/// timed for the op profile under the primitive's name and the operand `field` describes. One
/// row a primitive: `name(ArgStruct, field) => family::function;`.
macro_rules! fused_primitives {
    ($($name:ident($args:ident, $($field:ident).+) => $run:path;)*) => {
        $(
            fn $name(&self, args: $args<'_>) -> Result<()> {
                let ops = args.operands();
                let op = stringify!($name);
                check(self, op, &ops.writes, &ops.reads, Aliasing::Disjoint)?;
                self.timed(
                    || format!("{op} {}", describe(&args.$($field).+)),
                    || $run(self, args),
                )
            }
        )*
    };
}

impl Backend for CudaBackend {
    fn device(&self) -> Device {
        Device::Cuda(self.ordinal)
    }

    fn into_any(self: Arc<Self>) -> Arc<dyn std::any::Any + Send + Sync> {
        self
    }

    fn allocate(&self, bytes: u64) -> Result<Allocation> {
        let stream = crate::stream::allocation_stream(self);
        let allocation = self.allocator().allocate(bytes, stream)?;
        if stream != StreamId::DEFAULT {
            // A side stream's block (`allocate_on_stream`) is used by kernels too: its reuse waits
            // for the compute stream's work queued before its free.
            if let Err(error) = self
                .allocator()
                .record_stream(&allocation, StreamId::DEFAULT)
            {
                self.free(allocation);
                return Err(error.into());
            }
        }
        Ok(allocation)
    }

    fn free(&self, allocation: Allocation) {
        self.free_quietly(allocation);
    }

    fn allocator_view(&self) -> &dyn AllocatorView {
        self.allocator()
    }

    fn host_allocator_view(&self) -> Option<&dyn AllocatorView> {
        Some(self.pinned_allocator())
    }

    fn matmul_workspace_bytes(&self) -> usize {
        // Taken by the first product and kept: once it is, the next product takes nothing.
        if self.blas.lock().is_some() {
            0
        } else {
            crate::blas::lent_workspace_bytes()
        }
    }

    fn synchronize(&self) -> Result<()> {
        CudaBackend::synchronize(self)
    }

    fn write_host(&self, dst: &Buffer, byte_offset: usize, data: &[u8]) -> Result<()> {
        dst.check_range("write_host", byte_offset, data.len())?;
        if data.is_empty() {
            return Ok(());
        }
        dst.check_owner("write_host", self.allocator().id())?;
        self.capture.refuse(
            "write_host",
            "copies host values (`Tensor::from_slice`) into the step",
        )?;
        let address = dst.address() + byte_offset as u64;
        if self.small_copies() == SmallCopies::Kernel && data.len() <= SMALL_WRITE_BYTES {
            // SAFETY: the destination range lies inside the live device buffer (checked above),
            // whose reuse after a free is ordered after this compute-stream copy.
            return unsafe { self.write_in_order("write_host", address, data) };
        }
        self.bind("write_host")?;
        // SAFETY: the destination range lies inside the live device buffer (checked above);
        // `data` is a host slice of that length. The synchronous copy runs on the legacy default
        // stream, where every kernel runs, so it starts only after the kernels queued before it
        // (no explicit synchronisation needed).
        unsafe { result::memcpy_htod_sync(address, data) }
            .map_err(|e| device_error("write_host", e))
    }

    fn read_host(&self, src: &Buffer, byte_offset: usize, out: &mut [u8]) -> Result<()> {
        src.check_range("read_host", byte_offset, out.len())?;
        if out.is_empty() {
            return Ok(());
        }
        src.check_owner("read_host", self.allocator().id())?;
        self.capture.refuse(
            "read_host",
            "reads device values on the host (`to_vec`, `item`)",
        )?;
        // SAFETY: the source range lies inside the live device buffer (checked above) and `out`
        // is exclusively borrowed. The read runs after the kernels queued before it, and returns
        // once the data is on the host.
        unsafe { self.read_back("read_host", src.address() + byte_offset as u64, out) }?;
        // The read waited for the queued kernels: a deferred index check has its answer.
        self.take_deferred_index_error()
    }

    fn copy(&self, src: View<'_>, dst: View<'_>) -> Result<()> {
        check(self, "copy", &[dst], &[src], Aliasing::SameView)?;
        self.timed(
            || format!("copy {}→{}", describe(&src), describe(&dst)),
            || elementwise::copy(self, src, dst),
        )
    }

    fn fill(&self, dst: View<'_>, value: f64) -> Result<()> {
        check(self, "fill", &[dst], &[], Aliasing::SameView)?;
        self.timed(
            || format!("fill {}", describe(&dst)),
            || elementwise::fill(self, dst, value),
        )
    }

    fn unary(&self, op: UnaryOp, x: View<'_>, out: View<'_>) -> Result<()> {
        check(self, "unary", &[out], &[x], Aliasing::SameView)?;
        self.timed(
            || format!("unary {op:?} {}", describe(&x)),
            || elementwise::unary(self, op, x, out),
        )
    }

    fn binary(&self, op: BinaryOp, a: View<'_>, b: View<'_>, out: View<'_>) -> Result<()> {
        check(self, "binary", &[out], &[a, b], Aliasing::SameView)?;
        self.timed(
            || format!("binary {op:?} {} {}", describe(&a), describe(&b)),
            || elementwise::binary(self, op, a, b, out),
        )
    }

    fn masked(&self, op: MaskedOp, x: View<'_>, mask: View<'_>, out: View<'_>) -> Result<()> {
        check(self, "masked", &[out], &[x, mask], Aliasing::SameView)?;
        self.timed(
            || format!("masked {op:?} {}", describe(&x)),
            || elementwise::masked(self, op, x, mask, out),
        )
    }

    fn reduce(&self, op: ReduceOp, x: View<'_>, n_reduced: usize, out: View<'_>) -> Result<()> {
        check(self, "reduce", &[out], &[x], Aliasing::Disjoint)?;
        self.timed(
            || format!("reduce {op:?} {} → {}", describe(&x), describe(&out)),
            || rows::reduce(self, op, x, n_reduced, out),
        )
    }

    fn reduce_with_index(&self, args: ReduceWithIndex<'_>) -> Result<()> {
        let (writes, reads) = ([args.values, args.indices], [args.x]);
        check(
            self,
            "reduce_with_index",
            &writes,
            &reads,
            Aliasing::Disjoint,
        )?;
        self.timed(
            || format!("reduce_with_index {:?} {}", args.op, describe(&args.x)),
            || rows::reduce_with_index(self, args),
        )
    }

    fn matmul(&self, a: View<'_>, b: View<'_>, out: View<'_>, accumulate: bool) -> Result<()> {
        check(self, "matmul", &[out], &[a, b], Aliasing::Disjoint)?;
        self.timed(
            || format!("matmul {}·{}", describe(&a), describe(&b)),
            || matmul::matmul(self, a, b, out, accumulate),
        )
    }

    fn linear(&self, args: LinearForward<'_>) -> Result<()> {
        let ops = args.operands();
        check(self, "linear", &ops.writes, &ops.reads, Aliasing::Disjoint)?;
        self.timed(
            || {
                let gelu = matches!(args.epilogue, LinearEpilogue::Gelu { .. });
                format!(
                    "linear {}·{}ᵀ{}{}",
                    describe(&args.input),
                    describe(&args.weight),
                    if args.bias.is_some() { " +bias" } else { "" },
                    if gelu { " gelu" } else { "" }
                )
            },
            || linear::linear(self, args),
        )
    }

    fn linear_weight_grad(&self, args: LinearWeightGrad<'_>) -> Result<()> {
        let ops = args.operands();
        check(
            self,
            "linear_weight_grad",
            &ops.writes,
            &ops.reads,
            Aliasing::Disjoint,
        )?;
        self.timed(
            || {
                format!(
                    "linear_weight_grad {}ᵀ·{}{}",
                    describe(&args.grad_out),
                    describe(&args.input),
                    if args.grad_bias.is_some() {
                        " +bias"
                    } else {
                        ""
                    }
                )
            },
            || linear::linear_weight_grad(self, args),
        )
    }

    fn quantize_float8(&self, args: Float8Quantize<'_>) -> Result<bool> {
        let ops = args.operands();
        check(
            self,
            "quantize_float8",
            &ops.writes,
            &ops.reads,
            Aliasing::Disjoint,
        )?;
        self.timed(
            || {
                format!(
                    "quantize_float8 {:?} {}",
                    args.granularity,
                    describe(&args.x)
                )
            },
            || float8::quantize_float8(self, args),
        )
    }

    fn matmul_float8(&self, args: Float8Matmul<'_>) -> Result<bool> {
        let ops = args.operands();
        check(
            self,
            "matmul_float8",
            &ops.writes,
            &ops.reads,
            Aliasing::Disjoint,
        )?;
        self.timed(
            || format!("matmul_float8 {}·{}", describe(&args.a), describe(&args.b)),
            || linear::matmul_float8(self, args),
        )
    }

    fn softmax(&self, x: View<'_>, dim: usize, log: bool, out: View<'_>) -> Result<()> {
        check(self, "softmax", &[out], &[x], Aliasing::Disjoint)?;
        self.timed(
            || format!("softmax log={log} {}", describe(&x)),
            || rows::softmax(self, x, dim, log, out),
        )
    }

    fn softmax_backward(&self, args: SoftmaxBackward<'_>) -> Result<()> {
        let SoftmaxBackward { y, dy, dx, .. } = args;
        check(
            self,
            "softmax_backward",
            &[dx],
            &[y, dy],
            Aliasing::Disjoint,
        )?;
        self.timed(
            || format!("softmax_backward log={} {}", args.log, describe(&y)),
            || rows::softmax_backward(self, args),
        )
    }

    // The fused primitives, whose argument structs name their operands.
    fused_primitives! {
        layer_norm(LayerNormForward, x) => rows::layer_norm;
        layer_norm_backward(LayerNormBackward, x) => rows::layer_norm_backward;
        rms_norm(RmsNormForward, x) => llama::rms_norm;
        rms_norm_backward(RmsNormBackward, x) => llama::rms_norm_backward;
        swiglu(SwiGluForward, inputs.gate) => llama::swiglu;
        swiglu_backward(SwiGluBackward, inputs.gate) => llama::swiglu_backward;
        rotary_embedding(RotaryArgs, x) => llama::rotary_embedding;
        cross_entropy(CrossEntropyForward, input.logits) => index::cross_entropy;
        cross_entropy_backward(CrossEntropyBackward, input.logits) => index::cross_entropy_backward;
        cross_entropy_tile(CrossEntropyTile, tile.logits) => index::cross_entropy_tile;
        cross_entropy_tile_backward(CrossEntropyTileBackward, tile.logits) => index::cross_entropy_tile_backward;
    }

    fn gather(&self, x: View<'_>, dim: usize, index: View<'_>, out: View<'_>) -> Result<()> {
        check(self, "gather", &[out], &[x, index], Aliasing::Disjoint)?;
        self.timed(
            || format!("gather {} {}", describe(&x), describe(&index)),
            || index::gather(self, x, dim, index, out),
        )
    }

    fn scatter_add(&self, dst: View<'_>, dim: usize, index: View<'_>, src: View<'_>) -> Result<()> {
        check(
            self,
            "scatter_add",
            &[dst],
            &[index, src],
            Aliasing::Disjoint,
        )?;
        self.timed(
            || format!("scatter_add {} {}", describe(&dst), describe(&src)),
            || index::scatter_add(self, dst, dim, index, src),
        )
    }

    fn attention(&self, args: AttentionForward<'_>) -> Result<()> {
        let ops = args.operands();
        check(
            self,
            "attention",
            &ops.writes,
            &ops.reads,
            Aliasing::Disjoint,
        )?;
        self.timed(
            || format!("attention causal={} {}", args.causal, describe(&args.q)),
            || attention::attention(self, args),
        )
    }

    fn attention_backward(&self, args: AttentionBackward<'_>) -> Result<()> {
        let ops = args.operands();
        check(
            self,
            "attention_backward",
            &ops.writes,
            &ops.reads,
            Aliasing::Disjoint,
        )?;
        self.timed(
            || {
                let f = &args.forward;
                format!("attention_backward causal={} {}", f.causal, describe(&f.q))
            },
            || attention::attention_backward(self, args),
        )
    }

    fn dropout(&self, x: View<'_>, draw: DropoutDraw, out: View<'_>, mask: View<'_>) -> Result<()> {
        check(self, "dropout", &[out, mask], &[x], Aliasing::SameView)?;
        self.timed(
            || format!("dropout {}", describe(&x)),
            || index::dropout(self, x, draw, out, mask),
        )
    }

    fn random(&self, dst: View<'_>, draw: RandomDraw) -> Result<()> {
        check(self, "random", &[dst], &[], Aliasing::SameView)?;
        self.timed(
            || format!("random {}", describe(&dst)),
            || index::random(self, dst, draw),
        )
    }
}
