//! Checkpointing a model's blocks without editing the model, and `checkpoint_sequential`.
//!
//! [`CheckpointBlocks`] is an nn [`BlockRunner`]: set it as a model's block runner
//! ([`BlockStack::set_block_runner`](headroom_nn::BlockStack::set_block_runner), the same on
//! ViT, GPT-2 or any model with blocks) and the chosen blocks run through [`checkpoint_with`],
//! each keeping only its input; [`SplitBlocks`] runs the first blocks of a model through one
//! runner and the rest through another. [`checkpoint_sequential`] is PyTorch's `checkpoint_sequential`:
//! a chain of blocks cut into segments, every segment but the last checkpointed. This module
//! sits on `crate::region` and nn's block seam; it knows no particular model.

use std::sync::Arc;

use headroom_autograd_core::{Tensor, TensorError};
use headroom_nn::{BlockForward, BlockRunner, NnError};

use crate::error::CheckpointError;
use crate::region::{checkpoint_with, CheckpointOptions};

/// Which blocks of a model a [`CheckpointBlocks`] checkpoints.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BlockSelection {
    /// Every block.
    All,
    /// Blocks 0, k, 2k, ... (`Every(1)` is every block).
    Every(usize),
    /// The listed blocks.
    Indices(Vec<usize>),
    /// Blocks `0..n`.
    First(usize),
}

impl BlockSelection {
    /// Whether block `index` is checkpointed.
    pub fn contains(&self, index: usize) -> bool {
        match self {
            BlockSelection::All => true,
            BlockSelection::Every(k) => *k > 0 && index.is_multiple_of(*k),
            BlockSelection::Indices(indices) => indices.contains(&index),
            BlockSelection::First(n) => index < *n,
        }
    }
}

/// Runs a model's blocks, checkpointing the selected ones (an nn [`BlockRunner`]), attached to
/// any model with blocks through
/// [`BlockStack::set_block_runner`](headroom_nn::BlockStack::set_block_runner):
///
/// ```
/// use std::sync::Arc;
/// use headroom_autograd_core::{DType, Generator, Tensor};
/// use headroom_checkpoint::CheckpointBlocks;
/// use headroom_nn::{BlockStack, Gpt2Config, Gpt2LMHeadModel, VisionTransformer, VitConfig};
///
/// /// Checkpoints every block but the last, whatever the model.
/// fn checkpoint_blocks(model: &mut impl BlockStack) {
///     let runner = CheckpointBlocks::all_but_last(model.n_blocks());
///     model.set_block_runner(Some(Arc::new(runner)));
/// }
///
/// let cpu = headroom_ops_cpu::CpuBackend::new_ref();
/// let generator = Arc::new(Generator::new(0));
/// let mut vit = VisionTransformer::new(&cpu, VitConfig::tiny(), DType::F32, &generator)?;
/// let mut gpt2 = Gpt2LMHeadModel::new(&cpu, Gpt2Config::tiny(), DType::F32, &generator)?;
/// checkpoint_blocks(&mut vit);
/// checkpoint_blocks(&mut gpt2);
///
/// let images = Tensor::ones(&cpu, &[2, 3, 32, 32], DType::F32)?;
/// vit.forward(&images)?.sum_all()?.backward()?;
/// let ids = Tensor::from_slice(&cpu, &[1i64, 2, 3, 4], &[2, 2])?;
/// gpt2.loss(&gpt2.forward(&ids)?, &ids)?.backward()?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct CheckpointBlocks {
    /// The blocks to checkpoint.
    pub selection: BlockSelection,
    /// How each is checkpointed.
    pub options: CheckpointOptions,
}

impl CheckpointBlocks {
    /// Every block, with the default options (keep each block's input, recompute the rest).
    pub fn all() -> CheckpointBlocks {
        CheckpointBlocks {
            selection: BlockSelection::All,
            options: CheckpointOptions::default(),
        }
    }

    /// Every block of a model of `num_blocks` but the last, with the default options. The last
    /// block's backward comes right after its forward, so recomputing it would free nothing: its
    /// saved tensors live across the head alone either way, and the block inputs kept for the
    /// others make up the same peak. It saves one block's recomputation for the same memory
    /// (PyTorch's `checkpoint_sequential` leaves its last segment alone for the same reason).
    pub fn all_but_last(num_blocks: usize) -> CheckpointBlocks {
        CheckpointBlocks {
            selection: BlockSelection::First(num_blocks.saturating_sub(1)),
            options: CheckpointOptions::default(),
        }
    }
}

impl BlockRunner for CheckpointBlocks {
    fn run(
        &self,
        index: usize,
        block: BlockForward,
        input: &Tensor,
    ) -> headroom_nn::Result<Tensor> {
        if !self.selection.contains(index) {
            return block(input);
        }
        let outputs = checkpoint_with(
            move |inputs| Ok(vec![block(&inputs[0]).map_err(nn_to_tensor)?]),
            std::slice::from_ref(input),
            &self.options,
        )
        .map_err(CheckpointError::into_nn_error)?;
        Ok(outputs.into_iter().next().expect("one output"))
    }
}

/// Two strategies over one model: blocks below `split` run through `first`, the others through
/// `rest` (each sees the model's block index). Recomputing the first blocks and offloading most
/// of the others, kept last in backward and brought back while few gradients exist, peaks where
/// uniform checkpointing does at a fraction of its recompute (bench-memory's
/// `adam_offload_ckpt`).
#[derive(Clone)]
pub struct SplitBlocks {
    /// The first block of `rest`.
    pub split: usize,
    /// Runs blocks `0..split`.
    pub first: Arc<dyn BlockRunner>,
    /// Runs blocks `split..`.
    pub rest: Arc<dyn BlockRunner>,
}

impl std::fmt::Debug for SplitBlocks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SplitBlocks")
            .field("split", &self.split)
            .finish_non_exhaustive()
    }
}

impl BlockRunner for SplitBlocks {
    fn run(
        &self,
        index: usize,
        block: BlockForward,
        input: &Tensor,
    ) -> headroom_nn::Result<Tensor> {
        match index < self.split {
            true => self.first.run(index, block, input),
            false => self.rest.run(index, block, input),
        }
    }
}

/// `NnError` → `TensorError`, for a block run inside a region.
pub(crate) fn nn_to_tensor(err: NnError) -> TensorError {
    match err {
        NnError::Tensor(err) => err,
        other => TensorError::hook("block", other),
    }
}

/// Runs `blocks` one after another on `input`, cut into `segments` segments of
/// `blocks.len() / segments` blocks: every segment but the last is checkpointed (only its input
/// is kept), the last runs normally — PyTorch's `checkpoint_sequential`.
pub fn checkpoint_sequential(
    blocks: &[BlockForward],
    segments: usize,
    input: &Tensor,
    options: &CheckpointOptions,
) -> Result<Tensor, CheckpointError> {
    if segments == 0 || segments > blocks.len().max(1) {
        return Err(CheckpointError::InvalidArgument {
            op: "checkpoint_sequential",
            reason: format!(
                "{segments} segments for {} blocks; give between 1 and the number of blocks",
                blocks.len()
            ),
        });
    }
    let segment_size = blocks.len() / segments;
    let mut x = input.clone();
    let mut start = 0;
    for _ in 0..segments - 1 {
        let segment: Vec<BlockForward> = blocks[start..start + segment_size].to_vec();
        let run = move |inputs: &[Tensor]| {
            let mut y = inputs[0].clone();
            for block in &segment {
                y = block(&y).map_err(nn_to_tensor)?;
            }
            Ok(vec![y])
        };
        x = checkpoint_with(run, std::slice::from_ref(&x), options)?
            .into_iter()
            .next()
            .expect("one output");
        start += segment_size;
    }
    for block in &blocks[start..] {
        x = block(&x)?;
    }
    Ok(x)
}

/// The blocks of a model as [`BlockForward`]s (for [`checkpoint_sequential`]).
pub fn block_forwards<B: Clone + Send + Sync + 'static>(
    blocks: &[B],
    forward: fn(&B, &Tensor) -> headroom_nn::Result<Tensor>,
) -> Vec<BlockForward> {
    blocks
        .iter()
        .map(|block| {
            let block = block.clone();
            Arc::new(move |x: &Tensor| forward(&block, x)) as BlockForward
        })
        .collect()
}
