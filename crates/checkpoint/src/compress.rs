//! Compression of saved activations: what a region saves for backward is kept in 8 or 16 bits
//! and restored when backward needs it.
//!
//! [`compress`] runs a region (any closure from tensors to tensors) under saved-tensor hooks: the
//! pack hook encodes each saved tensor it selects and lets the original go (its memory is freed
//! as soon as the forward no longer holds it), the unpack hook decodes it into a fresh tensor of
//! the saved shape and strides. [`CompressBlocks`] does this per model block as an nn
//! [`BlockRunner`], optionally around a [`checkpoint`](crate::checkpoint) so that only each
//! block's saved input is kept, compressed.
//!
//! Two codecs ([`Compression`]):
//! - `Int8Blockwise { block }`: linear symmetric absmax quantisation per block of `block`
//!   consecutive elements (one f32 absmax per block, one signed byte per element; `codec.rs`
//!   has the formula and its error bound), 1 + 4 / `block` bytes per element: 0.254× of f32 at
//!   the default block of 256. Linear rather than bitsandbytes' dynamic map: on
//!   activation-like data (blocks of 256 or 2048 of Gaussian or GELU outputs) its relative RMS
//!   error is lower (0.70% against 1.08% on Gaussian data, 0.99% against 1.05% after a GELU, at
//!   block 256), it has a plain worst-case bound (`absmax / 254`), and it needs no table search;
//!   the dynamic map only wins on blocks with large outliers (2.1% against 1.5% with 1% of values
//!   ×10), which the small default block keeps local. Blocks follow memory order, so choose one
//!   that divides the rows (the last dim): a block spanning rows of other scales (a class
//!   token's row beside patch rows) quantises the smaller row coarsely, and layer norm's backward
//!   amplifies that. The default 256 divides the widths of ViT-B/L and GPT-2 (768, 1024, 4096).
//! - `Bf16`: a round-to-nearest-even cast, 2 bytes per element (relative error ≤ 2^-8); for f32
//!   and f64 tensors only (on 2-byte tensors it would save nothing).
//!
//! Which saved tensors are compressed ([`CompressActivations`], the default policy):
//! - floating tensors only: integer and boolean saves (indices, dropout masks) are kept as they
//!   are, whatever the policy says;
//! - never parameters: a save whose [`SaveSite::is_parameter`] is set (a leaf that requires
//!   grad, such as a linear's weight) lives on after backward, so compressing it would free
//!   nothing; always kept, whatever the policy says. The default policy also keeps a linear's
//!   weight operand when it is not a leaf (a cast copy under autocast);
//! - only an op's inputs and outputs of at least `min_elements` elements: intermediates an op
//!   computed for its backward (layer norm's mean and rstd, the log-sum-exp of attention and
//!   cross-entropy, an in-place op's old values) are small, and backward amplifies their errors
//!   (`exp(s - lse)`), so they are kept;
//! - a codec that would not shrink the tensor (bf16 of a 2-byte tensor) keeps it too.
//!
//! A [`CompressFn`] chooses per [`SaveSite`] (op, role, shape, dtype) instead, in
//! [`SavePolicy`](crate::SavePolicy)'s style.
//!
//! Two saves of one storage span within one region (attention's output and the next linear's
//! input are the same memory) share one compressed copy. Encoded data lives in tensors of the
//! saved tensor's backend, so the allocator counts it. On the CPU the codec runs on host memory
//! with rayon; on CUDA tensors (feature `cuda`) it is one fused kernel each way
//! (`kernels/compress.cu`: absmax per block and codes in one pass; decode in one pass); the two
//! give the same bits. Autograd's version check still guards every save: a tensor written in
//! place after it was saved is [`TensorError::ModifiedInPlace`] at backward, compressed or not.
//!
//! This module sits on autograd-core's saved-tensor hooks and nn's block seam; it knows no model.

mod codec;
#[cfg(feature = "cuda")]
mod cuda;

use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use headroom_autograd_core::{
    is_grad_enabled, saved_tensor_hooks, Buffer, DType, Device, Packed, SaveRole, SaveSite, Tensor,
    TensorError,
};
use headroom_nn::{BlockForward, BlockRunner};

use crate::blocks::{nn_to_tensor, BlockSelection};
use crate::error::CheckpointError;
use crate::region::{checkpoint_with, CheckpointOptions};

pub use codec::{
    dequantize_int8_blockwise, quantize_int8_blockwise, CodecElement, INT8_BLOCK_RANGE,
    INT8_ERROR_BOUND, INT8_LEVELS,
};
#[cfg(feature = "cuda")]
pub use cuda::{dequantize_int8_device, quantize_int8_device};

/// The default 8-bit block: 256 elements (a warp's 8 elements per lane on the GPU; absmax adds
/// 1/64 to the codes' bytes).
pub const DEFAULT_BLOCK: usize = 256;

/// The default policy's smallest compressed save: 16 Ki elements (64 KiB of f32). Below it the
/// allocator's 512-byte rounding of the two encoded tensors and a kernel launch cost more than
/// they save.
pub const DEFAULT_MIN_ELEMENTS: usize = 1 << 14;

/// How a saved tensor is encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Compression {
    /// Linear symmetric absmax quantisation to signed bytes, one f32 absmax per `block`
    /// consecutive elements (a power of two from 32 to 4096; best a divisor of the row length).
    Int8Blockwise {
        /// Elements per absmax.
        block: usize,
    },
    /// bfloat16, rounded to nearest even (for f32 and f64 tensors).
    Bf16,
}

impl Default for Compression {
    /// 8 bits in blocks of [`DEFAULT_BLOCK`].
    fn default() -> Self {
        Compression::Int8Blockwise {
            block: DEFAULT_BLOCK,
        }
    }
}

impl Compression {
    /// Bytes the encoded form of `numel` elements takes (before the allocator's rounding).
    pub fn encoded_bytes(self, numel: usize) -> u64 {
        match self {
            Compression::Int8Blockwise { block } => {
                numel as u64 + 4 * numel.div_ceil(block.max(1)) as u64
            }
            Compression::Bf16 => 2 * numel as u64,
        }
    }

    /// Checks the codec's parameters (the 8-bit block size).
    pub fn check(self) -> Result<(), CheckpointError> {
        match self {
            Compression::Int8Blockwise { block } => codec::check_block("compress", block),
            Compression::Bf16 => Ok(()),
        }
    }

    /// Whether encoding a tensor of `dtype` saves memory.
    fn shrinks(self, dtype: DType) -> bool {
        match self {
            Compression::Int8Blockwise { .. } => dtype.size_in_bytes() >= 2,
            Compression::Bf16 => dtype.size_in_bytes() >= 4,
        }
    }
}

/// Chooses, per saved tensor, whether it is compressed and how.
pub trait CompressPolicy: Send + Sync + std::fmt::Debug {
    /// The codec for the tensor `site` describes, or `None` to keep it as it is. Integer and
    /// boolean tensors and parameters are kept whatever this answers.
    fn choose(&self, site: &SaveSite) -> Option<Compression>;
}

/// The default policy: `compression` for every op input or output of at least `min_elements`
/// elements (not a linear's weight operand); intermediates and smaller saves are kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CompressActivations {
    /// The codec.
    pub compression: Compression,
    /// The smallest save compressed, in elements.
    pub min_elements: usize,
}

impl CompressPolicy for CompressActivations {
    fn choose(&self, site: &SaveSite) -> Option<Compression> {
        let numel: usize = site.shape.iter().product();
        let activation = match site.role {
            SaveRole::Input(i) => !(site.op == "linear" && i == 1),
            SaveRole::Output(_) => true,
            SaveRole::Intermediate(_) => false,
        };
        (activation && numel >= self.min_elements).then_some(self.compression)
    }
}

/// A policy from a closure over the [`SaveSite`].
pub struct CompressFn<F>(pub F);

impl<F> std::fmt::Debug for CompressFn<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CompressFn")
    }
}

impl<F: Fn(&SaveSite) -> Option<Compression> + Send + Sync> CompressPolicy for CompressFn<F> {
    fn choose(&self, site: &SaveSite) -> Option<Compression> {
        (self.0)(site)
    }
}

/// How [`compress`] treats a region's saves.
#[derive(Debug, Clone)]
pub struct CompressOptions {
    /// Which saved tensors are compressed, and how.
    pub policy: Arc<dyn CompressPolicy>,
}

impl CompressOptions {
    /// The default policy ([`CompressActivations`], [`DEFAULT_MIN_ELEMENTS`]) with `compression`.
    pub fn new(compression: Compression) -> CompressOptions {
        CompressOptions {
            policy: Arc::new(CompressActivations {
                compression,
                min_elements: DEFAULT_MIN_ELEMENTS,
            }),
        }
    }
}

impl Default for CompressOptions {
    /// 8 bits in blocks of 256, activations of 16 Ki elements or more.
    fn default() -> Self {
        CompressOptions::new(Compression::default())
    }
}

/// Runs `region` on `inputs` with what it saves for backward compressed as `options` says, and
/// decompressed when backward needs it.
///
/// ```
/// use headroom_autograd_core::{DType, Tensor};
/// use headroom_checkpoint::{compress, CompressOptions, Compression};
///
/// let cpu = headroom_ops_cpu::CpuBackend::new_ref();
/// let x = Tensor::full(&cpu, &[1 << 16], 0.5, DType::F32)?;
/// x.requires_grad_(true)?;
/// let before = cpu.memory_stats().allocated_bytes.all.current;
/// let options = CompressOptions::new(Compression::Int8Blockwise { block: 256 });
/// let y = compress(|xs| Ok(vec![xs[0].exp()?.tanh()?]), &[x.clone()], &options)?;
/// // exp and tanh each save their 256 KiB output; each is kept as 64 KiB of codes and 1 KiB
/// // of absmax, and the output itself stays.
/// let kept = cpu.memory_stats().allocated_bytes.all.current - before;
/// assert_eq!(kept, 2 * (65536 + 1024) + 262144);
/// y[0].sum_all()?.backward()?;
/// # Ok::<(), headroom_checkpoint::CheckpointError>(())
/// ```
pub fn compress(
    region: impl FnOnce(&[Tensor]) -> Result<Vec<Tensor>, TensorError>,
    inputs: &[Tensor],
    options: &CompressOptions,
) -> Result<Vec<Tensor>, CheckpointError> {
    if !is_grad_enabled() {
        return region(inputs).map_err(CheckpointError::from_engine);
    }
    let compressor = Arc::new(Compressor {
        policy: Arc::clone(&options.policy),
        spans: Mutex::new(Vec::new()),
    });
    let outputs = {
        let packing = Arc::clone(&compressor);
        let _hooks = saved_tensor_hooks(
            move |site, tensor| {
                packing
                    .pack(site, tensor)
                    .map_err(CheckpointError::into_tensor_error)
            },
            unpack,
        );
        region(inputs)
    };
    // Spans are shared within the region's forward only; dropping them here leaves each
    // encoded copy to the saves that hold it.
    compressor.spans.lock().clear();
    outputs.map_err(CheckpointError::from_engine)
}

/// Runs a model's blocks with the selected ones' saved activations compressed (an nn
/// [`BlockRunner`]); with `checkpoint` set, each selected block is checkpointed and only its
/// saved input is compressed.
///
/// ```
/// use std::sync::Arc;
/// use headroom_autograd_core::{DType, Generator, Tensor};
/// use headroom_checkpoint::CompressBlocks;
/// use headroom_nn::{BlockStack, VisionTransformer, VitConfig};
///
/// let cpu = headroom_ops_cpu::CpuBackend::new_ref();
/// let generator = Arc::new(Generator::new(0));
/// let mut vit = VisionTransformer::new(&cpu, VitConfig::tiny(), DType::F32, &generator)?;
/// vit.set_block_runner(Some(Arc::new(CompressBlocks::all())));
/// let images = Tensor::ones(&cpu, &[2, 3, 32, 32], DType::F32)?;
/// vit.forward(&images)?.sum_all()?.backward()?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct CompressBlocks {
    /// The blocks whose saves are compressed.
    pub selection: BlockSelection,
    /// Which saves, and how.
    pub options: CompressOptions,
    /// Checkpoint each selected block too (its saved input is then what is compressed).
    pub checkpoint: Option<CheckpointOptions>,
}

impl CompressBlocks {
    /// Every block, 8 bits in blocks of 256, no checkpointing.
    pub fn all() -> CompressBlocks {
        CompressBlocks {
            selection: BlockSelection::All,
            options: CompressOptions::default(),
            checkpoint: None,
        }
    }
}

impl BlockRunner for CompressBlocks {
    fn run(
        &self,
        index: usize,
        block: BlockForward,
        input: &Tensor,
    ) -> headroom_nn::Result<Tensor> {
        if !self.selection.contains(index) {
            return block(input);
        }
        let inputs = std::slice::from_ref(input);
        let outputs = match &self.checkpoint {
            None => compress(
                |xs| Ok(vec![block(&xs[0]).map_err(nn_to_tensor)?]),
                inputs,
                &self.options,
            ),
            Some(checkpoint) => compress(
                move |xs| {
                    let region =
                        move |ys: &[Tensor]| Ok(vec![block(&ys[0]).map_err(nn_to_tensor)?]);
                    checkpoint_with(region, xs, checkpoint).map_err(|e| e.into_tensor_error())
                },
                inputs,
                &self.options,
            ),
        }
        .map_err(CheckpointError::into_nn_error)?;
        Ok(outputs.into_iter().next().expect("one output"))
    }
}

/// A region's pack state: its policy and, during its forward, the spans compressed so far.
struct Compressor {
    policy: Arc<dyn CompressPolicy>,
    spans: Mutex<Vec<SharedSpan>>,
}

/// A storage span compressed in this region's forward, for the saves of the same span after it.
struct SharedSpan {
    /// The storage (a weak handle: its address cannot be reused while this lives).
    buffer: Weak<Buffer>,
    version: u64,
    span: Span,
    dtype: DType,
    compression: Compression,
    encoded: Arc<Encoded>,
}

/// The elements of a storage a save covers.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Span {
    /// `numel` consecutive elements from `offset`, in any dim order.
    Dense { offset: usize, numel: usize },
    /// A view that is not dense: encoded from a dense copy.
    Strided {
        offset: usize,
        shape: Vec<usize>,
        strides: Vec<usize>,
    },
}

/// What the pack hook keeps.
enum Stored {
    /// The tensor, as saved (not selected).
    Kept(Tensor),
    /// An encoded span and the saved view's shape and strides over it.
    Compressed {
        encoded: Arc<Encoded>,
        shape: Vec<usize>,
        strides: Vec<usize>,
    },
}

/// Encoded elements, in the tensors of the saved tensor's backend.
enum Encoded {
    Int8 {
        dtype: DType,
        codes: Tensor,
        absmax: Tensor,
        block: usize,
    },
    Bf16 {
        dtype: DType,
        data: Tensor,
    },
}

fn unpack(packed: &Packed) -> Result<Tensor, TensorError> {
    let stored = packed
        .downcast_ref::<Stored>()
        .expect("compress's hooks unpack only what they packed");
    match stored {
        Stored::Kept(tensor) => Ok(tensor.clone()),
        Stored::Compressed {
            encoded,
            shape,
            strides,
        } => encoded
            .decode()
            .and_then(|flat| Ok(flat.as_strided(shape, strides, 0)?))
            .map_err(CheckpointError::into_tensor_error),
    }
}

impl Compressor {
    fn pack(&self, site: &SaveSite, tensor: Tensor) -> Result<Packed, CheckpointError> {
        let chosen = if site.dtype.is_float() && !site.is_parameter && tensor.numel() > 0 {
            self.policy.choose(site)
        } else {
            None
        };
        let Some(compression) = chosen.filter(|c| c.shrinks(site.dtype)) else {
            return Ok(Box::new(Stored::Kept(tensor)));
        };
        compression.check()?;
        let layout = tensor.layout();
        let (span, strides) = if is_dense(tensor.shape(), tensor.strides()) {
            let span = Span::Dense {
                offset: layout.offset(),
                numel: tensor.numel(),
            };
            (span, tensor.strides().to_vec())
        } else {
            let span = Span::Strided {
                offset: layout.offset(),
                shape: tensor.shape().to_vec(),
                strides: tensor.strides().to_vec(),
            };
            (span, contiguous_strides(tensor.shape()))
        };
        let encoded = self.encoded(&tensor, span, compression)?;
        Ok(Box::new(Stored::Compressed {
            encoded,
            shape: tensor.shape().to_vec(),
            strides,
        }))
    }

    /// The encoded `span` of `tensor`'s storage: shared with an earlier save of the same span
    /// (same storage, version, dtype and codec), else encoded now.
    fn encoded(
        &self,
        tensor: &Tensor,
        span: Span,
        compression: Compression,
    ) -> Result<Arc<Encoded>, CheckpointError> {
        let buffer = tensor.buffer();
        let mut spans = self.spans.lock();
        let shared = spans.iter().find(|s| {
            s.buffer.upgrade().is_some_and(|b| Arc::ptr_eq(&b, buffer))
                && s.version == tensor.version()
                && s.span == span
                && s.dtype == tensor.dtype()
                && s.compression == compression
        });
        if let Some(shared) = shared {
            return Ok(Arc::clone(&shared.encoded));
        }
        let dense = match &span {
            Span::Dense { offset, numel } => tensor.as_strided(&[*numel], &[1], *offset)?,
            Span::Strided { .. } => tensor.contiguous()?.reshape(&[tensor.numel()])?,
        };
        let encoded = Arc::new(Encoded::encode(&dense, compression)?);
        spans.retain(|s| s.buffer.strong_count() > 0);
        spans.push(SharedSpan {
            buffer: Arc::downgrade(buffer),
            version: tensor.version(),
            span,
            dtype: tensor.dtype(),
            compression,
            encoded: Arc::clone(&encoded),
        });
        Ok(encoded)
    }
}

impl Encoded {
    /// Encodes `flat`, a contiguous 1-D tensor.
    fn encode(flat: &Tensor, compression: Compression) -> Result<Encoded, CheckpointError> {
        let dtype = flat.dtype();
        match compression {
            Compression::Bf16 => Ok(Encoded::Bf16 {
                dtype,
                data: flat.to_dtype(DType::BF16)?,
            }),
            Compression::Int8Blockwise { block } => {
                let numel = flat.numel();
                let codes = Tensor::empty(flat.backend(), &[numel], DType::U8)?;
                let absmax = Tensor::empty(flat.backend(), &[numel.div_ceil(block)], DType::F32)?;
                match flat.device() {
                    Device::Cpu => host::quantize(flat, block, &codes, &absmax)?,
                    Device::Cuda(_) => cuda_quantize(flat, block, &codes, &absmax)?,
                }
                Ok(Encoded::Int8 {
                    dtype,
                    codes,
                    absmax,
                    block,
                })
            }
        }
    }

    /// The saved elements again, as a contiguous 1-D tensor of the saved dtype.
    fn decode(&self) -> Result<Tensor, CheckpointError> {
        match self {
            Encoded::Bf16 { dtype, data } => Ok(data.to_dtype(*dtype)?),
            Encoded::Int8 {
                dtype,
                codes,
                absmax,
                block,
            } => {
                let out = Tensor::empty(codes.backend(), &[codes.numel()], *dtype)?;
                match codes.device() {
                    Device::Cpu => host::dequantize(codes, absmax, *block, &out)?,
                    Device::Cuda(_) => cuda_dequantize(codes, absmax, *block, &out)?,
                }
                Ok(out)
            }
        }
    }
}

#[cfg(feature = "cuda")]
use cuda::{dequantize as cuda_dequantize, quantize as cuda_quantize};

#[cfg(not(feature = "cuda"))]
fn cuda_quantize(_: &Tensor, _: usize, _: &Tensor, _: &Tensor) -> Result<(), CheckpointError> {
    Err(no_cuda())
}

#[cfg(not(feature = "cuda"))]
fn cuda_dequantize(_: &Tensor, _: &Tensor, _: usize, _: &Tensor) -> Result<(), CheckpointError> {
    Err(no_cuda())
}

#[cfg(not(feature = "cuda"))]
fn no_cuda() -> CheckpointError {
    CheckpointError::InvalidArgument {
        op: "compress",
        reason: "8-bit compression of CUDA tensors needs headroom-checkpoint's `cuda` feature \
                 (or use Compression::Bf16)"
            .into(),
    }
}

/// Whether a view covers exactly `numel` consecutive elements of its storage, in some dim order.
fn is_dense(shape: &[usize], strides: &[usize]) -> bool {
    let mut dims: Vec<(usize, usize)> = shape
        .iter()
        .zip(strides)
        .filter(|(&size, _)| size != 1)
        .map(|(&size, &stride)| (stride, size))
        .collect();
    dims.sort_unstable();
    let mut expected = 1;
    for (stride, size) in dims {
        if stride != expected {
            return false;
        }
        expected *= size;
    }
    true
}

/// Row-major strides of `shape`.
fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1];
    }
    strides
}

/// The 8-bit codec on CPU tensors, over their host memory, in parallel chunks of blocks.
mod host {
    use half::{bf16, f16};
    use headroom_autograd_core::{Access, DType, Element, HostAccess, Tensor};

    use super::codec::{dequantize_int8_blockwise, quantize_int8_blockwise, CodecElement};
    use super::*;

    /// Claims the buffers a codec pass touches (`read` shared, `written` alone) after checking
    /// that each is host memory: a CPU tensor of a backend whose storage is not host memory
    /// (a simulated device) has addresses nothing may dereference.
    fn claim<'a>(
        op: &'static str,
        read: &[&'a Tensor],
        written: &[&'a Tensor],
    ) -> Result<HostAccess<'a>, CheckpointError> {
        let all = read.iter().map(|t| (*t, Access::Read));
        let all = all.chain(written.iter().map(|t| (*t, Access::Write)));
        for (tensor, _) in all.clone() {
            if tensor.numel() > 0 && !tensor.buffer().is_host_memory() {
                return Err(CheckpointError::InvalidArgument {
                    op,
                    reason: "a CPU tensor whose memory is not host memory (its backend's storage \
                             is not a host storage) cannot be compressed on the host"
                        .into(),
                });
            }
        }
        Ok(HostAccess::claim(
            op,
            all.map(|(tensor, access)| (&**tensor.buffer(), access)),
        )?)
    }

    /// The elements of a contiguous CPU tensor.
    ///
    /// # Safety
    /// No mutable slice of the same memory may be alive while the returned one is, and the
    /// tensor must outlive it.
    unsafe fn elements<T: Element>(tensor: &Tensor) -> &[T] {
        debug_assert!(tensor.is_contiguous() && tensor.dtype() == T::DTYPE);
        let size = std::mem::size_of::<T>();
        let start = tensor.buffer().address() as usize + tensor.layout().offset() * size;
        // SAFETY: a CPU tensor's buffer address is a live host allocation of the CPU backend's
        // allocator covering the tensor's extent (autograd-core checks layouts against
        // buffers), aligned for the dtype (512-byte rounding; offsets are whole elements); the
        // caller guarantees that nothing writes it meanwhile.
        unsafe { std::slice::from_raw_parts(start as *const T, tensor.numel()) }
    }

    /// The elements of a contiguous CPU tensor, writable.
    ///
    /// # Safety
    /// The memory must not be reachable through any other live slice, and the tensor must
    /// outlive the slice.
    #[allow(clippy::mut_from_ref)]
    unsafe fn elements_mut<T: Element>(tensor: &Tensor) -> &mut [T] {
        debug_assert!(tensor.is_contiguous() && tensor.dtype() == T::DTYPE);
        let size = std::mem::size_of::<T>();
        let start = tensor.buffer().address() as usize + tensor.layout().offset() * size;
        // SAFETY: as in `elements`; exclusivity is the caller's obligation.
        unsafe { std::slice::from_raw_parts_mut(start as *mut T, tensor.numel()) }
    }

    pub(super) fn quantize(
        x: &Tensor,
        block: usize,
        codes: &Tensor,
        absmax: &Tensor,
    ) -> Result<(), CheckpointError> {
        let _access = claim("compress", &[x], &[codes, absmax])?;
        fn run<T: Element + CodecElement>(
            x: &Tensor,
            block: usize,
            codes: &Tensor,
            absmax: &Tensor,
        ) -> Result<(), CheckpointError> {
            // SAFETY: host memory (checked), claimed above: `x` shared, `codes` and `absmax`
            // alone (a conflicting claim would have failed), so no other thread writes `x` or
            // touches the outputs while the slices live; all three outlive them.
            let (x, codes, absmax) = unsafe {
                (
                    elements::<T>(x),
                    elements_mut::<u8>(codes),
                    elements_mut::<f32>(absmax),
                )
            };
            quantize_int8_blockwise(x, block, bytemuck::cast_slice_mut(codes), absmax)
        }
        match x.dtype() {
            DType::F32 => run::<f32>(x, block, codes, absmax),
            DType::F64 => run::<f64>(x, block, codes, absmax),
            DType::BF16 => run::<bf16>(x, block, codes, absmax),
            DType::F16 => run::<f16>(x, block, codes, absmax),
            other => Err(unsupported(other)),
        }
    }

    pub(super) fn dequantize(
        codes: &Tensor,
        absmax: &Tensor,
        block: usize,
        out: &Tensor,
    ) -> Result<(), CheckpointError> {
        let _access = claim("decompress", &[codes, absmax], &[out])?;
        fn run<T: Element + CodecElement>(
            codes: &Tensor,
            absmax: &Tensor,
            block: usize,
            out: &Tensor,
        ) -> Result<(), CheckpointError> {
            // SAFETY: host memory (checked), claimed above: `codes` and `absmax` shared, `out`
            // alone, so nothing writes what the slices read or reaches what they write; all
            // outlive the slices.
            let (codes, absmax, out) = unsafe {
                (
                    elements::<u8>(codes),
                    elements::<f32>(absmax),
                    elements_mut::<T>(out),
                )
            };
            dequantize_int8_blockwise(bytemuck::cast_slice(codes), absmax, block, out)
        }
        match out.dtype() {
            DType::F32 => run::<f32>(codes, absmax, block, out),
            DType::F64 => run::<f64>(codes, absmax, block, out),
            DType::BF16 => run::<bf16>(codes, absmax, block, out),
            DType::F16 => run::<f16>(codes, absmax, block, out),
            other => Err(unsupported(other)),
        }
    }

    fn unsupported(dtype: DType) -> CheckpointError {
        CheckpointError::InvalidArgument {
            op: "compress",
            reason: format!("{dtype:?} tensors are not compressed (floating dtypes only)"),
        }
    }
}
