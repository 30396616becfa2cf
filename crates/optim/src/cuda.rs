//! Fused Adam / AdamW and bitsandbytes' 8-bit blockwise Adam on CUDA device buffers: one launch
//! updates every parameter of a list.
//!
//! [`CudaFusedAdam`] is the raw-buffer layer on the GPU: a trainer that owns device memory hands
//! it the addresses of each parameter, gradient and state buffer once, and calls
//! [`CudaFusedAdam::step`] each step. The kernel (`kernels/adam.cu`) reads p, g, m and v once and
//! writes p, m and v once per element, splitting the list into 64 Ki-element chunks (one block
//! each), and applies the same float32 operations in the same order as
//! [`crate::kernels::adam_fused`], so CPU and GPU agree to the bit. The gradient scale and
//! found-inf flag are read from device memory: unscale and skip need no host synchronisation.
//!
//! It sits on headroom-ops-cuda's backend (context, stream, caching allocator, kernel loading);
//! no cudarc type appears here.

use std::sync::Arc;

use headroom_caching_allocator::Allocation;
use headroom_ops_cuda::{CudaBackend, CudaKernel, KernelArg};

use crate::adam8bit::bnb_maps;
use crate::error::OptimError;
use crate::kernels::{
    Adam8bitConfig, Adam8bitConsts, AdamConfig, StepConsts, BNB_BLOCK_SIZE, MIN_8BIT_SIZE,
};

/// Elements per block of the fused kernel.
const CHUNK: usize = 1 << 16;
const THREADS: u32 = 512;
const PTX: &str = include_str!("../kernels/ptx/adam.ptx");
const PTX_8BIT: &str = include_str!("../kernels/ptx/adam8bit.ptx");

/// One parameter's device buffers (f32, `len` elements each), by address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceAdamParam {
    /// The parameter.
    pub param: u64,
    /// Its gradient.
    pub grad: u64,
    /// First moment.
    pub exp_avg: u64,
    /// Second moment.
    pub exp_avg_sq: u64,
    /// Running maximum of the second moment (AMSGrad), if used.
    pub max_exp_avg_sq: Option<u64>,
    /// Elements.
    pub len: usize,
}

/// Fused Adam over a fixed list of device parameters.
#[derive(Debug)]
pub struct CudaFusedAdam {
    backend: Arc<CudaBackend>,
    kernel: CudaKernel,
    /// The chunk table on the device.
    chunks: Option<Allocation>,
    n_chunks: u32,
    amsgrad: bool,
}

impl CudaFusedAdam {
    /// Prepares the chunk table for `params` (uploaded once, from the backend's allocator).
    ///
    /// # Safety
    /// Every address in `params` must be a live f32 buffer of `len` elements on `backend`'s
    /// device for as long as this value is used, and the buffers of different parameters must
    /// not overlap.
    pub unsafe fn new(
        backend: Arc<CudaBackend>,
        params: &[DeviceAdamParam],
    ) -> Result<CudaFusedAdam, OptimError> {
        let kernel = backend
            .load_kernel("headroom_optim::adam", PTX, "adam_fused_f32")
            .map_err(|e| OptimError::UnsupportedTensor {
                op: "CudaFusedAdam",
                reason: e.to_string(),
            })?;
        let amsgrad = params.iter().any(|p| p.max_exp_avg_sq.is_some());
        if amsgrad && !params.iter().all(|p| p.max_exp_avg_sq.is_some()) {
            return Err(OptimError::InvalidArgument {
                op: "CudaFusedAdam",
                reason: "either every parameter or none has an AMSGrad buffer".into(),
            });
        }
        let mut table: Vec<u8> = Vec::new();
        let mut n_chunks = 0u32;
        for p in params {
            for start in (0..p.len).step_by(CHUNK) {
                let len = CHUNK.min(p.len - start) as u64;
                for field in [
                    p.param,
                    p.grad,
                    p.exp_avg,
                    p.exp_avg_sq,
                    p.max_exp_avg_sq.unwrap_or(0),
                    start as u64,
                    len,
                ] {
                    table.extend(field.to_le_bytes());
                }
                n_chunks += 1;
            }
        }
        let chunks = if table.is_empty() {
            None
        } else {
            Some(backend.upload(&table)?)
        };
        Ok(CudaFusedAdam {
            backend,
            kernel,
            chunks,
            n_chunks,
            amsgrad,
        })
    }

    /// Adam step number `step` (counted from 1) on every parameter. `grad_scale` and
    /// `found_inf` are device addresses of one f32 each (the GradScaler's): gradients are divided
    /// by the scale, and nothing is written when the flag is non-zero.
    pub fn step(
        &self,
        cfg: &AdamConfig,
        step: u64,
        grad_scale: Option<u64>,
        found_inf: Option<u64>,
    ) -> Result<(), OptimError> {
        if cfg.amsgrad != self.amsgrad {
            return Err(OptimError::InvalidArgument {
                op: "CudaFusedAdam::step",
                reason: "amsgrad differs from the buffers given at creation".into(),
            });
        }
        let Some(chunks) = &self.chunks else {
            return Ok(());
        };
        let c = StepConsts::new(cfg, step);
        let args = [
            KernelArg::U64(chunks.address()),
            KernelArg::I32(i32::from(c.maximize)),
            KernelArg::I32(i32::from(c.l2.is_some())),
            KernelArg::I32(i32::from(c.decay_factor.is_some())),
            KernelArg::F32(c.l2.unwrap_or(0.0)),
            KernelArg::F32(c.decay_factor.unwrap_or(1.0)),
            KernelArg::F32(c.one_minus_beta1),
            KernelArg::F32(c.beta2),
            KernelArg::F32(c.one_minus_beta2),
            KernelArg::F32(c.bias_correction2_sqrt),
            KernelArg::F32(c.eps),
            KernelArg::F32(c.neg_step_size),
            KernelArg::U64(grad_scale.unwrap_or(0)),
            KernelArg::U64(found_inf.unwrap_or(0)),
        ];
        // SAFETY: the arguments follow `adam_fused_f32`'s parameters in order and type; the
        // chunk table is live (owned here) and every address in it is live device memory by
        // `new`'s contract; the scale and flag addresses, when given, are live f32s by this
        // method's contract.
        unsafe {
            self.backend
                .launch_kernel(&self.kernel, self.n_chunks, THREADS, 0, &args)
        }?;
        Ok(())
    }
}

impl Drop for CudaFusedAdam {
    fn drop(&mut self) {
        if let Some(chunks) = self.chunks.take() {
            // The chunk table goes back in stream order; a failed free cannot be reported here.
            let _ = self.backend.allocator().free(chunks);
        }
    }
}

/// One parameter's device buffers for 8-bit Adam, by address: f32 parameter and gradient of
/// `len` elements, u8 state codes of `len`, f32 absmax of `len.div_ceil(256)` blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceAdam8bitParam {
    /// The parameter.
    pub param: u64,
    /// Its gradient.
    pub grad: u64,
    /// First-state codes (signed map).
    pub state1: u64,
    /// Second-state codes (unsigned map).
    pub state2: u64,
    /// Per-block scales of the first state.
    pub absmax1: u64,
    /// Per-block scales of the second state.
    pub absmax2: u64,
    /// Elements (at least `MIN_8BIT_SIZE`; smaller tensors keep 32-bit state in bitsandbytes).
    pub len: usize,
}

/// bitsandbytes' 8-bit blockwise Adam over a fixed list of device parameters.
#[derive(Debug)]
pub struct CudaAdam8bit {
    backend: Arc<CudaBackend>,
    kernel: CudaKernel,
    /// Tensor table, then the two quantization maps.
    table: Option<Allocation>,
    maps: Option<Allocation>,
    n_tensors: u32,
    n_blocks: u64,
}

impl CudaAdam8bit {
    /// Uploads the tensor table and bitsandbytes' two dynamic maps.
    ///
    /// # Safety
    /// Every address in `params` must be live memory of `backend`'s device of the sizes
    /// [`DeviceAdam8bitParam`] describes, for as long as this value is used, and the buffers
    /// of different parameters must not overlap.
    pub unsafe fn new(
        backend: Arc<CudaBackend>,
        params: &[DeviceAdam8bitParam],
    ) -> Result<CudaAdam8bit, OptimError> {
        const OP: &str = "CudaAdam8bit";
        if let Some(small) = params.iter().find(|p| p.len < MIN_8BIT_SIZE) {
            return Err(OptimError::InvalidArgument {
                op: OP,
                reason: format!(
                    "a parameter of {} elements is under min_8bit_size ({MIN_8BIT_SIZE}); \
                     bitsandbytes keeps 32-bit state for it",
                    small.len
                ),
            });
        }
        let kernel = backend
            .load_kernel(
                "headroom_optim::adam8bit",
                PTX_8BIT,
                "adam8bit_blockwise_f32",
            )
            .map_err(|e| OptimError::UnsupportedTensor {
                op: OP,
                reason: e.to_string(),
            })?;
        let mut table: Vec<u8> = Vec::new();
        let mut n_blocks = 0u64;
        for p in params {
            for field in [
                p.param,
                p.grad,
                p.state1,
                p.state2,
                p.absmax1,
                p.absmax2,
                p.len as u64,
                n_blocks,
            ] {
                table.extend(field.to_le_bytes());
            }
            n_blocks += p.len.div_ceil(BNB_BLOCK_SIZE) as u64;
        }
        let (signed, unsigned) = bnb_maps();
        let maps: Vec<u8> = signed
            .iter()
            .chain(unsigned.iter())
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let table = if table.is_empty() {
            None
        } else {
            Some(backend.upload(&table)?)
        };
        let maps = Some(backend.upload(&maps)?);
        Ok(CudaAdam8bit {
            backend,
            kernel,
            table,
            maps,
            n_tensors: params.len() as u32,
            n_blocks,
        })
    }

    /// 8-bit Adam step number `step` (from 1) on every parameter; `grad_scale` and `found_inf`
    /// as in [`CudaFusedAdam::step`].
    pub fn step(
        &self,
        cfg: &Adam8bitConfig,
        step: u64,
        grad_scale: Option<u64>,
        found_inf: Option<u64>,
    ) -> Result<(), OptimError> {
        let (Some(table), Some(maps)) = (&self.table, &self.maps) else {
            return Ok(());
        };
        let c = Adam8bitConsts::new(cfg, step);
        let args = [
            KernelArg::U64(table.address()),
            KernelArg::U32(self.n_tensors),
            KernelArg::U64(self.n_blocks),
            KernelArg::U64(maps.address()),
            KernelArg::U64(maps.address() + 256 * 4),
            KernelArg::F32(c.beta1),
            KernelArg::F32(c.beta2),
            KernelArg::F32(c.one_minus_beta1),
            KernelArg::F32(c.one_minus_beta2),
            KernelArg::F32(c.correction2),
            KernelArg::F32(c.eps),
            KernelArg::F32(c.step_size),
            KernelArg::I32(i32::from(c.decay_factor.is_some())),
            KernelArg::F32(c.decay_factor.unwrap_or(1.0)),
            KernelArg::U64(grad_scale.unwrap_or(0)),
            KernelArg::U64(found_inf.unwrap_or(0)),
        ];
        // Eight warps per block of 256 threads, one quantization block per warp at a time.
        let grid = self.n_blocks.div_ceil(8).clamp(1, 132 * 32) as u32;
        // SAFETY: the arguments follow `adam8bit_blockwise_f32`'s parameters in order and type;
        // the table and maps are live (owned here); the addresses in the table are live by
        // `new`'s contract, and the scale and flag addresses by this method's.
        unsafe {
            self.backend
                .launch_kernel(&self.kernel, grid, BNB_BLOCK_SIZE as u32, 0, &args)
        }?;
        Ok(())
    }
}

impl Drop for CudaAdam8bit {
    fn drop(&mut self) {
        for allocation in [self.table.take(), self.maps.take()].into_iter().flatten() {
            // Goes back in stream order; a failed free cannot be reported from a drop.
            let _ = self.backend.allocator().free(allocation);
        }
    }
}
