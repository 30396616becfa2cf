//! The CPU backend: every autograd-core primitive on host memory.
//!
//! [`CpuBackend`] implements [`Backend`] over a [`CachingAllocator`] of [`HostStorage`] (the
//! classic policy, since host memory cannot map pages), so `memory_allocated()` counts CPU
//! tensors exactly as it counts GPU ones. Kernels compute f32 and f64 natively and f16/bf16 in
//! f32; large elementwise walks, reductions, softmax, layer norm, RMSNorm, SwiGLU, the rotary
//! embedding and cross-entropy spread over
//! rayon, and GEMM goes through the `gemm` crate on strided operands. It is the reference the
//! CUDA backend is checked against, and the default on machines without a GPU.
//!
//! Every primitive starts with the same two steps (`CpuBackend::operands`): autograd-core's
//! operand check (each view inside its buffer, whose memory came from this backend's allocator;
//! no output reaching an element twice; outputs sharing memory with inputs only as the very same
//! view of an elementwise primitive) and a host claim on the operands' buffers (outputs alone,
//! inputs shared), so a kernel's threads are the only ones touching its outputs. Only then does a
//! kernel turn a buffer's address into a pointer.
//!
//! This crate sits on autograd-core (the trait and views) and the caching allocator. It knows
//! nothing about the graph: it only fills output views.
//!
//! ```
//! use headroom_autograd_core::{DType, SoftmaxBackward, Tensor};
//!
//! let cpu = headroom_ops_cpu::CpuBackend::new_ref();
//! let x = Tensor::from_slice(&cpu, &[1.0f32, 2.0, 3.0], &[3])?;
//! x.requires_grad_(true)?;
//! x.mul(&x)?.sum_all()?.backward()?;
//! assert_eq!(x.grad().unwrap().to_vec::<f32>()?, vec![2.0, 4.0, 6.0]);
//! # Ok::<(), headroom_autograd_core::TensorError>(())
//! ```

mod attention;
mod cross_entropy;
mod element;
mod elementwise;
mod float8;
mod index;
mod layer_norm;
mod matmul;
mod reduce;
mod rms_norm;
mod rotary;
mod softmax;
mod strided;
mod swiglu;

use std::sync::Arc;

use headroom_autograd_core::{
    check_operands, claim_operands, Access, Aliasing, AttentionBackward, AttentionForward, Backend,
    BackendRef, BinaryOp, Buffer, CrossEntropyBackward, CrossEntropyForward, CrossEntropyTile,
    CrossEntropyTileBackward, Device, DropoutDraw, HostAccess, LayerNormBackward, LayerNormForward,
    MaskedOp, RandomDraw, ReduceOp, Result, UnaryOp, View,
};
use headroom_autograd_core::{
    float8_quantize_dims, Float8Matmul, Float8Quantize, Operands, ReduceWithIndex, RmsNormBackward,
    RmsNormForward, RotaryArgs, SoftmaxBackward, SwiGluBackward, SwiGluForward,
};
use headroom_caching_allocator::{
    AllocError, Allocation, AllocatorConfig, AllocatorView, CachingAllocator, HostStorage, StreamId,
};
use parking_lot::Mutex;

/// The CPU backend: host memory from a caching allocator, kernels on rayon's pool.
#[derive(Debug)]
pub struct CpuBackend {
    allocator: CachingAllocator<HostStorage>,
    free_errors: Mutex<FreeErrors>,
}

/// Frees that failed (they cannot be reported from `Drop`): the first error and a count.
#[derive(Debug, Default)]
struct FreeErrors {
    first: Option<AllocError>,
    count: u64,
}

impl Default for CpuBackend {
    fn default() -> Self {
        CpuBackend::new(CachingAllocator::new(
            HostStorage::new(),
            AllocatorConfig::default(),
        ))
    }
}

impl CpuBackend {
    /// A backend over `allocator`.
    pub fn new(allocator: CachingAllocator<HostStorage>) -> CpuBackend {
        CpuBackend {
            allocator,
            free_errors: Mutex::new(FreeErrors::default()),
        }
    }

    /// A fresh backend with its own allocator (default settings), as a shared handle.
    pub fn new_ref() -> BackendRef {
        Arc::new(CpuBackend::default())
    }

    /// The allocator, for statistics, snapshots and `empty_cache`.
    pub fn allocator(&self) -> &CachingAllocator<HostStorage> {
        &self.allocator
    }

    /// The number of frees that failed, and the first failure, since creation.
    pub fn free_errors(&self) -> (u64, Option<String>) {
        let errors = self.free_errors.lock();
        (errors.count, errors.first.as_ref().map(ToString::to_string))
    }

    /// Checks a primitive's operands against autograd-core's rules (`check_operands`: inside
    /// their buffers, memory of this backend's allocator, no forbidden overlap) and claims their
    /// buffers for the kernel: what every primitive does before it touches memory.
    fn operands<'a>(
        &self,
        op: &'static str,
        writes: &[View<'a>],
        reads: &[View<'a>],
        aliasing: Aliasing,
    ) -> Result<HostAccess<'a>> {
        check_operands(self.allocator.id(), op, writes, reads, aliasing)?;
        claim_operands(op, writes, reads)
    }

    /// [`CpuBackend::operands`] for a fused primitive's [`Operands`], none overlapping.
    fn fused_operands<'a>(
        &self,
        op: &'static str,
        operands: Operands<'a>,
    ) -> Result<HostAccess<'a>> {
        self.operands(op, &operands.writes, &operands.reads, Aliasing::Disjoint)
    }
}

/// The `Backend` methods of fused primitives: each claims the operands its argument struct
/// names (`operands()`: writes and reads, disjoint) for the call, then runs the module's
/// function. One row a primitive: `name(ArgStruct) => module::function;`.
macro_rules! fused_primitives {
    ($($name:ident($args:ident) => $run:path;)*) => {
        $(
            fn $name(&self, args: $args<'_>) -> Result<()> {
                let _access = self.fused_operands(stringify!($name), args.operands())?;
                $run(args)
            }
        )*
    };
}

impl Backend for CpuBackend {
    fn device(&self) -> Device {
        Device::Cpu
    }

    fn into_any(self: Arc<Self>) -> Arc<dyn std::any::Any + Send + Sync> {
        self
    }

    fn allocate(&self, bytes: u64) -> Result<Allocation> {
        Ok(self.allocator.allocate(bytes, StreamId::DEFAULT)?)
    }

    fn free(&self, allocation: Allocation) {
        if let Err(error) = self.allocator.free(allocation) {
            let mut errors = self.free_errors.lock();
            errors.count += 1;
            errors.first.get_or_insert(error);
        }
    }

    fn allocator_view(&self) -> &dyn AllocatorView {
        &self.allocator
    }

    /// Nothing to wait for: every primitive has finished when it returns.
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    fn write_host(&self, dst: &Buffer, byte_offset: usize, data: &[u8]) -> Result<()> {
        dst.check_range("write_host", byte_offset, data.len())?;
        if data.is_empty() {
            return Ok(());
        }
        dst.check_owner("write_host", self.allocator.id())?;
        let _access = HostAccess::claim("write_host", [(dst, Access::Write)])?;
        // SAFETY: the range is inside the live host buffer (checked above: memory of this
        // backend's host allocator), claimed alone for this copy, and `data` is a separate host
        // slice, so the regions do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                (dst.address() as *mut u8).add(byte_offset),
                data.len(),
            );
        }
        Ok(())
    }

    fn read_host(&self, src: &Buffer, byte_offset: usize, out: &mut [u8]) -> Result<()> {
        src.check_range("read_host", byte_offset, out.len())?;
        if out.is_empty() {
            return Ok(());
        }
        src.check_owner("read_host", self.allocator.id())?;
        let _access = HostAccess::claim("read_host", [(src, Access::Read)])?;
        // SAFETY: the range is inside the live host buffer (checked above: memory of this
        // backend's host allocator), claimed with no writer, and `out` is a separate, exclusively
        // borrowed host slice.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (src.address() as *const u8).add(byte_offset),
                out.as_mut_ptr(),
                out.len(),
            );
        }
        Ok(())
    }

    fn copy(&self, src: View<'_>, dst: View<'_>) -> Result<()> {
        let _access = self.operands("copy", &[dst], &[src], Aliasing::SameView)?;
        elementwise::copy(src, dst)
    }

    fn fill(&self, dst: View<'_>, value: f64) -> Result<()> {
        let _access = self.operands("fill", &[dst], &[], Aliasing::SameView)?;
        elementwise::fill(dst, value)
    }

    fn unary(&self, op: UnaryOp, x: View<'_>, out: View<'_>) -> Result<()> {
        let _access = self.operands("unary", &[out], &[x], Aliasing::SameView)?;
        elementwise::unary(op, x, out)
    }

    fn binary(&self, op: BinaryOp, a: View<'_>, b: View<'_>, out: View<'_>) -> Result<()> {
        let _access = self.operands("binary", &[out], &[a, b], Aliasing::SameView)?;
        elementwise::binary(op, a, b, out)
    }

    fn masked(&self, op: MaskedOp, x: View<'_>, mask: View<'_>, out: View<'_>) -> Result<()> {
        let _access = self.operands("masked", &[out], &[x, mask], Aliasing::SameView)?;
        elementwise::masked(op, x, mask, out)
    }

    fn reduce(&self, op: ReduceOp, x: View<'_>, n_reduced: usize, out: View<'_>) -> Result<()> {
        let _access = self.operands("reduce", &[out], &[x], Aliasing::Disjoint)?;
        reduce::reduce(op, x, n_reduced, out)
    }

    fn reduce_with_index(&self, args: ReduceWithIndex<'_>) -> Result<()> {
        let (writes, reads) = ([args.values, args.indices], [args.x]);
        let _access = self.operands("reduce_with_index", &writes, &reads, Aliasing::Disjoint)?;
        reduce::reduce_with_index(args)
    }

    fn matmul(&self, a: View<'_>, b: View<'_>, out: View<'_>, accumulate: bool) -> Result<()> {
        let _access = self.operands("matmul", &[out], &[a, b], Aliasing::Disjoint)?;
        matmul::matmul(a, b, out, accumulate)
    }

    fn quantize_float8(&self, args: Float8Quantize<'_>) -> Result<bool> {
        // An activation is left to the core (the unary op, then this quantize): the same bits.
        if args.activation.is_some() {
            float8_quantize_dims(&args)?;
            return Ok(false);
        }
        let _access = self.fused_operands("quantize_float8", args.operands())?;
        float8::quantize_float8(args)?;
        Ok(true)
    }

    fn matmul_float8(&self, args: Float8Matmul<'_>) -> Result<bool> {
        let _access = self.fused_operands("matmul_float8", args.operands())?;
        matmul::matmul_float8(args)?;
        Ok(true)
    }

    fn softmax(&self, x: View<'_>, dim: usize, log: bool, out: View<'_>) -> Result<()> {
        let _access = self.operands("softmax", &[out], &[x], Aliasing::Disjoint)?;
        softmax::softmax(x, dim, log, out)
    }

    fn softmax_backward(&self, args: SoftmaxBackward<'_>) -> Result<()> {
        let (writes, reads) = ([args.dx], [args.y, args.dy]);
        let _access = self.operands("softmax_backward", &writes, &reads, Aliasing::Disjoint)?;
        softmax::softmax_backward(args)
    }

    // The fused primitives, whose argument structs name their operands.
    fused_primitives! {
        layer_norm(LayerNormForward) => layer_norm::layer_norm;
        layer_norm_backward(LayerNormBackward) => layer_norm::layer_norm_backward;
        rms_norm(RmsNormForward) => rms_norm::rms_norm;
        rms_norm_backward(RmsNormBackward) => rms_norm::rms_norm_backward;
        swiglu(SwiGluForward) => swiglu::swiglu;
        swiglu_backward(SwiGluBackward) => swiglu::swiglu_backward;
        rotary_embedding(RotaryArgs) => rotary::rotary_embedding;
        cross_entropy(CrossEntropyForward) => cross_entropy::cross_entropy;
        cross_entropy_backward(CrossEntropyBackward) => cross_entropy::cross_entropy_backward;
        cross_entropy_tile(CrossEntropyTile) => cross_entropy::cross_entropy_tile;
        cross_entropy_tile_backward(CrossEntropyTileBackward) => cross_entropy::cross_entropy_tile_backward;
        attention(AttentionForward) => attention::attention;
        attention_backward(AttentionBackward) => attention::attention_backward;
    }

    fn gather(&self, x: View<'_>, dim: usize, index: View<'_>, out: View<'_>) -> Result<()> {
        let _access = self.operands("gather", &[out], &[x, index], Aliasing::Disjoint)?;
        index::gather(x, dim, index, out)
    }

    fn scatter_add(&self, dst: View<'_>, dim: usize, index: View<'_>, src: View<'_>) -> Result<()> {
        let _access = self.operands("scatter_add", &[dst], &[index, src], Aliasing::Disjoint)?;
        index::scatter_add(dst, dim, index, src)
    }

    fn dropout(&self, x: View<'_>, draw: DropoutDraw, out: View<'_>, mask: View<'_>) -> Result<()> {
        let _access = self.operands("dropout", &[out, mask], &[x], Aliasing::SameView)?;
        elementwise::dropout(x, draw, out, mask)
    }

    fn random(&self, dst: View<'_>, draw: RandomDraw) -> Result<()> {
        let _access = self.operands("random", &[dst], &[], Aliasing::SameView)?;
        elementwise::random(dst, draw)
    }
}
