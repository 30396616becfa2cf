//! A backend decorator that counts host reads: how a test proves a step never synchronises.
//!
//! `Backend::read_host` and `Backend::synchronize` are the only ways autograd-core's backend
//! trait waits for a device, so a step that calls them zero times (tensor reads, `item`, error
//! checks that read flags, explicit waits) never stalls the launch queue through the trait.
//! [`HostReadCounter`] forwards every method to the backend it wraps and counts both calls as
//! host reads (a wait is a read of the device's progress); tensors made on it live on the
//! wrapped device. [`HostReadCounter::hiding_float8`] also hides the wrapped backend's fp8
//! primitives (`quantize_float8`, `matmul_float8` answer "not here"), so a test runs the core's
//! composed fp8 path (a backend without them, such as CUDA's today) on the CPU.
//! It sits on autograd-core's trait only and knows no device.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use headroom_autograd_core::{
    float8_matmul_dims, float8_quantize_dims, Float8Matmul, Float8Quantize, ReduceWithIndex,
    RmsNormBackward, RmsNormForward, RotaryArgs, SwiGluBackward, SwiGluForward,
};
use headroom_autograd_core::{
    AttentionBackward, AttentionForward, Backend, BackendRef, BinaryOp, Buffer,
    CrossEntropyBackward, CrossEntropyForward, CrossEntropyTile, CrossEntropyTileBackward, Device,
    DropoutDraw, LayerNormBackward, LayerNormForward, MaskedOp, RandomDraw, ReduceOp, Result,
    SoftmaxBackward, UnaryOp, View,
};
use headroom_caching_allocator::{Allocation, AllocatorView};

/// A backend that counts its `read_host` and `synchronize` calls and forwards everything to the
/// one it wraps.
#[derive(Debug)]
pub struct HostReadCounter {
    inner: BackendRef,
    host_reads: AtomicU64,
    float8_primitives: bool,
}

impl HostReadCounter {
    /// `inner`, counting its host reads from 0.
    pub fn wrap(inner: BackendRef) -> Arc<HostReadCounter> {
        Arc::new(HostReadCounter {
            inner,
            host_reads: AtomicU64::new(0),
            float8_primitives: true,
        })
    }

    /// [`HostReadCounter::wrap`] whose fp8 primitives answer `false` (the trait's default bodies),
    /// whatever `inner` has: ops on it compose their fp8 casts and products.
    pub fn hiding_float8(inner: BackendRef) -> Arc<HostReadCounter> {
        Arc::new(HostReadCounter {
            inner,
            host_reads: AtomicU64::new(0),
            float8_primitives: false,
        })
    }

    /// Host reads (`read_host` and `synchronize` calls) so far.
    pub fn host_reads(&self) -> u64 {
        self.host_reads.load(Ordering::SeqCst)
    }
}

impl Backend for HostReadCounter {
    fn device(&self) -> Device {
        self.inner.device()
    }
    fn into_any(self: Arc<Self>) -> Arc<dyn std::any::Any + Send + Sync> {
        self
    }
    fn allocate(&self, bytes: u64) -> Result<Allocation> {
        self.inner.allocate(bytes)
    }
    fn free(&self, allocation: Allocation) {
        self.inner.free(allocation)
    }
    fn allocator_view(&self) -> &dyn AllocatorView {
        self.inner.allocator_view()
    }
    fn matmul_workspace_bytes(&self) -> usize {
        self.inner.matmul_workspace_bytes()
    }
    fn synchronize(&self) -> Result<()> {
        self.host_reads.fetch_add(1, Ordering::SeqCst);
        self.inner.synchronize()
    }
    fn write_host(&self, dst: &Buffer, offset: usize, data: &[u8]) -> Result<()> {
        self.inner.write_host(dst, offset, data)
    }
    fn read_host(&self, src: &Buffer, offset: usize, out: &mut [u8]) -> Result<()> {
        self.host_reads.fetch_add(1, Ordering::SeqCst);
        self.inner.read_host(src, offset, out)
    }
    fn copy(&self, src: View<'_>, dst: View<'_>) -> Result<()> {
        self.inner.copy(src, dst)
    }
    fn quantize_float8(&self, args: Float8Quantize<'_>) -> Result<bool> {
        if !self.float8_primitives {
            float8_quantize_dims(&args)?;
            return Ok(false);
        }
        self.inner.quantize_float8(args)
    }
    fn matmul_float8(&self, args: Float8Matmul<'_>) -> Result<bool> {
        if !self.float8_primitives {
            float8_matmul_dims(&args)?;
            return Ok(false);
        }
        self.inner.matmul_float8(args)
    }
    fn random(&self, dst: View<'_>, draw: RandomDraw) -> Result<()> {
        self.inner.random(dst, draw)
    }
    fn fill(&self, dst: View<'_>, value: f64) -> Result<()> {
        self.inner.fill(dst, value)
    }
    fn unary(&self, op: UnaryOp, x: View<'_>, out: View<'_>) -> Result<()> {
        self.inner.unary(op, x, out)
    }
    fn binary(&self, op: BinaryOp, a: View<'_>, b: View<'_>, out: View<'_>) -> Result<()> {
        self.inner.binary(op, a, b, out)
    }
    fn masked(&self, op: MaskedOp, x: View<'_>, mask: View<'_>, out: View<'_>) -> Result<()> {
        self.inner.masked(op, x, mask, out)
    }
    fn reduce(&self, op: ReduceOp, x: View<'_>, n_reduced: usize, out: View<'_>) -> Result<()> {
        self.inner.reduce(op, x, n_reduced, out)
    }
    fn reduce_with_index(&self, args: ReduceWithIndex<'_>) -> Result<()> {
        self.inner.reduce_with_index(args)
    }
    fn matmul(&self, a: View<'_>, b: View<'_>, out: View<'_>, accumulate: bool) -> Result<()> {
        self.inner.matmul(a, b, out, accumulate)
    }
    fn softmax(&self, x: View<'_>, dim: usize, log: bool, out: View<'_>) -> Result<()> {
        self.inner.softmax(x, dim, log, out)
    }
    fn softmax_backward(&self, args: SoftmaxBackward<'_>) -> Result<()> {
        self.inner.softmax_backward(args)
    }
    fn layer_norm(&self, args: LayerNormForward<'_>) -> Result<()> {
        self.inner.layer_norm(args)
    }
    fn layer_norm_backward(&self, args: LayerNormBackward<'_>) -> Result<()> {
        self.inner.layer_norm_backward(args)
    }
    fn rms_norm(&self, args: RmsNormForward<'_>) -> Result<()> {
        self.inner.rms_norm(args)
    }
    fn rms_norm_backward(&self, args: RmsNormBackward<'_>) -> Result<()> {
        self.inner.rms_norm_backward(args)
    }
    fn swiglu(&self, args: SwiGluForward<'_>) -> Result<()> {
        self.inner.swiglu(args)
    }
    fn swiglu_backward(&self, args: SwiGluBackward<'_>) -> Result<()> {
        self.inner.swiglu_backward(args)
    }
    fn rotary_embedding(&self, args: RotaryArgs<'_>) -> Result<()> {
        self.inner.rotary_embedding(args)
    }
    fn cross_entropy(&self, args: CrossEntropyForward<'_>) -> Result<()> {
        self.inner.cross_entropy(args)
    }
    fn cross_entropy_backward(&self, args: CrossEntropyBackward<'_>) -> Result<()> {
        self.inner.cross_entropy_backward(args)
    }
    fn cross_entropy_tile(&self, args: CrossEntropyTile<'_>) -> Result<()> {
        self.inner.cross_entropy_tile(args)
    }
    fn cross_entropy_tile_backward(&self, args: CrossEntropyTileBackward<'_>) -> Result<()> {
        self.inner.cross_entropy_tile_backward(args)
    }
    fn gather(&self, x: View<'_>, dim: usize, index: View<'_>, out: View<'_>) -> Result<()> {
        self.inner.gather(x, dim, index, out)
    }
    fn scatter_add(&self, dst: View<'_>, dim: usize, index: View<'_>, src: View<'_>) -> Result<()> {
        self.inner.scatter_add(dst, dim, index, src)
    }
    fn attention(&self, args: AttentionForward<'_>) -> Result<()> {
        self.inner.attention(args)
    }
    fn attention_backward(&self, args: AttentionBackward<'_>) -> Result<()> {
        self.inner.attention_backward(args)
    }
    fn dropout(&self, x: View<'_>, draw: DropoutDraw, out: View<'_>, mask: View<'_>) -> Result<()> {
        self.inner.dropout(x, draw, out, mask)
    }
}
